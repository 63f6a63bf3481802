"""The rpc edge for pooling: PoolingParams from the proto, the pooled result packed into
RequestOutput.pooled, and GetModelInfo's pooling fields."""

from __future__ import annotations

from dataclasses import asdict

import numpy as np
import pytest

from engine_svc.core.model_info import ModelInfo
from engine_svc.core.outputs import EngineCoreOutput
from engine_svc.core.pooling_params import ModelTasks, PoolingType
from engine_svc.rpc import convert
from protos import convert as contract_convert
from protos.tandem.engine.v1 import engine_pb2 as pb
from protos.types import FinishReason, PoolingTask


def test_pooling_params_from_pb() -> None:
    p = contract_convert.pooling_params_from_pb(pb.PoolingParams(task=pb.POOLING_TASK_EMBED))
    assert (p.task, p.dimensions, p.normalize, p.activation) == (
        PoolingTask.EMBED,
        None,
        None,
        None,
    )
    m = pb.PoolingParams(
        task=pb.POOLING_TASK_SCORE, dimensions=0, normalize=False, activation=False
    )
    p = contract_convert.pooling_params_from_pb(m)  # set optionals keep their (zero) values
    assert (p.task, p.dimensions, p.normalize, p.activation) == (PoolingTask.SCORE, 0, False, False)
    assert contract_convert.pooling_params_from_pb(pb.PoolingParams()).task is None
    with pytest.raises(ValueError, match="pooling_params.task has an unknown value 7"):
        contract_convert.pooling_params_from_pb(pb.PoolingParams(task=7))  # type: ignore[arg-type]


@pytest.mark.parametrize("n", [1, 3, 16, 31, 32, 33, 1024, 4096, 70_000])
def test_pooled_bytes_are_protobufs_own_encoding(n: int) -> None:
    values = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    raw = contract_convert.pooled_data_bytes(values)
    assert raw == pb.PooledData(data=values.tolist()).SerializeToString()
    parsed = pb.PooledData.FromString(raw)
    assert np.array_equal(np.array(parsed.data, dtype=np.float32), values)


def test_pooled_output_to_pb() -> None:
    vec = np.array([0.25, -1.5, 3.0], dtype=np.float32)
    o = EngineCoreOutput("r", [], finish_reason=FinishReason.STOP, num_prompt_tokens=5, pooled=vec)
    m = convert.output_to_pb(o)
    assert list(m.pooled.data) == [0.25, -1.5, 3.0]
    assert m.finish_reason == pb.FINISH_REASON_STOP and not m.new_token_ids
    assert not convert.output_to_pb(EngineCoreOutput("g", [7])).HasField("pooled")


def _info(tasks: ModelTasks) -> ModelInfo:
    return ModelInfo.of(
        tasks,
        served_model_name="m",
        max_model_len=128,
        vocab_size=384,
        eos_token_ids=(2,),
        bos_token_id=None,
        block_size=16,
        num_kv_blocks=64,
        max_logprobs=20,
        enable_prefix_caching=True,
        kv_cache_dtype="float32",
    )


def test_model_info_pooling_fields() -> None:
    embed = ModelTasks(("generate", "embed"), 64, PoolingType.MEAN, True, (16, 64))
    m = contract_convert.model_info_to_pb(_info(embed))
    assert list(m.supported_tasks) == ["generate", "embed"]
    assert (m.embedding_size, m.pooling_type, m.is_matryoshka) == (64, "MEAN", True)
    assert list(m.matryoshka_dimensions) == [16, 64] and not m.labels
    cls = ModelTasks(("classify",), labels=("neg", "pos"))
    m = contract_convert.model_info_to_pb(_info(cls))
    assert list(m.supported_tasks) == ["classify"] and list(m.labels) == ["neg", "pos"]
    assert (m.embedding_size, m.pooling_type, m.is_matryoshka) == (0, "", False)
    m = contract_convert.model_info_to_pb(_info(ModelTasks()))
    assert list(m.supported_tasks) == ["generate"]


def test_model_info_pooling_facts_survive_the_contract() -> None:
    """The engine's ModelInfo is the contract's plus checks: its ModelTasks read back the
    flat contract fields they were built into, and the gateway reads the same facts."""
    embed = ModelTasks(("embed",), 64, PoolingType.CLS, True, (16, 64))
    info = _info(embed)
    assert info.tasks == embed and info.kv_capacity_tokens == 64 * 16
    gateway = contract_convert.model_info_from_pb(contract_convert.model_info_to_pb(info))
    assert asdict(gateway) == asdict(info)
