"""The long-lived calls a server has open, so that shutdown can end them and wait for them.

``grpc.aio.Server.stop`` cancels every handler still running, and gRPC logs each cancelled handler
as an unhandled ``CancelledError`` with a traceback. So shutdown asks each open call to end (the
Streams get UNAVAILABLE, the health Watches NOT_SERVING), waits here until their handlers have
returned, and only then stops the server.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class OpenCalls(Generic[T]):
    """A set of per-call handles (an inbox, a token) with a wait for it to become empty."""

    def __init__(self) -> None:
        self._calls: set[T] = set()
        self._none_open = asyncio.Event()
        self._none_open.set()

    def add(self, call: T) -> None:
        self._calls.add(call)
        self._none_open.clear()

    def discard(self, call: T) -> None:
        self._calls.discard(call)
        if not self._calls:
            self._none_open.set()

    def __iter__(self) -> Iterator[T]:
        return iter(list(self._calls))

    def __len__(self) -> int:
        return len(self._calls)

    async def ended(self, timeout_s: float) -> bool:
        """Wait until every call has returned; False when some are still open at the timeout."""
        if not self._calls:
            return True
        try:
            await asyncio.wait_for(self._none_open.wait(), timeout_s)
        except asyncio.TimeoutError:
            return False
        return True
