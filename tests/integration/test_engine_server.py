"""The engine's gRPC server under faults and hostile input: one engine per port, malformed
messages, reflection v1, a half-closed stream, a stalled or crashed loop, a clean shutdown."""

from __future__ import annotations

import asyncio
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2 as refl

from engine_svc.core.sampling_params import SamplingParams
from engine_svc.loop.clients import ClientBatch
from engine_svc.loop.engine_loop import EngineLoop
from engine_svc.rpc import servicer as servicer_module
from engine_svc.rpc.server import SERVER_OPTIONS, _add_port
from protos.tandem.engine.v1 import engine_pb2 as pb
from protos.tandem.engine.v1 import engine_pb2_grpc as pb_grpc
from tests.integration.grpc_util import StreamSession, add_request, generate, tokens_of
from tests.integration.harness import Engine, Gateway, Proc, child_env, free_port
from tests.integration.inprocess import InProcessEngine, start_stallable, tiny_core

pytestmark = pytest.mark.timeout(90)
PROMPT = [300, 301, 302, 303, 304]
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _health(address: str) -> int:
    with grpc.insecure_channel(address) as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service="tandem.engine.v1.Engine"), timeout=5
        )
    return int(reply.status)


def _wait_health(address: str, status: int, timeout: float) -> float:
    start = time.monotonic()
    while _health(address) != status:
        assert time.monotonic() - start < timeout, f"health never became {status}"
        time.sleep(0.05)
    return time.monotonic() - start


# ------------------------------------------------------------------ one engine per port


def test_grpc_bind_is_exclusive() -> None:
    """gRPC turns SO_REUSEPORT on by default: two servers could share a port."""

    async def main() -> None:
        first = grpc.aio.server(options=SERVER_OPTIONS)
        port = _add_port(first, "127.0.0.1", 0, None)
        await first.start()
        try:
            second = grpc.aio.server(options=SERVER_OPTIONS)
            with pytest.raises(OSError, match=f"127.0.0.1:{port}"):
                _add_port(second, "127.0.0.1", port, None)
        finally:
            await first.stop(None)

    asyncio.run(main())


@pytest.mark.parametrize("taken", ["port", "health-port"])
def test_second_engine_on_a_taken_port_exits(engine: Engine, cache_dir: Path, taken: str) -> None:
    from tests.integration.harness import free_port

    flags = ["--port", str(engine.port)] if taken == "port" else ["--port", str(free_port())]
    if taken == "health-port":
        flags += ["--health-port", str(engine.port)]
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "engine_svc", *flags],
        env=child_env(cache_dir),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    assert f"127.0.0.1:{engine.port}" in proc.stderr and "already in use" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert "TANDEM_ENGINE_READY" not in proc.stdout
    assert time.monotonic() - started < 20  # refused before loading the model
    assert _health(engine.address) == SERVING  # the first engine is untouched


# ------------------------------------------------------------------ hostile bytes


def test_malformed_protobuf_is_invalid_argument(engine: Engine) -> None:
    garbage = b"\xff\xff\xff\xff\x0f"
    raw = {"request_serializer": lambda b: b, "response_deserializer": lambda b: b}
    with grpc.insecure_channel(engine.address) as ch:
        generate_raw = ch.unary_stream("/tandem.engine.v1.Engine/Generate", **raw)
        with pytest.raises(grpc.RpcError) as info:
            list(generate_raw(garbage, timeout=10))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
        assert "GenerateRequest" in info.value.details()  # type: ignore[attr-defined]

        model_info = ch.unary_unary("/tandem.engine.v1.Engine/Abort", **raw)
        with pytest.raises(grpc.RpcError) as info:
            model_info(garbage, timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]

        stream_raw = ch.stream_stream("/tandem.engine.v1.Engine/Stream", **raw)
        good = pb.EngineCoreRequest(add=add_request("ok", PROMPT, 2)).SerializeToString()
        replies = stream_raw(iter([good, garbage]), timeout=10)
        with pytest.raises(grpc.RpcError) as info:
            list(replies)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
        assert "EngineCoreRequest" in info.value.details()  # type: ignore[attr-defined]
        # The engine carries on.
        assert _health(engine.address) == SERVING
        out = generate(pb_grpc.EngineStub(ch), add_request("after", PROMPT, 3))
        assert len(tokens_of(out)) == 3
    assert "malformed tandem.engine.v1.EngineCoreRequest" in engine.log_tail(20_000)


# ------------------------------------------------------------------ reflection


@pytest.mark.parametrize("version", ["v1", "v1alpha"])
def test_reflection(engine: Engine, version: str) -> None:
    path = f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo"
    with grpc.insecure_channel(engine.address) as ch:
        call = ch.stream_stream(
            path,
            request_serializer=refl.ServerReflectionRequest.SerializeToString,
            response_deserializer=refl.ServerReflectionResponse.FromString,
        )
        requests = [
            refl.ServerReflectionRequest(list_services=""),
            refl.ServerReflectionRequest(file_containing_symbol="tandem.engine.v1.Engine"),
            refl.ServerReflectionRequest(
                file_containing_symbol="grpc.reflection.v1.ServerReflection"
            ),
        ]
        listed, engine_file, v1_file = list(call(iter(requests), timeout=10))
    names = {s.name for s in listed.list_services_response.service}
    assert {
        "tandem.engine.v1.Engine",
        "grpc.health.v1.Health",
        "grpc.reflection.v1.ServerReflection",
        "grpc.reflection.v1alpha.ServerReflection",
    } <= names
    assert engine_file.file_descriptor_response.file_descriptor_proto
    assert v1_file.file_descriptor_response.file_descriptor_proto  # describable, not only listed


