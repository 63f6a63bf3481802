"""Incremental detokenization that never emits half a character.

The vLLM technique: decode a small window of tokens twice, once up to ``read_offset`` (text
already emitted) and once to the end, and emit the difference. The window starts at
``prefix_offset`` a few tokens back, so tokenizers that change a token's text depending on its
neighbours (leading spaces, byte fallback) decode consistently::

    token ids   ... p0 p1 p2 | o0 o1 o2
                    ^prefix    ^read      decode(prefix:read) was emitted already
    new text  = decode(prefix:) - decode(prefix:read)

When the new text ends in U+FFFD the last token is an incomplete UTF-8 sequence (one multi-byte
character split across byte-level tokens); it is held back until the next token completes it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

# How many prompt tokens the first window reaches back (vLLM uses the same figure).
INITIAL_PREFIX_TOKENS = 5
_REPLACEMENT = "\ufffd"


class Decoder(Protocol):
    def decode(
        self, token_ids: list[int] | tuple[int, ...], skip_special_tokens: bool = True
    ) -> str: ...


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text deltas."""

    def __init__(
        self,
        decoder: Decoder,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
    ) -> None:
        self._decoder = decoder
        self._skip = skip_special_tokens
        tail = list(prompt_token_ids[-INITIAL_PREFIX_TOKENS:])
        self._ids: list[int] = tail
        self._prefix_offset = 0
        self._read_offset = len(tail)
        self.text = ""  # everything emitted so far

    def push(self, new_token_ids: Sequence[int]) -> str:
        """Add tokens; return the text they complete (possibly empty)."""
        self._ids.extend(new_token_ids)
        return self._advance(flush=False)

    def flush(self) -> str:
        """Emit whatever is held back (at the end of the sequence), even if incomplete."""
        return self._advance(flush=True)

    def _advance(self, flush: bool) -> str:
        if self._read_offset >= len(self._ids):
            return ""
        window = self._ids[self._prefix_offset :]
        prefix_text = self._decoder.decode(
            self._ids[self._prefix_offset : self._read_offset], skip_special_tokens=self._skip
        )
        full_text = self._decoder.decode(window, skip_special_tokens=self._skip)
        if not flush and (len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT)):
            return ""  # nothing new yet, or an incomplete character at the end
        delta = full_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self.text += delta
        return delta
