"""Finds stop strings in streamed text, also when one spans several tokens.

Text that could still turn into a stop string (a suffix that is a prefix of one) is held back,
so a stream never shows the start of a stop string that is later cut off.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StopMatch:
    """Result of :meth:`StopStringMatcher.feed`."""

    text: str  # new text safe to emit
    stop: str | None = None  # the stop string found; the sequence ends here


class StopStringMatcher:
    """Feed it decoded text deltas; it says what to emit and when a stop string appears."""

    def __init__(self, stops: Sequence[str], include_stop_in_output: bool = False) -> None:
        self._stops = [s for s in stops if s]
        self._include = include_stop_in_output
        self._text = ""
        self._emitted = 0  # self._text[:self._emitted] has been returned

    def feed(self, delta: str, final: bool = False) -> StopMatch:
        """Add ``delta``. With ``final`` nothing is held back (the sequence ended anyway)."""
        self._text += delta
        if not self._stops:
            return self._emit(len(self._text))
        # Held-back text is never a completed stop, so any match starts at or after _emitted.
        best: tuple[int, str] | None = None
        for stop in self._stops:
            i = self._text.find(stop, self._emitted)
            if i != -1 and (best is None or i < best[0]):
                best = (i, stop)
        if best is not None:
            i, stop = best
            end = i + len(stop) if self._include else i
            return StopMatch(self._emit(end).text, stop)
        if final:
            return self._emit(len(self._text))
        return self._emit(len(self._text) - self._partial_suffix_len())

    def _partial_suffix_len(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string."""
        longest = 0
        tail_from = max(self._emitted, len(self._text) - max(len(s) for s in self._stops) + 1)
        for start in range(tail_from, len(self._text)):
            suffix = self._text[start:]
            if any(s.startswith(suffix) for s in self._stops):
                longest = len(self._text) - start
                break  # the earliest start gives the longest suffix
        return longest

    def _emit(self, end: int) -> StopMatch:
        end = max(end, self._emitted)
        out = self._text[self._emitted : end]
        self._emitted = end
        return StopMatch(out)
