"""A Stream client's window: the contract's ``FlowControl`` rule, kept once for every engine.

The client says how many messages it lets the engine have in flight (``window``; 0: no window,
gRPC's own flow control only) and how many it has read so far (``messages_read``). The engine may
send while fewer than ``window`` messages are sent and not reported read. A window of 0 in a later
``FlowControl`` keeps the one set; reported counts only grow, and never past what was sent. When
the client half-closes it can report no more progress, so the window is dropped for good.

Used by the engine's Stream (``engine_svc.rpc.stream_outbox``), the test fake engine and the
benchmark stand-in, so that none of them can drift from the others. No torch, no service import.
"""

from __future__ import annotations


class FlowWindow:
    __slots__ = ("window", "sent", "read", "_dropped")

    def __init__(self) -> None:
        self.window = 0  # 0: no window (send whenever gRPC takes the message)
        self.sent = 0
        self.read = 0
        self._dropped = False

    def flow(self, window: int, messages_read: int) -> None:
        """The client's FlowControl message."""
        if window and not self._dropped:
            self.window = window
        self.read = max(self.read, min(messages_read, self.sent))

    def drop(self) -> None:
        """No window from now on (the client half-closed, or the stream is ending)."""
        self.window = 0
        self._dropped = True

    @property
    def full(self) -> bool:
        """No room for another message until the client reports progress."""
        return self.window > 0 and self.sent - self.read >= self.window
