"""The utility rpcs over real gRPC (an in-process engine server): ResetPrefixCache, Sleep /
WakeUp / IsSleeping with health and request refusal, StartProfile / StopProfile, and
UNIMPLEMENTED for a method a servicer leaves to the generated base class."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine_svc.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine_svc.engine_core import EngineCore
from engine_svc.rpc import handlers
from engine_svc.rpc.servicer import EngineServicer
from protos.tandem.engine.v1 import engine_pb2 as pb
from protos.tandem.engine.v1 import engine_pb2_grpc as pb_grpc
from tests.integration.grpc_util import StreamSession, add_request, generate, tokens_of
from tests.integration.inprocess import InProcessEngine

PROMPT = [5, 17, 29, 41, 53, 65, 77, 89, 101, 113, 125, 137, 149, 161, 173, 185]
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _core(model_dir: Path, profile_dir: Path | None) -> EngineCore:
    return EngineCore(
        EngineConfig(
            model=ModelConfig(str(model_dir), dtype="float32"),
            cache=CacheConfig(block_size=4, num_kv_blocks=256),
            scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256),
            profile_dir=None if profile_dir is None else str(profile_dir),
        )
    )


@pytest.fixture(scope="module")
def server(
    tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[InProcessEngine]:
    traces = tmp_path_factory.mktemp("traces")
    # A stall timeout far below the sleeps below: a sleeping engine must not read as stalled.
    engine = InProcessEngine(
        lambda: _core(tiny_models["llama"], traces), stall_timeout_s=1.0
    ).start()
    engine.traces = traces  # type: ignore[attr-defined]
    yield engine
    engine.stop()


@pytest.fixture()
def channel(server: InProcessEngine) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(server.address) as ch:
        yield ch


def _health(ch: grpc.Channel) -> int:
    reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""))
    return int(reply.status)


def _wait_health(ch: grpc.Channel, status: int, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while _health(ch) != status:
        assert time.monotonic() < deadline, f"health never became {status}"
        time.sleep(0.05)


def _code(call: object) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call()  # type: ignore[operator]
    return info.value.code()  # type: ignore[no-any-return, attr-defined]


def _greedy(stub: pb_grpc.EngineStub, rid: str, max_tokens: int = 12) -> list[int]:
    return tokens_of(generate(stub, add_request(rid, PROMPT, max_tokens)))


# ------------------------------------------------------------------ sleep / wake up
@pytest.mark.parametrize("level", [1, 2])
def test_sleep_refuses_work_then_wake_up_serves_the_same_tokens(
    channel: grpc.Channel, level: int
) -> None:
    stub = pb_grpc.EngineStub(channel)
    before = _greedy(stub, f"before-{level}")
    assert not stub.IsSleeping(pb.IsSleepingRequest()).is_sleeping

    stub.Sleep(pb.SleepRequest(level=level), timeout=30)
    assert stub.IsSleeping(pb.IsSleepingRequest()).is_sleeping
    _wait_health(channel, NOT_SERVING)
    with pytest.raises(grpc.RpcError) as info:
        _greedy(stub, f"asleep-{level}")
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
    assert "asleep" in info.value.details()  # type: ignore[attr-defined]
    session = StreamSession(stub)  # a Stream gets the refusal as the request's error
    session.add(add_request("s1", PROMPT, 4))
    reply = next(iter(session))
    assert [(e.request_id, e.code) for e in reply.errors] == [("s1", pb.ERROR_CODE_UNAVAILABLE)]
    session.cancel()
    stub.Sleep(pb.SleepRequest(level=level), timeout=5)  # sleeping again: a no-op
    time.sleep(1.5)  # longer than the stall timeout: still asleep, not stalled or dead
    assert _health(channel) == NOT_SERVING
    assert stub.IsSleeping(pb.IsSleepingRequest()).is_sleeping

    stub.WakeUp(pb.WakeUpRequest(), timeout=30)
    assert not stub.IsSleeping(pb.IsSleepingRequest()).is_sleeping
    _wait_health(channel, SERVING)
    assert _greedy(stub, f"after-{level}") == before
    stub.WakeUp(pb.WakeUpRequest(), timeout=5)  # awake: a no-op


def test_sleep_waits_for_the_running_request(channel: grpc.Channel) -> None:
    stub = pb_grpc.EngineStub(channel)
    responses = stub.Generate(
        pb.GenerateRequest(request=add_request("long", PROMPT, 1000)), timeout=60
    )
    first = next(responses)  # it runs (1000 tokens: still running after the 0.2 s below)
    slept = threading.Event()
    error: list[BaseException] = []

    def sleep() -> None:
        try:
            stub.Sleep(pb.SleepRequest(level=1), timeout=60)
            slept.set()
        except BaseException as e:
            error.append(e)

    sleeper = threading.Thread(target=sleep)
    sleeper.start()
    time.sleep(0.2)
    assert _code(lambda: _greedy(stub, "late")) == grpc.StatusCode.UNAVAILABLE  # refused at once
    assert not slept.is_set()  # Sleep still waits for the running request
    rest = list(responses)
    tokens = list(first.output.new_token_ids) + tokens_of(rest)
    assert len(tokens) == 1000  # the running request finished normally
    assert rest[-1].output.finish_reason == pb.FINISH_REASON_LENGTH
    sleeper.join(30)
    assert slept.is_set() and not error, error
    assert stub.IsSleeping(pb.IsSleepingRequest()).is_sleeping
    stub.WakeUp(pb.WakeUpRequest(), timeout=30)
    _wait_health(channel, SERVING)
    assert len(_greedy(stub, "after")) == 12


def test_wake_up_cancels_a_pending_sleep(channel: grpc.Channel) -> None:
    stub = pb_grpc.EngineStub(channel)
    # The sleep waits for this request: as long as the model allows (16 + 1000 of 1024), so
    # it is still running when WakeUp comes (300 tokens took under 0.2 s on a fast machine).
    responses = stub.Generate(
        pb.GenerateRequest(request=add_request("long2", PROMPT, 1000)), timeout=60
    )
    next(responses)
    sleep_call = stub.Sleep.future(pb.SleepRequest(level=2), timeout=60)
    time.sleep(0.2)
    assert not sleep_call.done(), "the request finished before WakeUp: make it longer"
    stub.WakeUp(pb.WakeUpRequest(), timeout=30)
    with pytest.raises(grpc.RpcError) as info:
        sleep_call.result()
    assert info.value.code() == grpc.StatusCode.ABORTED  # type: ignore[attr-defined]
    assert len(tokens_of(list(responses))) == 999  # the request ran on
    assert not stub.IsSleeping(pb.IsSleepingRequest()).is_sleeping
    assert len(_greedy(stub, "served")) == 12


def test_sleep_level_out_of_range(channel: grpc.Channel) -> None:
    stub = pb_grpc.EngineStub(channel)
    with pytest.raises(grpc.RpcError) as info:
        stub.Sleep(pb.SleepRequest(level=3), timeout=5)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    assert "level" in info.value.details()  # type: ignore[attr-defined]
    assert not stub.IsSleeping(pb.IsSleepingRequest()).is_sleeping
    assert len(_greedy(stub, "still-serving")) == 12  # nothing was refused


# ------------------------------------------------------------------ reset_prefix_cache
def test_reset_prefix_cache(channel: grpc.Channel) -> None:
    stub = pb_grpc.EngineStub(channel)

    def cached(rid: str) -> int:
        replies = generate(stub, add_request(rid, PROMPT, 2))
        return int(replies[0].output.num_cached_tokens)

    cached("warm")
    assert cached("hit") == 12  # 3 full blocks of 4 (the last prompt token is computed)
    responses = stub.Generate(
        pb.GenerateRequest(request=add_request("busy", PROMPT, 400)), timeout=60
    )
    next(responses)
    assert stub.ResetPrefixCache(pb.ResetPrefixCacheRequest()).reset is False  # blocks in use
    assert cached("shared") == 12  # the running request's blocks kept their entries
    list(responses)
    assert stub.ResetPrefixCache(pb.ResetPrefixCacheRequest()).reset is True
    assert cached("miss") == 0


# ------------------------------------------------------------------ profiler
def test_profile_writes_a_trace(channel: grpc.Channel, server: InProcessEngine) -> None:
    stub = pb_grpc.EngineStub(channel)
    assert _code(lambda: stub.StopProfile(pb.StopProfileRequest())) == (
        grpc.StatusCode.FAILED_PRECONDITION
    )
    stub.StartProfile(pb.StartProfileRequest())
    assert _code(lambda: stub.StartProfile(pb.StartProfileRequest())) == (
        grpc.StatusCode.FAILED_PRECONDITION
    )
    _greedy(stub, "profiled", 4)
    path = Path(stub.StopProfile(pb.StopProfileRequest(), timeout=60).trace_path)
    assert path.parent == server.traces and path.is_file()  # type: ignore[attr-defined]
    assert '"traceEvents"' in path.read_text()


def test_profile_without_a_directory(tiny_models: dict[str, Path]) -> None:
    engine = InProcessEngine(lambda: _core(tiny_models["llama"], None)).start()
    try:
        with grpc.insecure_channel(engine.address) as ch:
            stub = pb_grpc.EngineStub(ch)
            with pytest.raises(grpc.RpcError) as info:
                stub.StartProfile(pb.StartProfileRequest())
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION  # type: ignore[attr-defined]
            assert "--profile-dir" in info.value.details()  # type: ignore[attr-defined]
            assert _code(lambda: stub.StopProfile(pb.StopProfileRequest())) == (
                grpc.StatusCode.FAILED_PRECONDITION
            )
    finally:
        engine.stop()


# ------------------------------------------------------------------ every rpc answers
def test_the_servicer_implements_every_rpc_of_the_contract() -> None:
    service = pb.DESCRIPTOR.services_by_name["Engine"]
    for method in service.methods:
        impl = getattr(EngineServicer, method.name)
        assert not impl.__module__.endswith("_pb2_grpc"), f"{method.name} is not implemented"


def test_an_unimplemented_rpc_answers_unimplemented(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> list[grpc.StatusCode]:
        server = grpc.aio.server()
        handlers.add_service(
            pb_grpc.EngineServicer(), pb.DESCRIPTOR.services_by_name["Engine"], server
        )
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        codes = []
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = pb_grpc.EngineStub(ch)
                for call in (
                    lambda: stub.Sleep(pb.SleepRequest(level=1)),
                    lambda: stub.IsSleeping(pb.IsSleepingRequest()),
                ):
                    try:
                        await call()
                    except grpc.aio.AioRpcError as e:
                        codes.append(e.code())
                try:
                    async for _ in stub.GetTokenizer(pb.GetTokenizerRequest()):
                        pass
                except grpc.aio.AioRpcError as e:
                    codes.append(e.code())
        finally:
            await server.stop(None)
        return codes

    assert asyncio.run(main()) == [grpc.StatusCode.UNIMPLEMENTED] * 3
    assert "NotImplementedError" not in caplog.text
