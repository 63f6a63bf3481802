"""DisconnectWatcher: one task per request notices the client leaving and cancels the guarded
work in the awaiting task itself (no extra task per await)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from frontend_svc.sse import ClientDisconnected, DisconnectWatcher, SSEResponse

pytestmark = pytest.mark.timeout(30)


class Channel:
    """An ASGI receive callable the test feeds."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

    async def receive(self) -> dict[str, Any]:
        return await self.queue.get()

    def disconnect(self) -> None:
        self.queue.put_nowait({"type": "http.disconnect"})


async def _value_later(value: int, delay: float) -> int:
    await asyncio.sleep(delay)
    return value


def test_guard_returns_the_work_result() -> None:
    async def scenario() -> None:
        channel = Channel()
        watcher = DisconnectWatcher(channel.receive)
        channel.queue.put_nowait({"type": "http.request", "body": b""})  # not a disconnect
        assert await watcher.guard(_value_later(7, 0.01)) == 7
        assert await watcher.guard(_value_later(8, 0)) == 8
        assert not watcher.disconnected
        watcher.close()

    asyncio.run(scenario())


def test_disconnect_cancels_the_work_and_raises_client_disconnected() -> None:
    closed: list[str] = []

    async def tokens() -> AsyncIterator[int]:
        try:
            yield 1
            await asyncio.sleep(3600)  # the engine is slow
            yield 2
        finally:
            closed.append("aborted")

    async def scenario() -> None:
        channel = Channel()
        watcher = DisconnectWatcher(channel.receive)
        stream = tokens()
        assert await watcher.guard(stream.__anext__()) == 1
        asyncio.get_running_loop().call_later(0.02, channel.disconnect)
        with pytest.raises(ClientDisconnected):
            await watcher.guard(stream.__anext__())
        assert closed == ["aborted"]  # the cancellation reached the stream: it was closed
        task = asyncio.current_task()
        assert task is not None and task.cancelling() == 0  # nothing left pending
        await asyncio.sleep(0.01)  # later awaits of the task are not cancelled
        assert watcher.disconnected
        with pytest.raises(ClientDisconnected):  # and guarded work no longer starts
            await watcher.guard(_value_later(1, 0))
        watcher.close()

    asyncio.run(scenario())


def test_a_disconnect_after_the_guard_cancels_nothing() -> None:
    """The watcher completing while the guarded work ends: its callbacks are already scheduled
    when the guard returns, and must not cancel what the task does next."""

    async def scenario() -> None:
        watcher = DisconnectWatcher(Channel().receive)
        watcher.close()
        gone: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        watcher._task = gone  # type: ignore[assignment]  # completed by hand, below

        async def finish_as_the_client_leaves() -> int:
            gone.set_result(None)  # schedules the watcher's callbacks
            return 3

        assert await watcher.guard(finish_as_the_client_leaves()) == 3
        await asyncio.sleep(0.01)  # the callbacks have run: this task goes on
        task = asyncio.current_task()
        assert task is not None and task.cancelling() == 0
        assert watcher.disconnected

    asyncio.run(scenario())


def test_other_cancellations_are_not_taken_for_a_disconnect() -> None:
    async def scenario() -> None:
        channel = Channel()
        watcher = DisconnectWatcher(channel.receive)
        inner = asyncio.ensure_future(watcher.guard(_value_later(1, 3600)))
        await asyncio.sleep(0.01)
        inner.cancel()  # e.g. the server shutting down
        with pytest.raises(asyncio.CancelledError):
            await inner
        watcher.close()

    asyncio.run(scenario())


def test_sse_response_closes_its_events_when_the_client_leaves() -> None:
    closed: list[bool] = []
    sent: list[dict[str, Any]] = []

    async def events() -> AsyncIterator[bytes]:
        try:
            yield b"data: 1\n\n"
            await asyncio.sleep(3600)
            yield b"data: 2\n\n"
        finally:
            closed.append(True)

    async def scenario() -> None:
        channel = Channel()

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)
            if message.get("body") == b"data: 1\n\n":
                asyncio.get_running_loop().call_later(0.02, channel.disconnect)

        response = SSEResponse(events())
        await asyncio.wait_for(response({"type": "http"}, channel.receive, send), 5)

    asyncio.run(scenario())
    assert closed == [True]
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
