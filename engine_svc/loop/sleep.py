"""Sleep mode on the engine loop (the Sleep and WakeUp rpcs): a small state machine.

    AWAKE --sleep(level)--> GOING TO SLEEP --no request left--> ASLEEP --wake_up--> AWAKE
                                  |
                                  +--wake_up--> AWAKE  (each waiting sleep: SleepCancelled)

From the moment ``sleep`` is called the engine refuses new requests (``Asleep``, an
``Unavailable``: health NOT_SERVING), while the ones already taken in run to their end; once none
is left the core goes to sleep and the futures resolve. While asleep the loop never steps, but it
still drains its queue (calls, aborts) and keeps its heartbeat fresh, so the stall detector never
takes a sleeping engine for a stalled one. ``wake_up`` wakes it, or cancels a sleep still waiting
for its requests: that ``sleep`` future fails with ``SleepCancelled``.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Iterable

Waiter = concurrent.futures.Future[None]


class SleepMode:
    """The state, and the futures of the sleeps asked for.

    Not thread-safe: ``EngineLoop`` changes it under its lock (the same lock that counts the
    requests on their way in, so no request slips in between a sleep being asked for and the
    loop finding none left). ``pending`` and ``asleep`` are flags anyone may read.
    """

    def __init__(self) -> None:
        self._waiters: list[tuple[int, Waiter]] = []  # (level, future) of each sleep asked for
        self.pending = False  # going to sleep: waiting for the requests taken in to finish
        self.asleep = False

    @property
    def requested(self) -> bool:
        """Asleep or going to sleep: new requests are refused."""
        return self.asleep or self.pending

    def ask(self, level: int) -> Waiter:
        """A sleep at ``level``; its future is resolved at once when the engine sleeps already
        (sleeping again is a no-op), else when it goes to sleep (``went_to_sleep``)."""
        future: Waiter = concurrent.futures.Future()
        if self.asleep:
            future.set_result(None)
        else:
            self.pending = True
            self._waiters.append((level, future))
        return future

    def take(self) -> tuple[int, list[Waiter]]:
        """Going to sleep now: the deepest level asked for, and the futures to settle."""
        level = max(level for level, _ in self._waiters)
        return level, self.take_waiters()

    def went_to_sleep(self, ok: bool) -> None:
        """The core went to sleep (``ok``), or failed to and stays awake."""
        self.pending = False
        self.asleep = ok

    def woke_up(self) -> None:
        self.asleep = False

    def cancel(self) -> list[Waiter]:
        """A wake up: no sleep is pending any more; returns the futures to fail."""
        self.pending = False
        return self.take_waiters()

    def take_waiters(self) -> list[Waiter]:
        """The futures of the sleeps asked for, forgotten here (the caller settles them)."""
        waiters, self._waiters = self._waiters, []
        return [future for _, future in waiters]


def settle(futures: Iterable[Waiter], error: Callable[[], Exception] | None = None) -> None:
    """Resolve each future whose caller still waits: with None, or failed with ``error()``."""
    for future in futures:
        if future.set_running_or_notify_cancel():
            if error is None:
                future.set_result(None)
            else:
                future.set_exception(error())
