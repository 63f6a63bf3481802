"""A plain gRPC client against the real engine: Generate, Stream, Abort, model info, tokenizer,
health and reflection."""

from __future__ import annotations

import itertools
import json
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from protos.tandem.engine.v1 import engine_pb2 as pb
from protos.tandem.engine.v1 import engine_pb2_grpc as pb_grpc
from tests.integration.grpc_util import StreamSession, add_request, generate, tokens_of

pytestmark = pytest.mark.timeout(60)
PROMPT = [300, 301, 302, 303, 304]


@pytest.fixture()
def stub(channel: grpc.Channel) -> pb_grpc.EngineStub:
    return pb_grpc.EngineStub(channel)


def test_generate(stub: pb_grpc.EngineStub) -> None:
    responses = generate(stub, add_request("gen-1", PROMPT, 8))
    assert len(tokens_of(responses)) == 8
    assert all(r.output.request_id == "gen-1" for r in responses)
    assert [r.output.finish_reason for r in responses][-1] == pb.FINISH_REASON_LENGTH
    assert all(r.output.finish_reason == pb.FINISH_REASON_UNSPECIFIED for r in responses[:-1])
    assert responses[-1].output.num_prompt_tokens == len(PROMPT)
    assert all(r.HasField("load") for r in responses)


def test_generate_without_request_id(stub: pb_grpc.EngineStub) -> None:
    """The contract lets a Generate caller leave request_id empty; the engine assigns one."""
    responses = generate(stub, add_request("", PROMPT, 3))
    assert len(tokens_of(responses)) == 3
    ids = {r.output.request_id for r in responses}
    assert len(ids) == 1 and ids != {""}


def test_stream_many_requests_and_abort(stub: pb_grpc.EngineStub) -> None:
    greedy = tokens_of(generate(stub, add_request("ref", PROMPT, 8)))
    session = StreamSession(stub)
    # "long" first: it runs from the step "short" starts in, or earlier, so it has tokens when
    # "short" finishes (added second, a busy machine could deliver it after all 8 steps).
    session.add(add_request("long", PROMPT, 1900))
    session.add(add_request("short", PROMPT, 8))
    tokens: dict[str, list[int]] = {"short": [], "long": []}
    finish: dict[str, int] = {}
    aborted_sent = False
    for message in session:
        assert message.HasField("load")
        assert not message.errors
        for out in message.outputs:
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                finish[out.request_id] = out.finish_reason
        if not aborted_sent and "short" in finish:
            session.abort("long")
            aborted_sent = True
        if len(finish) == 2:
            session.half_close()  # nothing left in flight: the engine ends the stream
    assert finish == {"short": pb.FINISH_REASON_LENGTH, "long": pb.FINISH_REASON_ABORT}
    assert tokens["short"] == greedy  # batching with another request changes nothing
    # "long" ran alongside "short", and was cut short
    assert 0 < len(tokens["long"]) < 1900


def test_a_stream_aborts_only_its_own_request_of_a_shared_id(stub: pb_grpc.EngineStub) -> None:
    """Request ids are each client's own: two Streams may use the same one, and one Stream's
    abort of it leaves the other's running."""
    mine, theirs = StreamSession(stub), StreamSession(stub)
    theirs.add(add_request("shared", PROMPT, 400))
    mine.add(add_request("shared", PROMPT, 1900))
    finish: dict[str, int] = {}
    for message in mine:  # from its first token on, abort it
        if not finish and any(o.new_token_ids for o in message.outputs):
            mine.abort("shared")
            finish["abort sent"] = 0
        for out in message.outputs:
            if out.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                finish["mine"] = out.finish_reason
                mine.half_close()
    theirs.half_close()
    outs = [o for m in theirs for o in m.outputs]
    assert finish["mine"] == pb.FINISH_REASON_ABORT
    assert sum(len(o.new_token_ids) for o in outs) == 400
    assert outs[-1].finish_reason == pb.FINISH_REASON_LENGTH


def test_stream_half_close_finishes_in_flight(stub: pb_grpc.EngineStub) -> None:
    session = StreamSession(stub)
    session.add(add_request("a", PROMPT, 5))
    session.half_close()
    outs = [o for m in session for o in m.outputs]
    assert sum(len(o.new_token_ids) for o in outs) == 5
    assert outs[-1].finish_reason == pb.FINISH_REASON_LENGTH


