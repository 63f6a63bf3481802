"""Hostile input on the engine's gRPC port: each answered with its status, the engine still
SERVING, nothing left running and no KV block held afterwards."""

from __future__ import annotations

import math
import queue
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.tandem.engine.v1 import engine_pb2 as pb
from protos.tandem.engine.v1 import engine_pb2_grpc as pb_grpc
from tests.chaos.clients import wait_idle
from tests.integration.grpc_util import add_request, generate, tokens_of
from tests.integration.harness import Engine

pytestmark = pytest.mark.timeout(120)
PROMPT = [300, 301, 302]
GARBAGE = b"\xff\xff\xff\xff\x0f"
RAW = {"request_serializer": lambda b: b, "response_deserializer": lambda b: b}


def _code(call: Callable[[], Any]) -> grpc.StatusCode:
    try:
        call()
    except grpc.RpcError as e:
        return e.code()  # type: ignore[attr-defined,no-any-return]
    return grpc.StatusCode.OK


def _sp(**kw: Any) -> pb.SamplingParams:
    return pb.SamplingParams(**kw)


def _gen(stub: pb_grpc.EngineStub, prompt: list[int], sp: pb.SamplingParams) -> Callable[[], Any]:
    request = pb.AddRequest(request_id="h", prompt_token_ids=prompt, sampling_params=sp)
    return lambda: generate(stub, request, timeout=20)


