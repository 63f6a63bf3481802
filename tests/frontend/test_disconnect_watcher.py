"""DisconnectWatcher: one task per request notices the client leaving and cancels the guarded
work in the awaiting task itself (no extra task per await)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from frontend_svc.routes.sse import ClientDisconnected, DisconnectWatcher, SSEResponse

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


@pytest.mark.parametrize("disconnect_first", [True, False])
def test_a_shutdown_cancel_is_not_taken_for_a_disconnect(disconnect_first: bool) -> None:
    """A client leaving and an outside cancellation (shutdown) both land while the work cleans
    up: the guard raises CancelledError, not ClientDisconnected (which the routes swallow); with
    the shutdown first, the disconnect adds no second cancel to cut the cleanup short."""
    cleaned: list[bool] = []
    cleaning = asyncio.Event()

    async def work() -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            cleaning.set()
            await asyncio.sleep(0.05)  # e.g. aborting the engine request
            cleaned.append(True)

    async def scenario() -> None:
        channel = Channel()
        watcher = DisconnectWatcher(channel.receive)
        guarded = asyncio.ensure_future(watcher.guard(work()))
        await asyncio.sleep(0.01)  # the guard and the work are running
        first, second = (
            (channel.disconnect, guarded.cancel)
            if disconnect_first
            else (guarded.cancel, channel.disconnect)
        )
        # The second lands once the first has started the cleanup (timers 10 and 30 ms apart
        # raced a loaded machine: a 20 ms stall ran both in one turn, in the wrong order).
        first()
        await asyncio.wait_for(cleaning.wait(), 5)
        second()
        with pytest.raises(asyncio.CancelledError):
            await guarded
        watcher.close()

    asyncio.run(scenario())
    # (A shutdown cancel that comes second interrupts the cleanup itself, as any second cancel.)
    assert cleaned == ([] if disconnect_first else [True])


def test_sse_response_closes_its_source_when_the_client_left_before_it_began() -> None:
    """The client went away just as the first delta came: no event is read, yet the source of
    the events (the engine stream) is closed by the response."""
    closed: list[bool] = []

    async def deltas() -> AsyncIterator[int]:
        try:
            yield 1
            yield 2
        finally:
            closed.append(True)

    async def scenario() -> None:
        channel = Channel()
        watcher = DisconnectWatcher(channel.receive)
        source = deltas()
        assert await watcher.guard(source.__anext__()) == 1
        channel.disconnect()
        await asyncio.sleep(0.01)  # the watcher has seen it
        assert watcher.disconnected

        async def events() -> AsyncIterator[bytes]:
            async for d in source:
                yield b"data: %d\n\n" % d

        sent: list[dict[str, Any]] = []

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        response = SSEResponse(events(), watcher=watcher, closing=source.aclose)
        await response({"type": "http"}, channel.receive, send)
        assert sent == []  # nothing was written for a client that is gone
        assert closed == [True]  # by the response, not later by the loop's finalizer

    asyncio.run(scenario())
