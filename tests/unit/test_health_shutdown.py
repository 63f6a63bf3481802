"""Shutdown ends every health Watch and waits for its handler before the server stops.

``grpc.aio.Server.stop`` cancels handlers still running and gRPC logs each as an unhandled
``CancelledError`` with a traceback (the flake the SIGTERM integration test caught in CI)."""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine_svc.rpc.health import NOT_SERVING, SERVING, HealthService
from engine_svc.rpc.open_calls import OpenCalls


async def _serve(service: HealthService) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def test_close_ends_every_watch_and_waits_for_its_handler(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        service = HealthService(("", "tandem.Engine"))
        await service.set_serving(True)
        server, address = await _serve(service)
        async with grpc.aio.insecure_channel(address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            watches = [
                stub.Watch(health_pb2.HealthCheckRequest(service=s)) for s in ("", "tandem.Engine")
            ]
            for w in watches:
                assert (await w.read()).status == SERVING
            # Open watches: nothing ends them yet.
            assert not await service.watches_ended(0.05)
            await service.close()
            assert await service.watches_ended(2.0)
            for w in watches:
                assert (await w.read()).status == NOT_SERVING
                assert await w.read() is grpc.aio.EOF
                assert await w.code() == grpc.StatusCode.OK
            # A watch opened after close gets NOT_SERVING and ends at once.
            late = stub.Watch(health_pb2.HealthCheckRequest(service=""))
            assert (await late.read()).status == NOT_SERVING
            assert await late.read() is grpc.aio.EOF
            assert await service.watches_ended(1.0)
        await server.stop(grace=1.0)

    with caplog.at_level(logging.WARNING):
        asyncio.run(main())
    assert not [r for r in caplog.records if r.name.startswith("grpc")], caplog.text


def test_a_watch_the_client_drops_is_no_longer_open() -> None:
    async def main() -> None:
        service = HealthService(("",))
        await service.set_serving(True)
        server, address = await _serve(service)
        async with grpc.aio.insecure_channel(address) as channel:
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
            assert (await watch.read()).status == SERVING
            watch.cancel()
            assert await service.watches_ended(2.0)
        await server.stop(grace=None)

    asyncio.run(main())


def test_open_calls_wait() -> None:
    async def main() -> None:
        calls: OpenCalls[str] = OpenCalls()
        assert await calls.ended(0.0)
        calls.add("a")
        calls.add("b")
        assert sorted(calls) == ["a", "b"] and len(calls) == 2
        assert not await calls.ended(0.01)
        calls.discard("a")
        assert not await calls.ended(0.01)
        asyncio.get_running_loop().call_later(0.02, calls.discard, "b")
        assert await calls.ended(1.0)
        assert len(calls) == 0

    asyncio.run(main())
