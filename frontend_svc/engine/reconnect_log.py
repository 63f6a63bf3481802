"""What an engine client logs while it cannot reach its engine: little, however long that lasts.

An engine loading a large model refuses connections for minutes, and the client keeps trying
every half second (``BackoffConfig``) so that it is back at once when the engine is. One log line
per attempt would be ~1,800 lines for a 15-minute load, so :class:`ReconnectLog` writes:

- the first failure of an outage (or the break of a stream that was up) at WARNING, at once;
- then one WARNING line with the count of attempts so far, 5 s, 30 s, 1, 2 and 5 minutes after
  the outage began, and every 5 minutes after that;
- an unexpected failure (not the engine being unreachable: a bad tokenizer, an engine serving
  another model) at once with its traceback, once per distinct error;
- one INFO line when connected, with how many attempts failed and for how long.

Only the log is spaced out; the attempts keep their pace.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

# Seconds after the outage began at which a summary line is written; then every last one.
SUMMARY_AT_S = (5.0, 30.0, 60.0, 120.0, 300.0)


class ReconnectLog:
    """The log lines of one engine client's connection attempts (see the module doc)."""

    def __init__(
        self,
        address: str,
        logger: logging.Logger,
        clock: Callable[[], float] = time.monotonic,
        summary_at_s: Sequence[float] = SUMMARY_AT_S,
    ) -> None:
        self._address = address
        self._logger = logger
        self._clock = clock
        self._summary_at = tuple(summary_at_s)
        self._since: float | None = None  # when the current outage began; None: connected
        self._failures = 0  # failed attempts in the current outage
        self._summaries = 0  # summary lines written in the current outage
        self._last_unexpected: str | None = None  # the last unexpected error logged in full

    def failed(self, error: str, unexpected: BaseException | None = None) -> None:
        """An attempt failed with ``error``; ``unexpected``: the exception, when it is not the
        engine being unreachable (logged with its traceback the first time it is seen)."""
        now = self._clock()
        first = self._since is None
        if first:
            self._begin(now)
        self._failures += 1
        if unexpected is not None and error != self._last_unexpected:
            self._last_unexpected = error
            self._logger.warning(
                "engine %s: connecting failed (%s); retrying",
                self._address,
                error,
                exc_info=unexpected,
            )
        elif first:
            self._logger.warning(
                "engine %s unavailable (%s); retrying, next report in %s",
                self._address,
                error,
                _duration(self._next_summary_at()),
            )
        elif self._since is not None and now >= self._since + self._next_summary_at():
            while now >= self._since + self._next_summary_at():  # one line for those passed
                self._summaries += 1
            self._logger.warning(
                "engine %s still unavailable after %d attempts in %s (last: %s); retrying",
                self._address,
                self._failures,
                _duration(now - self._since),
                error,
            )

    def broke(self, error: str) -> None:
        """The stream of a connected engine broke: said at once, and an outage begins."""
        self._begin(self._clock())
        self._logger.warning("engine stream to %s broke: %s", self._address, error)

    def connected(self, detail: str) -> None:
        """Connected (``detail``: what the engine serves); the outage, if any, is over."""
        if self._since is None or self._failures == 0:
            self._logger.info("connected to engine %s (%s)", self._address, detail)
        else:
            self._logger.info(
                "connected to engine %s (%s) after %d failed attempts in %s",
                self._address,
                detail,
                self._failures,
                _duration(self._clock() - self._since),
            )
        self._since = None
        self._last_unexpected = None

    def _begin(self, now: float) -> None:
        self._since, self._failures, self._summaries = now, 0, 0

    def _next_summary_at(self) -> float:
        """Seconds after the outage began at which the next summary is due."""
        at, n = self._summary_at, self._summaries
        if n < len(at):
            return at[n]
        return at[-1] * (n - len(at) + 2)


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    return f"{seconds / 60:.1f} min"