# ------------------------------------------------------------------ in-process faults


@pytest.fixture()
def slow_final_delivery(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Widen the window between the engine loop forgetting a finished request and its final
    output reaching the stream: sleep before handing over a batch that finishes a request."""
    routed = threading.Event()
    original = EngineLoop._deliver

    def slow(self: EngineLoop, batches: dict[str, ClientBatch]) -> None:
        if any(o.finished for b in batches.values() for o in b.outputs):
            routed.set()
            time.sleep(0.5)
        original(self, batches)

    monkeypatch.setattr(EngineLoop, "_deliver", slow)
    return routed


def test_stream_messages_are_built_off_the_engine_loop_thread(
    tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine loop only hands a step's outputs over; protobuf is built on the server's
    event loop, so the loop goes on to its next step at once."""
    threads: list[str] = []
    original = servicer_module._batch_to_pb

    def recording(batch: ClientBatch) -> pb.EngineCoreOutputs:
        threads.append(threading.current_thread().name)
        return original(batch)

    monkeypatch.setattr(servicer_module, "_batch_to_pb", recording)
    server = InProcessEngine(lambda: tiny_core(tiny_models["llama"])).start()
    try:
        with grpc.insecure_channel(server.address) as ch:
            session = StreamSession(pb_grpc.EngineStub(ch))
            session.add(add_request("a", PROMPT, 4))
            session.half_close()
            messages = list(session)
        # Steps that queue behind a gRPC write are merged, so 1 to 4 messages carry the tokens.
        assert sum(len(o.new_token_ids) for m in messages for o in m.outputs) == 4
        assert len(threads) == len(messages) and "engine-loop" not in threads, threads
    finally:
        server.stop()


def test_each_step_hands_over_its_own_load_figures(tiny_models: dict[str, Path]) -> None:
    """A step's batch carries that step's load figures, a snapshot: the loop thread makes new
    ones for the next step instead of changing the ones a message may still be built from on
    the server's event loop (they were one shared object: a message could read a later step's
    figures, or a mix of two steps)."""
    loop = EngineLoop(lambda: tiny_core(tiny_models["llama"]))
    loop.start()
    got: queue.Queue[ClientBatch] = queue.Queue()
    loop.register("c", got.put)
    batches: list[ClientBatch] = []
    try:
        loop.submit("c", "r", PROMPT, SamplingParams(max_tokens=5, ignore_eos=True))
        while not any(o.finished for b in batches for o in b.outputs):
            batches.append(got.get(timeout=30))
    finally:
        loop.stop()
    loads = [b.load for b in batches]
    assert all(load is not None for load in loads)
    assert loads[0].num_running == 1  # type: ignore[union-attr]
    assert loads[-1].num_running == 0  # type: ignore[union-attr]  # finished in the last step
    assert len({id(load) for load in loads}) == len(loads)


def test_half_closed_stream_gets_its_last_output(
    tiny_models: dict[str, Path], slow_final_delivery: threading.Event
) -> None:
    server = InProcessEngine(lambda: tiny_core(tiny_models["llama"])).start()
    try:
        with grpc.insecure_channel(server.address) as ch:
            outbox: queue.Queue[pb.EngineCoreRequest | None] = queue.Queue()

            def requests() -> Iterator[pb.EngineCoreRequest]:
                while (item := outbox.get()) is not None:
                    yield item

            replies = pb_grpc.EngineStub(ch).Stream(requests(), timeout=30)
            outbox.put(pb.EngineCoreRequest(add=add_request("last", PROMPT, 3)))
            assert slow_final_delivery.wait(20)
            outbox.put(None)  # half-close while the final output is on its way
            outputs = [o for m in replies for o in m.outputs]
        assert {o.request_id for o in outputs} == {"last"}
        assert sum(len(o.new_token_ids) for o in outputs) == 3  # steps queued together merge
        assert outputs[-1].finish_reason == pb.FINISH_REASON_LENGTH
    finally:
        server.stop()


def test_stalled_loop_is_not_serving_until_it_recovers(tiny_models: dict[str, Path]) -> None:
    server, core = start_stallable(tiny_models["llama"], stall_timeout_s=1.0)
    try:
        assert _health(server.address) == SERVING
        time.sleep(1.5)  # idle longer than the stall timeout: idle is not stalled
        assert _health(server.address) == SERVING
        core.stall.set()
        results: list[list[pb.GenerateResponse]] = []
        with grpc.insecure_channel(server.address) as ch:
            stub = pb_grpc.EngineStub(ch)
            first = threading.Thread(
                target=lambda: results.append(generate(stub, add_request("a", PROMPT, 4)))
            )
            first.start()
            assert core.stalled.wait(10)
            took = _wait_health(server.address, NOT_SERVING, timeout=5)
            assert took < 2.5
            with pytest.raises(grpc.RpcError) as info:
                generate(stub, add_request("refused", PROMPT, 4))
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
            assert "no progress" in info.value.details()  # type: ignore[attr-defined]
            core.stall.clear()
            core.release.set()
            _wait_health(server.address, SERVING, timeout=5)
            first.join(20)
            assert len(tokens_of(results[0])) == 4  # the stalled request finished
            assert len(tokens_of(generate(stub, add_request("b", PROMPT, 2)))) == 2
    finally:
        core.release.set()
        server.stop()


def test_dead_loop_fails_its_requests_and_is_not_serving(tiny_models: dict[str, Path]) -> None:
    server, core = start_stallable(tiny_models["llama"], stall_timeout_s=30.0)
    try:
        core.crash.set()
        with grpc.insecure_channel(server.address) as ch:
            stub = pb_grpc.EngineStub(ch)
            with pytest.raises(grpc.RpcError) as info:
                generate(stub, add_request("doomed", PROMPT, 4))
            assert info.value.code() == grpc.StatusCode.INTERNAL  # type: ignore[attr-defined]
            _wait_health(server.address, NOT_SERVING, timeout=5)
            with pytest.raises(grpc.RpcError) as info:  # refused at once, not left hanging
                generate(stub, add_request("later", PROMPT, 4), timeout=5)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
    finally:
        server.stop()


# ------------------------------------------------------------------ shutdown


def test_sigterm_with_a_gateway_connected_is_clean(cache_dir: Path, log_dir: Path) -> None:
    engine = Engine(cache_dir, log_dir).wait_ready()
    gateway = Gateway(engine.address, cache_dir, log_dir)
    try:
        gateway.wait_healthy()  # the gateway holds a Stream and a health Watch open
        engine.signal(signal.SIGTERM)
        assert engine.wait(30) == 0
        log = engine.log_tail(50_000)
        assert "Traceback" not in log and "Exception not handled" not in log, log
        assert "shutting down" in log
    finally:
        gateway.stop()
        engine.kill()


def test_a_stopped_engine_skips_interpreter_finalization(
    cache_dir: Path, log_dir: Path, tmp_path: Path
) -> None:
    """After a clean stop the engine exits without finalizing the interpreter, where triton's
    nanobind bindings (imported through torch by transformers or xgrammar) print ~30 lines of
    leak reports; stood in for here by an atexit hook that prints what nanobind would."""
    (tmp_path / "sitecustomize.py").write_text(
        "import atexit, sys\n"
        "atexit.register(lambda: print('nanobind: leaked 4 instances!', file=sys.stderr))\n"
    )
    env = child_env(cache_dir)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp_path), env.get("PYTHONPATH")]))
    port = free_port()
    argv = [sys.executable, "-m", "engine_svc", "--port", str(port)]
    engine = Proc("engine", argv, env, log_dir)
    try:
        engine.wait_line(60)
        engine.signal(signal.SIGTERM)
        assert engine.wait(30) == 0
        log = engine.log_tail(50_000)
        assert "shutting down" in log  # the logs were flushed before the exit
        assert "nanobind" not in log, log
    finally:
        engine.kill()


