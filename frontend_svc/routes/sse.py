"""Server-sent events and client-disconnect handling.

Both kinds of response stop the work behind them when the client goes away: a streaming
response cancels its event generator (closing the engine requests), a non-streaming one races
its coroutine against the ASGI ``http.disconnect`` message.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
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


def _json(value: Any) -> bytes:
    data = orjson.dumps(value)
    if not data.isascii():
        for raw, escaped in _LINE_BREAKS:
            if raw in data:
                data = data.replace(raw, escaped)
    return data


def sse_event(payload: dict[str, Any]) -> bytes:
    """One ``data:`` event, encoded once (orjson: UTF-8 bytes, ~10x json.dumps on chunks)."""
    return b"data: " + _json(payload) + b"\n\n"


class TextEvents:
    """The SSE event of a chunk that differs from the others of its choice only by its text:
    the bytes around the text encoded once, the text on its own (0.16 us, where building the
    chunk dict and encoding it costs ~1.2 us: a token of a plain stream). The same bytes as
    ``sse_event`` of that chunk: ``template`` is the chunk with :data:`TEXT` where the text goes
    (orjson keeps key order)."""

    TEXT = "\x00text\x00"

    def __init__(self, template: dict[str, Any]) -> None:
        head, _, tail = sse_event(template).partition(orjson.dumps(self.TEXT))
        if not tail:
            raise ValueError("the template has no TEXT")
        self._head, self._tail = head, tail

    def event(self, text: str) -> bytes:
        return self._head + _json(text) + self._tail


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class DisconnectWatcher:
    """Notices the client going away (ASGI ``http.disconnect``) for one request.

    One task reads ``receive`` for the whole request. :meth:`guard` awaits work in the calling
    task; if the client disconnects meanwhile, the task is cancelled and the guard raises
    :class:`ClientDisconnected` instead (the work sees the cancellation: an engine stream it was
    reading is closed, which aborts the request). No task per awaited work and no
    ``asyncio.wait``: a streamed request used to make four tasks and two waits for this (~50 us
    of the gateway's ~600 us per request).
    """

    def __init__(self, receive: Receive) -> None:
        self._task = asyncio.ensure_future(_wait_disconnect(receive))
        self._task.add_done_callback(_retrieve)  # a failed receive counts as gone, unlogged

    @property
    def disconnected(self) -> bool:
        """The client went away (or its receive channel failed: the same for a response)."""
        return self._task.done() and not self._task.cancelled()

    async def guard(self, work: Awaitable[T]) -> T:
        if self.disconnected:
            if asyncio.iscoroutine(work):
                work.close()  # never started
            raise ClientDisconnected()
        task = asyncio.current_task()
        assert task is not None
        armed, fired = True, False

        def on_disconnect(watcher: asyncio.Future[None]) -> None:
            nonlocal fired
            # Not when the task is being cancelled already (a shutdown): that cancellation
            # stands, and a second one would cut short the cleanup it is running.
            if armed and not watcher.cancelled() and not task.cancelling():
                fired = True
                task.cancel()

        self._task.add_done_callback(on_disconnect)
        try:
            result = await work
        except BaseException as e:
            # Ours, and no other cancellation came on top of it: the client is gone.
            if fired and task.uncancel() == 0:
                raise ClientDisconnected() from e
            raise
        finally:
            armed = False  # a callback already scheduled must not cancel what comes next
            self._task.remove_done_callback(on_disconnect)
        if fired and task.uncancel() > 0:  # the work ended all the same; another cancel stands
            raise asyncio.CancelledError()
        return result

    def close(self) -> None:
        self._task.cancel()


def _retrieve(task: asyncio.Future[None]) -> None:
    if not task.cancelled():
        task.exception()


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``; if the client disconnects first, cancel it and raise ClientDisconnected."""
    watcher = DisconnectWatcher(request.receive)
    try:
        return await watcher.guard(work)
    finally:
        watcher.close()


class SSEResponse(Response):
    """A ``text/event-stream`` response that closes its event source on client disconnect.

    ``watcher``: the request's, when the route already watches for a disconnect (it is closed
    when the response ends); otherwise the response makes its own. ``closing``: awaited when the
    response ends, however it ends: it closes what the events are made from even when no event
    was read (a client gone before the first one)."""

    def __init__(
        self,
        events: AsyncIterator[bytes],
        headers: dict[str, str] | None = None,
        watcher: DisconnectWatcher | None = None,
        closing: Callable[[], Awaitable[object]] | None = None,
    ) -> None:
        super().__init__(status_code=200, media_type="text/event-stream")
        self._events = events
        self._extra_headers = headers or {}
        self._watcher = watcher
        self._closing = closing

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        watcher = self._watcher or DisconnectWatcher(receive)
        headers = [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no"),
        ] + [(k.lower().encode(), v.encode()) for k, v in self._extra_headers.items()]

        async def pump() -> None:
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            async with contextlib.aclosing(self._events):  # type: ignore[type-var]
                async for event in self._events:
                    await send({"type": "http.response.body", "body": event, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        try:
            await watcher.guard(pump())
        except (ClientDisconnected, OSError):
            pass  # gone: the events were closed on the way out
        finally:
            watcher.close()
            if self._closing is not None:
                await self._closing()