def test_hostile_grpc_catalogue(engine: Engine, record: Any) -> None:
    results: dict[str, str] = {}
    with grpc.insecure_channel(
        engine.address, options=[("grpc.max_send_message_length", 80 * 2**20)]
    ) as ch:
        stub = pb_grpc.EngineStub(ch)
        cases: dict[str, tuple[Callable[[], Any], grpc.StatusCode]] = {
            "malformed Generate bytes": (
                lambda: list(ch.unary_stream("/tandem.engine.v1.Engine/Generate", **RAW)(GARBAGE)),
                grpc.StatusCode.INVALID_ARGUMENT,
            ),
            "malformed Abort bytes": (
                lambda: ch.unary_unary("/tandem.engine.v1.Engine/Abort", **RAW)(GARBAGE),
                grpc.StatusCode.INVALID_ARGUMENT,
            ),
            "malformed GetModelInfo bytes": (
                lambda: ch.unary_unary("/tandem.engine.v1.Engine/GetModelInfo", **RAW)(GARBAGE),
                grpc.StatusCode.INVALID_ARGUMENT,
            ),
            "malformed Stream message": (
                lambda: list(
                    ch.stream_stream("/tandem.engine.v1.Engine/Stream", **RAW)(iter([GARBAGE]))
                ),
                grpc.StatusCode.INVALID_ARGUMENT,
            ),
            "unknown method": (
                lambda: ch.unary_unary("/tandem.engine.v1.Engine/Nope", **RAW)(b""),
                grpc.StatusCode.UNIMPLEMENTED,
            ),
            "message over 64 MiB": (
                lambda: ch.unary_unary("/tandem.engine.v1.Engine/Abort", **RAW)(
                    pb.AbortRequest(request_ids=["x" * (65 * 2**20)]).SerializeToString()
                ),
                grpc.StatusCode.RESOURCE_EXHAUSTED,
            ),
            "empty prompt": (_gen(stub, [], _sp(max_tokens=2)), grpc.StatusCode.INVALID_ARGUMENT),
            "token id outside the vocabulary": (
                _gen(stub, [2**31], _sp(max_tokens=2)),
                grpc.StatusCode.INVALID_ARGUMENT,
            ),
            "prompt of a million tokens": (
                _gen(stub, [300] * 1_000_000, _sp(max_tokens=2)),
                grpc.StatusCode.OUT_OF_RANGE,
            ),
            "max_tokens 2^32-1": (
                _gen(stub, PROMPT, _sp(max_tokens=2**32 - 1)),
                grpc.StatusCode.OUT_OF_RANGE,
            ),
            "temperature NaN": (
                _gen(stub, PROMPT, _sp(max_tokens=2, temperature=math.nan)),
                grpc.StatusCode.INVALID_ARGUMENT,
            ),
            "top_p 0": (
                _gen(stub, PROMPT, _sp(max_tokens=2, top_p=0.0)),
                grpc.StatusCode.INVALID_ARGUMENT,
            ),
            "top_p infinite": (
                _gen(stub, PROMPT, _sp(max_tokens=2, top_p=math.inf)),
                grpc.StatusCode.INVALID_ARGUMENT,
            ),
            "repetition_penalty 0": (
                _gen(stub, PROMPT, _sp(max_tokens=2, repetition_penalty=0.0)),
                grpc.StatusCode.INVALID_ARGUMENT,
            ),
            "logprobs 1000": (
                _gen(stub, PROMPT, _sp(max_tokens=2, logprobs=1000)),
                grpc.StatusCode.INVALID_ARGUMENT,
            ),
            "min_tokens above max_tokens": (
                _gen(stub, PROMPT, _sp(max_tokens=2, min_tokens=5)),
                grpc.StatusCode.INVALID_ARGUMENT,
            ),
            "top_k 2^31-1 (clamped to the vocabulary)": (
                _gen(stub, PROMPT, _sp(max_tokens=2, temperature=1.0, top_k=2**31 - 1)),
                grpc.StatusCode.OK,
            ),
            "100,000 stop_token_ids": (
                _gen(
                    stub,
                    PROMPT,
                    _sp(max_tokens=4, stop_token_ids=list(range(1, 100_001)), ignore_eos=True),
                ),
                grpc.StatusCode.OK,
            ),
            "seed -2^63": (
                _gen(stub, PROMPT, _sp(max_tokens=2, temperature=1.0, seed=-(2**63))),
                grpc.StatusCode.OK,
            ),
        }
        for name, (call, expected) in cases.items():
            got = _code(call)
            results[name] = got.name
            assert got == expected, f"{name}: {got} != {expected}"

        # One Stream: a flood of bad adds, a duplicate id, aborts of unknown ids; the stream
        # answers each and carries on.
        outbox: queue.Queue[pb.EngineCoreRequest | None] = queue.Queue()

        def requests() -> Iterator[pb.EngineCoreRequest]:
            while (item := outbox.get()) is not None:
                yield item

        replies = stub.Stream(requests(), timeout=60)
        bad = 2000
        for i in range(bad):
            outbox.put(pb.EngineCoreRequest(add=add_request(f"bad-{i}", [], 2)))
        outbox.put(pb.EngineCoreRequest(abort=pb.AbortRequest(request_ids=["ghost"] * 1000)))
        outbox.put(pb.EngineCoreRequest(add=add_request("dup", PROMPT, 50)))
        outbox.put(pb.EngineCoreRequest(add=add_request("dup", PROMPT, 50)))
        outbox.put(pb.EngineCoreRequest(abort=pb.AbortRequest(request_ids=["dup"])))
        errors: dict[int, int] = {}
        finished = None
        for message in replies:
            for e in message.errors:
                errors[e.code] = errors.get(e.code, 0) + 1
            for o in message.outputs:
                if o.request_id == "dup" and o.finish_reason:
                    finished = o.finish_reason
            if finished is not None and sum(errors.values()) == bad + 1:
                break
        outbox.put(None)
        replies.cancel()
        assert errors == {
            pb.ERROR_CODE_INVALID_ARGUMENT: bad,
            pb.ERROR_CODE_DUPLICATE_REQUEST_ID: 1,
        }
        assert finished == pb.FINISH_REASON_ABORT
        results["Stream: 2,000 invalid adds, 1,000 unknown aborts, a duplicate id"] = "answered"

        # Still serving, and nothing left behind.
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        assert len(tokens_of(generate(stub, add_request("after", PROMPT, 3)))) == 3
    load = wait_idle(engine.address)
    assert (load.num_running_requests, load.num_waiting_requests, load.kv_cache_usage) == (
        0,
        0,
        0.0,
    )
    record("hostile_grpc", cases=len(results), results=results)
