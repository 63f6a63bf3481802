"""``grpc.health.v1`` for the engine: one status shared by "" and the Engine service.

Health means "can generate": the server's watchdog sets NOT_SERVING while the engine loop is
stalled, dead or draining, and SERVING again when it recovers. Unlike grpcio-health-checking's
servicer, ``close()`` ends every ``Watch`` call (after its last status) and ``watches_ended``
waits until their handlers have returned, so a stopping server has no long-lived call left to
cancel.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine_svc.rpc.open_calls import OpenCalls

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
SERVICE_NAME = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name


class HealthService(health_pb2_grpc.HealthServicer):
    def __init__(self, services: Iterable[str]) -> None:
        self._services = tuple(services)
        self._status = dict.fromkeys(self._services, NOT_SERVING)
        self._changed = asyncio.Condition()
        self._closed = False
        self._watches: OpenCalls[object] = OpenCalls()

    @property
    def serving(self) -> bool:
        return all(s == SERVING for s in self._status.values())

    async def set_serving(self, serving: bool) -> None:
        async with self._changed:
            for name in self._services:
                self._status[name] = SERVING if serving else NOT_SERVING
            self._changed.notify_all()

    async def close(self) -> None:
        """NOT_SERVING for good; every Watch call sends it and ends."""
        async with self._changed:
            self._closed = True
            for name in self._services:
                self._status[name] = NOT_SERVING
            self._changed.notify_all()

    async def watches_ended(self, timeout_s: float) -> bool:
        """Wait until every Watch call has returned (after ``close``)."""
        return await self._watches.ended(timeout_s)

    async def Check(  # noqa: N802 - gRPC method name
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> health_pb2.HealthCheckResponse:
        status = self._status.get(request.service)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(  # noqa: N802
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> None:
        last: int | None = None
        call = object()
        self._watches.add(call)
        try:
            while True:
                async with self._changed:
                    while not self._closed and self._status_of(request.service) == last:
                        await self._changed.wait()
                    status = self._status_of(request.service)
                if status != last:  # written outside the lock: a slow watcher holds nobody up
                    await context.write(health_pb2.HealthCheckResponse(status=status))
                    last = status
                if self._closed:
                    return
        finally:
            self._watches.discard(call)

    def _status_of(self, service: str) -> int:
        return self._status.get(service, SERVICE_UNKNOWN)
