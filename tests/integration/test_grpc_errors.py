"""gRPC status codes of the real engine: bad parameters, context length, a full queue, draining."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.tandem.engine.v1 import engine_pb2 as pb
from protos.tandem.engine.v1 import engine_pb2_grpc as pb_grpc
from tests.chaos.clients import engine_load
from tests.integration.grpc_util import StreamSession, add_request, generate, tokens_of
from tests.integration.harness import MODEL, Engine, Gateway

pytestmark = pytest.mark.timeout(60)
PROMPT = [300, 301, 302, 303, 304]


def _status(stub: pb_grpc.EngineStub, request: pb.AddRequest) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        generate(stub, request)
    return info.value


def test_invalid_sampling_param(channel: grpc.Channel) -> None:
    stub = pb_grpc.EngineStub(channel)
    cases = {
        "temperature": add_request("bad-t", PROMPT, 4, temperature=-0.5),
        "top_p": add_request("bad-p", PROMPT, 4, top_p=1.5),
        "logprobs": add_request("bad-l", PROMPT, 4, logprobs=21),
        "prompt_token_ids": add_request("bad-v", [100_000], 4),
    }
    for name, request in cases.items():
        error = _status(stub, request)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, name  # type: ignore[attr-defined]
        assert name in error.details(), error.details()  # type: ignore[attr-defined]


def test_invalid_token_constraints(channel: grpc.Channel) -> None:
    stub = pb_grpc.EngineStub(channel)
    empty_word = add_request("bad-w0", PROMPT, 4)
    empty_word.sampling_params.bad_words.add()
    cases = {
        "logit_bias": add_request("bad-b", PROMPT, 4, logit_bias={100_000: 1.0}),
        "logit_bias ": add_request("bad-b2", PROMPT, 4, logit_bias={5: 101.0}),
        "allowed_token_ids": add_request("bad-a", PROMPT, 4, allowed_token_ids=[5, 100_000]),
        "bad_words": add_request("bad-w", PROMPT, 4, bad_words=[pb.TokenIds(token_ids=[100_000])]),
        "bad_words ": empty_word,
    }
    for name, request in cases.items():
        error = _status(stub, request)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, name  # type: ignore[attr-defined]
        assert name.strip() in error.details(), error.details()  # type: ignore[attr-defined]


def test_prompt_at_max_model_len(channel: grpc.Channel) -> None:
    error = _status(pb_grpc.EngineStub(channel), add_request("long", [300] * 2048, 1))
    assert error.code() == grpc.StatusCode.OUT_OF_RANGE  # type: ignore[attr-defined]
    details = error.details()  # type: ignore[attr-defined]
    assert "2048" in details and "context length" in details


def test_prompt_plus_max_tokens_over_context_is_refused(channel: grpc.Channel) -> None:
    """The contract refuses (OUT_OF_RANGE / CONTEXT_LENGTH_EXCEEDED) instead of streaming until
    the context is full and ending with LENGTH."""
    stub = pb_grpc.EngineStub(channel)
    error = _status(stub, add_request("over", [300] * 2000, 49))
    assert error.code() == grpc.StatusCode.OUT_OF_RANGE  # type: ignore[attr-defined]
    details = error.details()  # type: ignore[attr-defined]
    assert "2000" in details and "49" in details and "2048" in details, details
    session = StreamSession(stub)
    try:
        session.add(add_request("over-on-stream", [300] * 2000, 49))
        reply = next(iter(session))
        assert [(e.request_id, e.code) for e in reply.errors] == [
            ("over-on-stream", pb.ERROR_CODE_CONTEXT_LENGTH_EXCEEDED)
        ]
        # Exactly at the limit is fine: 2000 + 48 = 2048.
        session.add(add_request("fits", [300] * 2000, 48))
        tokens = []
        for m in session:
            assert not m.errors, m.errors
            for o in m.outputs:
                tokens += o.new_token_ids
                if o.finish_reason:
                    assert o.finish_reason == pb.FINISH_REASON_LENGTH
                    break
            else:
                continue
            break
        assert len(tokens) == 48
    finally:
        session.cancel()


# ------------------------------------------------------------------ a one-slot engine


@pytest.fixture(scope="module")
def tiny_queue(cache_dir: Path, log_dir: Path) -> Iterator[tuple[Engine, Gateway]]:
    engine = Engine(cache_dir, log_dir, "--max-waiting", "1", "--max-num-seqs", "1")
    gateway = None
    try:
        engine.wait_ready()
        gateway = Gateway(engine.address, cache_dir, log_dir).wait_healthy()
        yield engine, gateway
    finally:
        if gateway is not None:
            gateway.stop()
        engine.stop()


def _wait_idle(address: str, timeout: float = 20.0) -> None:
    """Until the one-slot engine has nothing running or waiting (the load probe is a request
    itself, refused while the queue is still full)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            load = engine_load(address)
            if not (load.num_running_requests or load.num_waiting_requests):
                return
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:  # type: ignore[attr-defined]
                raise
        assert time.monotonic() < deadline, "the engine never became idle"
        time.sleep(0.1)


