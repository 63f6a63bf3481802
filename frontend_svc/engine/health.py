"""Following one engine's ``grpc.health.v1`` status over the gateway's channel to it.

Health means "can generate": an engine says NOT_SERVING while it drains for shutdown or while its
loop is stalled. ``Watch`` pushes every change, so the gateway takes such an engine out of
rotation at once and brings it back when it serves again. A watch that ends or breaks while the
connection lives (a proxy resetting a quiet stream, say) counts as not serving until it is open
again; it is re-opened every ``retry_s``. An engine without a health service (UNIMPLEMENTED) is
taken to serve whenever its stream is up.
"""

from __future__ import annotations

import asyncio
import logging

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

logger = logging.getLogger(__name__)

_SERVING = health_pb2.HealthCheckResponse.SERVING


class HealthFollower:
    def __init__(
        self,
        address: str,
        channel: grpc.aio.Channel,
        service: str,
        timeout_s: float,
        retry_s: float,
    ) -> None:
        self._address = address
        self._stub = health_pb2_grpc.HealthStub(channel)
        self._request = health_pb2.HealthCheckRequest(service=service)
        self._timeout_s = timeout_s
        self._retry_s = retry_s
        self._watch: grpc.aio.UnaryStreamCall | None = None
        self._unimplemented = False
        self.serving = False

    async def open(self) -> None:
        """Start watching and take the engine's first answer as the current state.

        Raises what the call raises (but UNIMPLEMENTED: then the engine counts as serving)."""
        watch = self._stub.Watch(self._request)
        try:
            first = await asyncio.wait_for(watch.read(), self._timeout_s)
        except grpc.aio.AioRpcError as e:
            if e.code() is not grpc.StatusCode.UNIMPLEMENTED:
                raise
            self._unimplemented = True
            self._set(True)
            return
        except BaseException:
            watch.cancel()
            raise
        if first is grpc.aio.EOF:
            raise ConnectionError(f"engine {self._address} ended its health watch at once")
        self._watch = watch
        self._set(first.status == _SERVING)

    async def follow(self) -> None:
        """Apply every status the engine sends; re-open the watch when it ends. Runs until
        cancelled (the connection closing cancels it)."""
        if self._unimplemented:
            return
        while True:
            reason = await self._read_until_it_ends()
            if reason is None:
                return  # cancelled: the connection is going away
            self._set(False)
            logger.warning("health watch of engine %s ended (%s)", self._address, reason)
            self._watch = None
            while self._watch is None:
                await asyncio.sleep(self._retry_s)
                try:
                    await self.open()
                except (grpc.aio.AioRpcError, asyncio.TimeoutError, ConnectionError) as e:
                    logger.info("health watch of engine %s: %r", self._address, e)
                if self._unimplemented:
                    return

    async def _read_until_it_ends(self) -> str | None:
        assert self._watch is not None
        try:  # read(), not async for: grpc.aio forbids mixing the two on one call
            while (reply := await self._watch.read()) is not grpc.aio.EOF:
                self._set(reply.status == _SERVING)
            return "the engine ended it"
        except grpc.aio.AioRpcError as e:
            if e.code() is grpc.StatusCode.CANCELLED:
                return None
            return f"{e.code().name}: {e.details()}"
        except Exception as e:  # a bug here must not leave the engine in rotation silently
            logger.exception("following the health of engine %s failed", self._address)
            return repr(e)

    def _set(self, serving: bool) -> None:
        if serving != self.serving:
            log = logger.info if serving else logger.warning
            log("engine %s is %s", self._address, "SERVING" if serving else "NOT_SERVING")
        self.serving = serving
