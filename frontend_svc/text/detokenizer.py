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

With a Hugging Face fast tokenizer (``decode_stream``) the two decodes run in Rust, in
``tokenizers``' DecodeStream (the same technique, one call per push, as vLLM's fast
detokenizer); the window is still kept, for the end of the sequence (DecodeStream cannot emit an
incomplete tail) and as the fallback when DecodeStream refuses a step (its "invalid prefix"
error: a decoder whose text for earlier tokens changes with later ones).

Only the window (ids from ``prefix_offset`` on) is kept. With ``skip_special_tokens`` a special
token decodes to nothing and does not change its neighbours' text (the tokenizer drops it before
decoding), so special ids never enter the window: a long run of them would otherwise grow it
without bound, and every push would decode an ever longer window. Special ids a reader of the
text needs (a tool-call parser's ``<tool_call>``) can be kept: since the window then already
lacks every dropped id, it is decoded with nothing skipped.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Protocol

# How many prompt tokens the first window reaches back (vLLM uses the same figure).
INITIAL_PREFIX_TOKENS = 5
_REPLACEMENT = "\ufffd"


class Decoder(Protocol):
    def decode(
        self, token_ids: list[int] | tuple[int, ...], skip_special_tokens: bool = True
    ) -> str: ...


StreamStep = Callable[[int | list[int]], str | None]


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text deltas."""

    def __init__(
        self,
        decoder: Decoder,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        special_token_ids: Collection[int] = (),
        kept_special_ids: Collection[int] = (),
    ) -> None:
        """``special_token_ids``: the ids ``skip_special_tokens`` drops (left out of the window);
        ``kept_special_ids``: those of them whose text is kept all the same."""
        self._decoder = decoder
        kept = frozenset(kept_special_ids)
        self._skip = skip_special_tokens and not kept
        self._dropped = frozenset(special_token_ids) - kept if skip_special_tokens else frozenset()
        tail = self._kept(prompt_token_ids[-INITIAL_PREFIX_TOKENS:])
        self._window: list[int] = tail  # the ids from prefix_offset on
        self._read_offset = len(tail)  # into the window: decode(window[:read]) was emitted
        self._pieces: list[str] = []
        make_stream = getattr(decoder, "decode_stream", None)
        self._stream: StreamStep | None = None
        # DecodeStream takes seed ids whose text ends in U+FFFD (a prompt cut inside a
        # character, or a literal U+FFFD) as not yet emitted, and would put their text in the
        # first delta: such a prompt keeps the Python window (one decode per sequence to know).
        if make_stream is not None and not (
            tail and decoder.decode(tail, skip_special_tokens=self._skip).endswith(_REPLACEMENT)
        ):
            self._stream = make_stream(list(tail), self._skip)  # None: not with this version

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return "".join(self._pieces)

    @property
    def window_size(self) -> int:
        """Ids held for the next decode: the prefix context plus ids whose text is pending."""
        return len(self._window)

    def push(self, new_token_ids: Sequence[int]) -> str:
        """Add tokens; return the text they complete (possibly empty)."""
        window = self._window
        if len(new_token_ids) == 1:  # nearly every push: one token
            token = new_token_ids[0]
            if token in self._dropped:
                return ""
            window.append(token)
            step: int | list[int] = token
        else:
            ids = self._kept(new_token_ids)
            if not ids:
                return ""
            window.extend(ids)
            step = ids
        if self._stream is None:
            return self._advance(flush=False)
        try:
            delta = self._stream(step)
        except Exception:  # DecodeStream's "invalid prefix": decode the window from now on
            self._stream = None
            return self._advance(flush=False)
        if delta is None:
            return ""  # an incomplete character, held back
        self._emitted(delta)
        return delta

    def flush(self) -> str:
        """Emit whatever is held back (at the end of the sequence), even if incomplete."""
        return self._advance(flush=True)

    def _kept(self, token_ids: Sequence[int]) -> list[int]:
        if not self._dropped:
            return list(token_ids)
        return [t for t in token_ids if t not in self._dropped]

    def _advance(self, flush: bool) -> str:
        if self._read_offset >= len(self._window):
            return ""
        prefix_text = self._decoder.decode(
            self._window[: self._read_offset], skip_special_tokens=self._skip
        )
        full_text = self._decoder.decode(self._window, skip_special_tokens=self._skip)
        if not flush and (len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT)):
            return ""  # nothing new yet, or an incomplete character at the end
        delta = full_text[len(prefix_text) :]
        self._emitted(delta)
        return delta

    def _emitted(self, delta: str) -> None:
        # The new prefix_offset is the old read_offset; the new read_offset is the end.
        del self._window[: self._read_offset]
        self._read_offset = len(self._window)
        self._pieces.append(delta)
