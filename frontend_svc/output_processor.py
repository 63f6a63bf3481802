"""Turns one sequence's engine outputs into text deltas: detokenize, find stop strings.

When a stop string appears the sequence reports ``finish_reason="stop"`` with the string as
``stop_reason``; the caller then stops reading, which aborts the request on the engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from frontend_svc.detokenizer import IncrementalDetokenizer
from frontend_svc.engine_types import EngineOutput, TokenLogprob
from frontend_svc.stop_strings import StopStringMatcher
from frontend_svc.tokenizer import Tokenizer


@dataclass(frozen=True)
class SequenceDelta:
    """What one engine output added to one choice."""

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
    ) -> None:
        self._detok = IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens)
        self._stops = StopStringMatcher(stop, include_stop_str_in_output)
        self._num_prompt_tokens = len(prompt_token_ids)
        self.index = index
        self.prompt_index = prompt_index
        self._first = True
        self.finished = False

    def process(self, out: EngineOutput) -> SequenceDelta:
        text = self._detok.push(out.new_token_ids)
        if out.finished:
            text += self._detok.flush()
        match = self._stops.feed(text, final=out.finished)
        finish: str | None = out.finish_reason.value if out.finish_reason else None
        stop_reason: int | str | None = out.stop_reason
        if match.stop is not None:
            finish, stop_reason = "stop", match.stop
        self.finished = finish is not None
        first, self._first = self._first, False
        return SequenceDelta(
            index=self.index,
            prompt_index=self.prompt_index,
            text=match.text,
            token_ids=out.new_token_ids,
            logprobs=out.logprobs,
            prompt_logprobs=out.prompt_logprobs if first else (),
            finish_reason=finish,
            stop_reason=stop_reason,
            num_prompt_tokens=out.num_prompt_tokens or self._num_prompt_tokens,
            num_cached_tokens=out.num_cached_tokens,
            first=first,
        )