def test_stream_request_error_does_not_end_stream(stub: pb_grpc.EngineStub) -> None:
    session = StreamSession(stub)
    session.add(add_request("bad", PROMPT, 4, temperature=-1.0))
    session.add(add_request("good", PROMPT, 4))
    session.half_close()
    messages = list(session)
    errors = [e for m in messages for e in m.errors]
    assert [(e.request_id, e.code) for e in errors] == [("bad", pb.ERROR_CODE_INVALID_ARGUMENT)]
    assert "temperature" in errors[0].message
    outs = [o for m in messages for o in m.outputs]
    assert {o.request_id for o in outs} == {"good"}
    assert outs[-1].finish_reason == pb.FINISH_REASON_LENGTH


def test_abort_rpc_ends_generate(stub: pb_grpc.EngineStub) -> None:
    call = stub.Generate(
        pb.GenerateRequest(request=add_request("to-abort", PROMPT, 1900)), timeout=30
    )
    responses = []
    for r in call:
        responses.append(r)
        if len(responses) == 2:
            reply = stub.Abort(pb.AbortRequest(request_ids=["to-abort", "unknown-id"]))
            assert reply.num_aborted == 1
    assert responses[-1].output.finish_reason == pb.FINISH_REASON_ABORT
    assert len(tokens_of(responses)) < 1900


def test_cancelled_generate_frees_the_engine(stub: pb_grpc.EngineStub) -> None:
    """Cancelling the call drops the request, long before it would have ended on its own. (The
    test polled with Abort, which drops it by itself: it passed with a cancel that did nothing.
    Ids are per call, so re-adding the id cannot tell either; the load figures can.)"""
    t = time.monotonic()
    assert len(tokens_of(generate(stub, add_request("cancel-whole", PROMPT, 1900)))) == 1900
    whole = time.monotonic() - t

    call = stub.Generate(pb.GenerateRequest(request=add_request("cancel-me", PROMPT, 1900)))
    next(iter(call))
    cancelled = time.monotonic()
    call.cancel()
    for probe in itertools.count():
        # the first step of a two-token probe: the engine's running requests, the probe too
        first = generate(stub, add_request(f"cancel-probe-{probe}", PROMPT, 2))[0]
        if first.load.num_running_requests == 1:
            break
        assert time.monotonic() - cancelled < 0.5 * whole, "the cancel did not drop it"
        time.sleep(0.02)


def test_get_model_info(stub: pb_grpc.EngineStub) -> None:
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert info.served_model_name == "tandem-tiny-llama"
    assert info.max_model_len == 2048
    assert info.vocab_size == 512
    assert len(info.eos_token_ids) == 1
    assert info.block_size == 16
    # 64MiB of float32 K and V over 2 layers, 2 KV heads of 32 dims: 4096 blocks of 16 tokens
    assert info.num_kv_blocks == 4096
    assert info.kv_capacity_tokens == info.num_kv_blocks * info.block_size
    assert info.max_logprobs == 20
    assert info.engine_version and info.model_source


def test_get_tokenizer(stub: pb_grpc.EngineStub) -> None:
    from tokenizers import Tokenizer

    chunks = list(stub.GetTokenizer(pb.GetTokenizerRequest(), timeout=10))
    assert "<|im_start|>" in chunks[0].chat_template
    files: dict[str, bytes] = {}
    for c in chunks:
        files[c.file_name] = files.get(c.file_name, b"") + c.data
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(files)
    tok = Tokenizer.from_str(files["tokenizer.json"].decode())
    assert tok.get_vocab_size() == 512
    assert json.loads(files["tokenizer_config.json"])["eos_token"] == "<|im_end|>"


def test_health_serving(channel: grpc.Channel) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "tandem.engine.v1.Engine"):
        reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_reflection_lists_the_service(channel: grpc.Channel) -> None:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    replies = list(
        stub.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
        )
    )
    names = {s.name for s in replies[0].list_services_response.service}
    assert {"tandem.engine.v1.Engine", "grpc.health.v1.Health"} <= names
    files = list(
        stub.ServerReflectionInfo(
            iter(
                [
                    reflection_pb2.ServerReflectionRequest(
                        file_containing_symbol="tandem.engine.v1.Engine"
                    )
                ]
            ),
            timeout=5,
        )
    )
    assert files[0].file_descriptor_response.file_descriptor_proto
