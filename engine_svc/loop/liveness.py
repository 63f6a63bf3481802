"""Whether the engine loop can take work: stall detection (its heartbeat) and draining at
shutdown. ``EngineLoop.unavailable_reason`` (what health follows) puts them together with
sleep mode and the loop thread's own end."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine_svc.loop.engine_loop import EngineLoop


class Heartbeat:
    """When the loop last showed progress: a step finished, or an idle wait ended (an idle loop
    wakes every ``engine_loop._IDLE_WAIT_S``, asleep or not). ``stall_timeout_s``: how long it
    may go without either before it counts as stalled (health NOT_SERVING, new work refused).
    Beaten by the loop thread only; read anywhere."""

    def __init__(self, stall_timeout_s: float) -> None:
        if stall_timeout_s <= 0:
            raise ValueError(f"stall_timeout_s must be positive, got {stall_timeout_s}")
        self.stall_timeout_s = stall_timeout_s
        self._last = time.monotonic()

    def beat(self) -> None:
        self._last = time.monotonic()

    def stall_reason(self) -> str | None:
        """Why the loop counts as stalled now (None: it does not)."""
        age = time.monotonic() - self._last
        if age > self.stall_timeout_s:
            return f"the engine loop has made no progress for {age:.1f}s"
        return None


def drain_and_abort(loop: EngineLoop, timeout_s: float) -> int:
    """Refuse new work, let in-flight requests finish for ``timeout_s``, abort the rest.

    Returns how many requests were aborted; their clients get a final ABORT output.
    """
    loop.draining = True
    deadline = time.monotonic() + timeout_s
    while loop.num_in_flight() and time.monotonic() < deadline:
        time.sleep(0.05)
    return loop.abort_all()
