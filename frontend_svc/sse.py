"""Server-sent events and client-disconnect handling.

Both kinds of response stop the work behind them when the client goes away: a streaming
response cancels its event generator (closing the engine requests), a non-streaming one races
its coroutine against the ASGI ``http.disconnect`` message.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

T = TypeVar("T")

DONE_EVENT = b"data: [DONE]\n\n"


class ClientDisconnected(Exception):
    """The HTTP client went away before the response was complete."""


# Code points that JSON leaves raw but that many line splitters (Python's str.splitlines, and
# so httpx's iter_lines) treat as line ends, as UTF-8: a generated token holding one would cut
# an event in two. Escaped, the JSON means the same and every SSE line is whole.
_LINE_BREAKS = (
    (b"\xc2\x85", b"\\u0085"),
    (b"\xe2\x80\xa8", b"\\u2028"),
    (b"\xe2\x80\xa9", b"\\u2029"),
)


def sse_event(payload: dict[str, Any]) -> bytes:
    """One ``data:`` event, encoded once (orjson: UTF-8 bytes, ~10x json.dumps on chunks)."""
    data = orjson.dumps(payload)
    if not data.isascii():
        for raw, escaped in _LINE_BREAKS:
            if raw in data:
                data = data.replace(raw, escaped)
    return b"data: " + data + b"\n\n"


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``; if the client disconnects first, cancel it and raise ClientDisconnected."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
            raise ClientDisconnected()
    return task.result()


class SSEResponse(Response):
    """A ``text/event-stream`` response that closes its event source on client disconnect."""

    def __init__(self, events: AsyncIterator[bytes], headers: dict[str, str] | None = None) -> None:
        super().__init__(status_code=200, media_type="text/event-stream")
        self._events = events
        self._extra_headers = headers or {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no"),
        ] + [(k.lower().encode(), v.encode()) for k, v in self._extra_headers.items()]
        await send({"type": "http.response.start", "status": 200, "headers": headers})

        async def pump() -> None:
            async with contextlib.aclosing(self._events):  # type: ignore[type-var]
                async for event in self._events:
                    await send({"type": "http.response.body", "body": event, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        pump_task = asyncio.create_task(pump())
        watcher = asyncio.create_task(_wait_disconnect(receive))
        try:
            await asyncio.wait({pump_task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not pump_task.done():
                pump_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, OSError):
                await pump_task
