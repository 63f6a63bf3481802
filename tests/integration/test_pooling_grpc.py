"""Pooling requests over the gRPC contract: Stream and Generate return the pooled result in one
final output; GetModelInfo reports what the model serves; bad requests get the contract's codes.

The engines here run in this process (``InProcessEngine``) around tiny pooling checkpoints
(``tiny_pooling_models``); one test starts the real ``python -m engine_svc`` with
``--pooling-type``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from engine_svc.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine_svc.engine_core import EngineCore
from protos.tandem.engine.v1 import engine_pb2 as pb
from protos.tandem.engine.v1 import engine_pb2_grpc as pb_grpc
from tests.integration.grpc_util import StreamSession, add_request, generate
from tests.integration.harness import Engine
from tests.integration.inprocess import InProcessEngine

pytestmark = pytest.mark.timeout(120)
PROMPT = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24]
MAX_LEN = 128


def _core(model_dir: Path) -> EngineCore:
    return EngineCore(
        EngineConfig(
            model=ModelConfig(str(model_dir), dtype="float32", max_model_len=MAX_LEN),
            cache=CacheConfig(num_kv_blocks=64),
            scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256),
        )
    )


@pytest.fixture(scope="module")
def embed_stub(tiny_pooling_models: dict[str, Path]) -> Iterator[pb_grpc.EngineStub]:
    server = InProcessEngine(lambda: _core(tiny_pooling_models["embed"])).start()
    try:
        with grpc.insecure_channel(server.address) as channel:
            yield pb_grpc.EngineStub(channel)
    finally:
        server.stop()


@pytest.fixture(scope="module")
def rerank_stub(tiny_pooling_models: dict[str, Path]) -> Iterator[pb_grpc.EngineStub]:
    server = InProcessEngine(lambda: _core(tiny_pooling_models["cross_encoder"])).start()
    try:
        with grpc.insecure_channel(server.address) as channel:
            yield pb_grpc.EngineStub(channel)
    finally:
        server.stop()


def _pooling(rid: str, prompt: list[int], task: int, **params: object) -> pb.AddRequest:
    return pb.AddRequest(
        request_id=rid,
        prompt_token_ids=prompt,
        pooling_params=pb.PoolingParams(task=task, **params),  # type: ignore[arg-type]
    )


@torch.inference_mode()
def _hf_last_state(model_dir: Path, prompt: list[int]) -> np.ndarray:
    from transformers import AutoModel

    hf = AutoModel.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    state: np.ndarray = (
        hf(ids, attention_mask=torch.ones_like(ids)).last_hidden_state[0, -1].numpy()
    )
    return state


def _status(stub: pb_grpc.EngineStub, request: pb.AddRequest) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        generate(stub, request)
    return info.value


# ---------------------------------------------------------------------------------- GetModelInfo
def test_model_info_of_an_embedding_model(embed_stub: pb_grpc.EngineStub) -> None:
    info = embed_stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert list(info.supported_tasks) == ["generate", "embed"]
    assert info.embedding_size == 64
    assert info.pooling_type == "LAST"  # from the checkpoint's 1_Pooling/config.json
    assert info.is_matryoshka and not info.matryoshka_dimensions
    assert not info.labels


def test_model_info_of_a_cross_encoder(rerank_stub: pb_grpc.EngineStub) -> None:
    info = rerank_stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert list(info.supported_tasks) == ["classify", "score"]
    assert (info.embedding_size, info.pooling_type, info.is_matryoshka) == (0, "", False)
    assert list(info.labels) == ["LABEL_0"]


# ---------------------------------------------------------------------------------- results
def test_stream_returns_one_pooled_output_beside_generation(
    embed_stub: pb_grpc.EngineStub, tiny_pooling_models: dict[str, Path]
) -> None:
    session = StreamSession(embed_stub)
    session.add(add_request("gen", PROMPT, 6))
    session.add(_pooling("emb", PROMPT, pb.POOLING_TASK_EMBED))
    session.add(_pooling("emb-raw", PROMPT, pb.POOLING_TASK_EMBED, normalize=False))
    session.add(_pooling("emb-16", PROMPT, pb.POOLING_TASK_EMBED, dimensions=16))
    session.half_close()
    outputs: dict[str, list[pb.RequestOutput]] = {}
    for message in session:
        assert not message.errors, message.errors
        for o in message.outputs:
            outputs.setdefault(o.request_id, []).append(o)
    state = _hf_last_state(tiny_pooling_models["embed"], PROMPT)
    want = {
        "emb": state / np.linalg.norm(state),
        "emb-raw": state,
        "emb-16": state[:16] / np.linalg.norm(state[:16]),
    }
    for rid, vector in want.items():
        (final,) = outputs[rid]  # exactly one output: the final one
        assert final.finish_reason == pb.FINISH_REASON_STOP
        assert not final.new_token_ids and not final.HasField("stop_reason")
        assert final.num_prompt_tokens == len(PROMPT)
        np.testing.assert_allclose(np.array(final.pooled.data), vector, rtol=1e-4, atol=1e-5)
    generated = [t for o in outputs["gen"] for t in o.new_token_ids]
    assert len(generated) == 6 and not outputs["gen"][0].HasField("pooled")


def test_generate_rpc_answers_a_pooling_request_once(embed_stub: pb_grpc.EngineStub) -> None:
    request = _pooling("", PROMPT, pb.POOLING_TASK_EMBED)  # empty id: the engine picks one
    (response,) = generate(embed_stub, request)
    out = response.output
    assert out.request_id.startswith("gen-")
    assert out.finish_reason == pb.FINISH_REASON_STOP and not out.new_token_ids
    assert len(out.pooled.data) == 64
    assert abs(float(np.linalg.norm(out.pooled.data)) - 1.0) < 1e-5
    assert out.HasField("queued_time_s") and out.HasField("prefill_time_s")


def test_a_pooling_prompt_may_fill_the_context(embed_stub: pb_grpc.EngineStub) -> None:
    full = [5 + i % 300 for i in range(MAX_LEN)]
    (response,) = generate(embed_stub, _pooling("full", full, pb.POOLING_TASK_EMBED))
    assert response.output.num_prompt_tokens == MAX_LEN and len(response.output.pooled.data) == 64
    error = _status(embed_stub, add_request("full-gen", full, 1))  # generation needs one more
    assert error.code() == grpc.StatusCode.OUT_OF_RANGE  # type: ignore[attr-defined]


def test_cross_encoder_score_and_classify(rerank_stub: pb_grpc.EngineStub) -> None:
    (score,) = generate(rerank_stub, _pooling("s", PROMPT, pb.POOLING_TASK_SCORE))
    (raw,) = generate(rerank_stub, _pooling("r", PROMPT, pb.POOLING_TASK_SCORE, activation=False))
    (probs,) = generate(rerank_stub, _pooling("c", PROMPT, pb.POOLING_TASK_CLASSIFY))
    logit = raw.output.pooled.data[0]
    assert len(score.output.pooled.data) == 1
    assert score.output.pooled.data[0] == pytest.approx(1 / (1 + np.exp(-logit)), rel=1e-5)
    # One label: classify is the same sigmoid (the prefix cache served part of this prompt, so
    # equal up to float rounding).
    assert probs.output.pooled.data[0] == pytest.approx(score.output.pooled.data[0], rel=1e-5)


# ---------------------------------------------------------------------------------- errors
def test_bad_pooling_requests_are_invalid_argument(embed_stub: pb_grpc.EngineStub) -> None:
    cases = {
        "unset task": (_pooling("a", PROMPT, pb.POOLING_TASK_UNSPECIFIED), "pooling_params.task"),
        "not served": (_pooling("b", PROMPT, pb.POOLING_TASK_CLASSIFY), "pooling_params.task"),
        "unknown task": (_pooling("c", PROMPT, 9), "pooling_params.task"),
        "dims 0": (_pooling("d", PROMPT, pb.POOLING_TASK_EMBED, dimensions=0), "dimensions"),
        "dims 65": (_pooling("e", PROMPT, pb.POOLING_TASK_EMBED, dimensions=65), "dimensions"),
        "activation": (
            _pooling("f", PROMPT, pb.POOLING_TASK_EMBED, activation=True),
            "pooling_params.activation",
        ),
        "vocab": (_pooling("g", [100_000], pb.POOLING_TASK_EMBED), "prompt_token_ids"),
    }
    for name, (request, field) in cases.items():
        error = _status(embed_stub, request)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, name  # type: ignore[attr-defined]
        assert field in error.details(), (name, error.details())  # type: ignore[attr-defined]
    served = _status(embed_stub, cases["not served"][0]).details()  # type: ignore[attr-defined]
    assert "generate, embed" in served
    too_long = _pooling("h", [5] * (MAX_LEN + 1), pb.POOLING_TASK_EMBED)
    assert _status(embed_stub, too_long).code() == grpc.StatusCode.OUT_OF_RANGE  # type: ignore[attr-defined]


def test_a_cross_encoder_refuses_generation_and_embedding(rerank_stub: pb_grpc.EngineStub) -> None:
    error = _status(rerank_stub, add_request("g", PROMPT, 4))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    assert "classify, score" in error.details()  # type: ignore[attr-defined]
    cases = {
        "pooling_params.task": _pooling("e", PROMPT, pb.POOLING_TASK_EMBED),
        "pooling_params.dimensions": _pooling("d", PROMPT, pb.POOLING_TASK_SCORE, dimensions=1),
        "pooling_params.normalize": _pooling("n", PROMPT, pb.POOLING_TASK_CLASSIFY, normalize=True),
    }
    for field, request in cases.items():
        error = _status(rerank_stub, request)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, field  # type: ignore[attr-defined]
        assert field in error.details(), error.details()  # type: ignore[attr-defined]


def test_stream_reports_a_bad_pooling_request_and_carries_on(
    embed_stub: pb_grpc.EngineStub,
) -> None:
    session = StreamSession(embed_stub)
    session.add(_pooling("bad", PROMPT, pb.POOLING_TASK_SCORE))
    session.add(_pooling("good", PROMPT, pb.POOLING_TASK_EMBED))
    session.half_close()
    errors, finals = [], []
    for message in session:
        errors += list(message.errors)
        finals += [o for o in message.outputs if o.finish_reason]
    assert [(e.request_id, e.code) for e in errors] == [("bad", pb.ERROR_CODE_INVALID_ARGUMENT)]
    assert "pooling_params.task" in errors[0].message
    assert [(o.request_id, len(o.pooled.data)) for o in finals] == [("good", 64)]


# ---------------------------------------------------------------------------------- the CLI
def test_engine_process_serves_the_pooling_type_flag(
    tiny_pooling_models: dict[str, Path], cache_dir: Path, log_dir: Path
) -> None:
    """``python -m engine_svc --model ... --pooling-type MEAN`` overrides the checkpoint's LAST."""
    model = tiny_pooling_models["embed"]
    flags = ("--model", str(model), "--pooling-type", "MEAN", "--kv-cache-memory", "16MiB")
    engine = Engine(cache_dir, log_dir, *flags).wait_ready()
    try:
        with grpc.insecure_channel(engine.address) as channel:
            stub = pb_grpc.EngineStub(channel)
            info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
            assert info.pooling_type == "MEAN"
            (response,) = generate(stub, _pooling("m", PROMPT, pb.POOLING_TASK_EMBED))
        from transformers import AutoModel

        hf = AutoModel.from_pretrained(str(model), dtype=torch.float32).eval()
        with torch.inference_mode():
            mean = hf(torch.tensor([PROMPT])).last_hidden_state[0].mean(0).numpy()
        got = np.array(response.output.pooled.data)
        np.testing.assert_allclose(got, mean / np.linalg.norm(mean), rtol=1e-4, atol=1e-5)
    finally:
        engine.stop()