def test_shutdown_ends_calls_a_stalled_loop_never_answers(
    tiny_models: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    server, core = start_stallable(tiny_models["llama"], shutdown_timeout_s=0.3)
    try:
        core.stall.set()
        errors: list[grpc.RpcError] = []

        def call() -> None:
            with grpc.insecure_channel(server.address) as ch:
                try:
                    generate(pb_grpc.EngineStub(ch), add_request("stuck", PROMPT, 4), timeout=30)
                except grpc.RpcError as e:
                    errors.append(e)

        caller = threading.Thread(target=call)
        caller.start()
        assert core.stalled.wait(10)
        with caplog.at_level("ERROR"):
            server.stop()
            caller.join(10)
        assert [e.code() for e in errors] == [grpc.StatusCode.UNAVAILABLE]  # type: ignore[attr-defined]
        assert "shutting down" in errors[0].details(), errors[0].details()  # type: ignore[attr-defined]
        assert "Exception not handled" not in caplog.text
    finally:
        core.release.set()
        server.stop()


def test_in_flight_ids_are_counted_and_forgotten() -> None:
    """A Stream counts its requests itself; an id may come back once it ended, and ended ids
    are forgotten (a gateway's Stream carries millions of requests over its life)."""
    from engine_svc.rpc.servicer import InFlight

    in_flight = InFlight()
    assert not in_flight
    in_flight.add("a")
    in_flight.add("a")  # reused at once: its first run's final output is still on the way
    in_flight.end(["a"])
    assert in_flight and len(in_flight) == 1
    in_flight.end(["a", "never-added"])
    assert not in_flight and len(in_flight) == 0
    for i in range(10_000):
        in_flight.add(f"r{i}")
        in_flight.end([f"r{i}"])
    assert len(in_flight) == 0
