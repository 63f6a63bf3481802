"""Turns one sequence's engine outputs into text deltas: detokenize, find stop strings.

When a stop string appears the sequence reports ``finish_reason="stop"`` with the string as
``stop_reason``; the caller then stops reading, which aborts the request on the engine.

Two vLLM rules: stop strings count only once the output has more than ``min_tokens`` tokens, and
when the engine ends a sequence on a token (EOS or a stop token id: ``finish_reason`` stop) that
token's text is dropped unless ``include_stop_str_in_output``; its id stays in ``token_ids`` and
its logprob in ``logprobs``. The text before that token is still searched for stop strings (a
stop string found there wins, as in vLLM's detokenizer).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from frontend_svc.text.detokenizer import IncrementalDetokenizer
from frontend_svc.text.stop_strings import StopStringMatcher
from frontend_svc.text.tokenizer import Tokenizer
from protos.types import EngineOutput, FinishReason, TokenLogprob


@dataclass(slots=True)
class SequenceDelta:
    """What one engine output added to one choice (one per token: read-only by convention, not
    frozen, as :class:`EngineOutput`)."""

    index: int  # the choice index in the response
    prompt_index: int
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...]
    prompt_logprobs: tuple[TokenLogprob, ...]  # first delta only
    finish_reason: str | None
    stop_reason: int | str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    first: bool


class OutputProcessor:
    """Per-sequence state: incremental detokenizer plus stop-string matcher."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        stop: Sequence[str],
        include_stop_str_in_output: bool,
        skip_special_tokens: bool,
        index: int,
        prompt_index: int,
        min_tokens: int = 0,
        kept_special_ids: Collection[int] = (),
    ) -> None:
        """``kept_special_ids``: special tokens whose text stays even with
        ``skip_special_tokens`` (the markers a tool-call parser reads)."""
        self._detok = IncrementalDetokenizer(
            tokenizer,
            prompt_token_ids,
            skip_special_tokens,
            tokenizer.special_token_ids,
            kept_special_ids,
        )
        self._stops = StopStringMatcher(stop, include_stop_str_in_output)
        self._include_stop = include_stop_str_in_output
        self._min_tokens = min_tokens
        self._num_output_tokens = 0
        self._num_prompt_tokens = len(prompt_token_ids)
        self.index = index
        self.prompt_index = prompt_index
        self._first = True
        self.finished = False

    def process(self, out: EngineOutput) -> SequenceDelta:
        ids = out.new_token_ids
        reason = out.finish_reason
        finished = reason is not None
        if reason is FinishReason.STOP and ids and not self._include_stop:
            ids = ids[:-1]  # the stop token's text never shows
        num_before = self._num_output_tokens
        self._num_output_tokens += len(out.new_token_ids)
        finish: str | None = reason.value if reason is not None else None
        stop_reason: int | str | None = out.stop_reason
        if not self._stops.active:  # nearly every request: the detokenized text is the delta
            text = self._detok.push(ids) if ids else ""
            if finished:
                text += self._detok.flush()
        else:
            # Tokens up to min_tokens (counted from the first output token) cannot end on a
            # stop string; the rest of this output can.
            num_unarmed = min(len(ids), max(0, self._min_tokens - num_before))
            emitted = ""
            if num_unarmed:
                unarmed = self._detok.push(ids[:num_unarmed])
                emitted = self._stops.feed(unarmed, armed=False).text
            text = self._detok.push(ids[num_unarmed:])
            if finished:
                text += self._detok.flush()
            armed = self._num_output_tokens > self._min_tokens
            match = self._stops.feed(text, final=finished, armed=armed)
            text = emitted + match.text
            if match.stop is not None:
                finish, stop_reason = "stop", match.stop
        self.finished = finish is not None
        first, self._first = self._first, False
        return SequenceDelta(
            self.index,
            self.prompt_index,
            text,
            out.new_token_ids,
            out.logprobs,
            out.prompt_logprobs if first else (),
            finish,
            stop_reason,
            out.num_prompt_tokens or self._num_prompt_tokens,
            out.num_cached_tokens,
            first,
        )
