"""The utility rpcs of the ``Engine`` service (vLLM's engine-core utilities): ResetPrefixCache,
Sleep, WakeUp, IsSleeping, StartProfile, StopProfile.

Each one runs on the engine loop thread between two steps (``EngineLoop.call``), except Sleep,
which the loop carries out once the requests it already took in have finished
(``EngineLoop.sleep``), and IsSleeping, which reads a flag.

Status codes: INVALID_ARGUMENT (Sleep level other than 0, 1, 2: 0 means 1), FAILED_PRECONDITION
(StartProfile without a profile directory or while a profile runs; StopProfile with none
running), ABORTED (a Sleep still waiting for its requests was cancelled by a WakeUp),
UNAVAILABLE (the engine loop stopped). Cancelling a Sleep call does not cancel the sleep: WakeUp
does.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from typing import TypeVar

import grpc

from engine_svc.loop.engine_loop import EngineLoop
from engine_svc.loop.errors import SleepCancelled, Unavailable
from engine_svc.profiler import ProfilerError
from protos.tandem.engine.v1 import engine_pb2 as pb

T = TypeVar("T")


def utility_status(e: Exception) -> grpc.StatusCode:
    """The gRPC status of a failed utility call."""
    if isinstance(e, ProfilerError):
        return grpc.StatusCode.FAILED_PRECONDITION
    if isinstance(e, SleepCancelled):
        return grpc.StatusCode.ABORTED
    if isinstance(e, Unavailable):
        return grpc.StatusCode.UNAVAILABLE
    if isinstance(e, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT
    return grpc.StatusCode.INTERNAL


class UtilityRpcs:
    """Mixed into ``EngineServicer``, which provides ``loop``."""

    loop: EngineLoop

    async def _utility(
        self,
        start: Callable[[], concurrent.futures.Future[T]],
        context: grpc.aio.ServicerContext,
    ) -> T:
        """Start the call (``start`` may refuse at once) and wait for its result; a failure
        becomes the call's status."""
        try:
            return await asyncio.wrap_future(start())
        except (ProfilerError, SleepCancelled, Unavailable, ValueError) as e:
            await context.abort(utility_status(e), str(e))
            raise  # abort() raises; this only tells type checkers

    async def ResetPrefixCache(  # noqa: N802 - gRPC method name
        self, request: pb.ResetPrefixCacheRequest, context: grpc.aio.ServicerContext
    ) -> pb.ResetPrefixCacheResponse:
        reset = await self._utility(
            lambda: self.loop.call(lambda core: core.reset_prefix_cache()), context
        )
        return pb.ResetPrefixCacheResponse(reset=reset)

    async def Sleep(  # noqa: N802
        self, request: pb.SleepRequest, context: grpc.aio.ServicerContext
    ) -> pb.SleepResponse:
        level = request.level or 1
        # Shielded: a caller that goes away (deadline, cancel) leaves the sleep under way.
        await self._utility(lambda: _shielded(self.loop.sleep(level)), context)
        return pb.SleepResponse()

    async def WakeUp(  # noqa: N802
        self, request: pb.WakeUpRequest, context: grpc.aio.ServicerContext
    ) -> pb.WakeUpResponse:
        await self._utility(self.loop.wake_up, context)
        return pb.WakeUpResponse()

    async def IsSleeping(  # noqa: N802
        self, request: pb.IsSleepingRequest, context: grpc.aio.ServicerContext
    ) -> pb.IsSleepingResponse:
        return pb.IsSleepingResponse(is_sleeping=self.loop.is_sleeping)

    async def StartProfile(  # noqa: N802
        self, request: pb.StartProfileRequest, context: grpc.aio.ServicerContext
    ) -> pb.StartProfileResponse:
        await self._utility(lambda: self.loop.call(lambda core: core.start_profile()), context)
        return pb.StartProfileResponse()

    async def StopProfile(  # noqa: N802
        self, request: pb.StopProfileRequest, context: grpc.aio.ServicerContext
    ) -> pb.StopProfileResponse:
        path = await self._utility(
            lambda: self.loop.call(lambda core: core.stop_profile()), context
        )
        return pb.StopProfileResponse(trace_path=path)


def _shielded(future: concurrent.futures.Future[T]) -> concurrent.futures.Future[T]:
    """A future that follows ``future`` but whose cancellation leaves ``future`` alone."""
    outer: concurrent.futures.Future[T] = concurrent.futures.Future()

    def copy(done: concurrent.futures.Future[T]) -> None:
        if outer.set_running_or_notify_cancel():
            if (error := done.exception()) is not None:
                outer.set_exception(error)
            else:
                outer.set_result(done.result())

    future.add_done_callback(copy)
    return outer