def _fill(stub: pb_grpc.EngineStub, address: str) -> StreamSession:
    """One request running, one waiting: the one-slot engine's queue is full. Waits first until
    the engine is idle (the previous test's requests are aborted when its stream is cancelled,
    which the engine sees a moment later)."""
    _wait_idle(address)
    session = StreamSession(stub)
    session.add(add_request("running", PROMPT, 1900))
    messages = iter(session)
    first = next(messages)
    assert not first.errors, first.errors
    assert first.outputs[0].request_id == "running"
    session.add(add_request("waiting", PROMPT, 1900))
    for m in messages:
        assert not m.errors, m.errors
        if m.load.num_waiting_requests == 1 and m.load.num_running_requests == 1:
            return session
    raise AssertionError("the engine never reported a waiting request")


def test_queue_full_resource_exhausted(tiny_queue: tuple[Engine, Gateway]) -> None:
    engine, _ = tiny_queue
    with grpc.insecure_channel(engine.address) as channel:
        stub = pb_grpc.EngineStub(channel)
        session = _fill(stub, engine.address)
        try:
            error = _status(stub, add_request("third", PROMPT, 4))
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # type: ignore[attr-defined]
            session.add(add_request("third-on-stream", PROMPT, 4))
            for m in session:
                if m.errors:
                    assert [(e.request_id, e.code) for e in m.errors] == [
                        ("third-on-stream", pb.ERROR_CODE_RESOURCE_EXHAUSTED)
                    ]
                    break
        finally:
            session.cancel()


def test_http_429_when_engine_queue_full(tiny_queue: tuple[Engine, Gateway]) -> None:
    engine, gateway = tiny_queue
    with grpc.insecure_channel(engine.address) as channel:
        session = _fill(pb_grpc.EngineStub(channel), engine.address)
        try:
            for stream in (False, True):
                r = httpx.post(
                    f"{gateway.url}/v1/completions",
                    json={"model": MODEL, "prompt": "Hi", "max_tokens": 4, "stream": stream},
                    headers=gateway.headers,
                    timeout=20,
                )
                assert r.status_code == 429, r.text
                assert r.headers["retry-after"] == "1"
                error = r.json()["error"]
                assert error["type"] == "rate_limit_error"
                assert error["code"] == "rate_limit_exceeded"
                assert "queue" in error["message"]
        finally:
            session.cancel()


# ------------------------------------------------------------------ draining on SIGTERM


def _health(channel: grpc.Channel) -> int:
    reply = health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service="tandem.engine.v1.Engine"), timeout=5
    )
    return int(reply.status)


def _run_in_thread(
    stub: pb_grpc.EngineStub, request: pb.AddRequest
) -> tuple[threading.Thread, list[pb.GenerateResponse], list[Exception], threading.Event]:
    responses: list[pb.GenerateResponse] = []
    errors: list[Exception] = []
    started = threading.Event()

    def run() -> None:
        try:
            for r in stub.Generate(pb.GenerateRequest(request=request), timeout=40):
                responses.append(r)
                started.set()
        except Exception as e:
            errors.append(e)
            started.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert started.wait(20)
    return thread, responses, errors, started


def test_drain_finishes_in_flight_and_refuses_new(cache_dir: Path, log_dir: Path) -> None:
    engine = Engine(cache_dir, log_dir, "--shutdown-timeout", "30").wait_ready()
    try:
        with grpc.insecure_channel(engine.address) as channel:
            stub = pb_grpc.EngineStub(channel)
            stream = StreamSession(stub)
            thread, responses, errors, _ = _run_in_thread(
                stub, add_request("inflight", PROMPT, 1500)
            )
            engine.signal(signal.SIGTERM)
            deadline = time.monotonic() + 5
            while _health(channel) != health_pb2.HealthCheckResponse.NOT_SERVING:
                assert time.monotonic() < deadline, "health never turned NOT_SERVING"
                time.sleep(0.02)
            error = _status(stub, add_request("late", PROMPT, 4))
            assert error.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
            stream.add(add_request("late-on-stream", PROMPT, 4))
            reply = next(iter(stream))
            assert [e.code for e in reply.errors] == [pb.ERROR_CODE_UNAVAILABLE]
            stream.cancel()
            assert thread.is_alive(), "the in-flight request must outlive the checks"
            thread.join(30)
        assert not errors, errors
        assert responses[-1].output.finish_reason == pb.FINISH_REASON_LENGTH
        assert len(tokens_of(responses)) == 1500
        assert engine.wait(20) == 0
    finally:
        engine.kill()


def test_short_shutdown_timeout_aborts_in_flight(cache_dir: Path, log_dir: Path) -> None:
    engine = Engine(cache_dir, log_dir, "--shutdown-timeout", "0.3").wait_ready()
    try:
        with grpc.insecure_channel(engine.address) as channel:
            stub = pb_grpc.EngineStub(channel)
            thread, responses, errors, _ = _run_in_thread(
                stub, add_request("inflight", PROMPT, 1900)
            )
            started = time.monotonic()
            engine.signal(signal.SIGTERM)
            thread.join(15)
            assert not thread.is_alive()
        assert not errors, errors
        assert responses[-1].output.finish_reason == pb.FINISH_REASON_ABORT
        assert len(tokens_of(responses)) < 1900
        assert engine.wait(15) == 0
        assert time.monotonic() - started < 10
    finally:
        engine.kill()
