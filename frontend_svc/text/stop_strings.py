"""Finds stop strings in streamed text, also when one spans several tokens.

Text that could still turn into a stop string (a suffix that is a prefix of one) is held back,
so a stream never shows the start of a stop string that is later cut off.

Until ``min_tokens`` is reached the stop strings are not armed (vLLM's rule: they count only once
the output has more than ``min_tokens`` tokens). Text fed unarmed is emitted like any other text,
and a stop string found later must end in armed text; it may start in unarmed text that is still
held back (vLLM searches from ``len(stop) - 1`` characters before the new text)::

    text      u u u u u a b | s t
                  ^emitted  ^armed_from
    a match must end after armed_from, so it starts at or after armed_from - len(stop) + 1,
    and never before emitted: text already emitted is never cut (nor kept).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(slots=True)
class StopMatch:
    """Result of :meth:`StopStringMatcher.feed` (one per token: read-only by convention, not
    frozen, which would cost 1 us to build)."""

    text: str  # new text safe to emit
    stop: str | None = None  # the stop string found; the sequence ends here


class StopStringMatcher:
    """Feed it decoded text deltas; it says what to emit and when a stop string appears."""

    def __init__(self, stops: Sequence[str], include_stop_in_output: bool = False) -> None:
        self._stops = [s for s in stops if s]
        self._include = include_stop_in_output
        # Only the text not emitted yet is kept (a match never starts in emitted text), so a
        # feed costs what was fed plus at most the longest stop string, however long the output.
        self._pending = ""
        self._armed_from = 0  # into _pending: a stop string counts only if it ends after this

    @property
    def active(self) -> bool:
        """There are stop strings to look for (feeding text through is a no-op otherwise)."""
        return bool(self._stops)

    def feed(self, delta: str, final: bool = False, armed: bool = True) -> StopMatch:
        """Add ``delta``. With ``final`` nothing is held back (the sequence ended anyway).

        With ``armed=False`` (min_tokens not reached yet) no stop string is reported for text
        that ends within this delta; a partial stop at the end is still held back, as it may be
        completed by armed text later.
        """
        if not self._stops:
            return StopMatch(delta)
        self._pending += delta
        if not armed:
            self._armed_from = len(self._pending)
        else:
            best: tuple[int, str] | None = None
            for stop in self._stops:
                i = self._pending.find(stop, max(0, self._armed_from - len(stop) + 1))
                if i != -1 and (best is None or i < best[0]):
                    best = (i, stop)
            if best is not None:
                i, stop = best
                return StopMatch(self._emit(i + len(stop) if self._include else i), stop)
        if final:
            return StopMatch(self._emit(len(self._pending)))
        return StopMatch(self._emit(len(self._pending) - self._partial_suffix_len()))

    def _partial_suffix_len(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string."""
        text = self._pending
        for start in range(max(0, len(text) - max(len(s) for s in self._stops) + 1), len(text)):
            suffix = text[start:]
            if any(s.startswith(suffix) for s in self._stops):
                return len(text) - start  # the earliest start gives the longest suffix
        return 0

    def _emit(self, end: int) -> str:
        out, self._pending = self._pending[:end], self._pending[end:]
        self._armed_from -= end
        return out
