"""One request's constraint: the compiled grammar (shared, cached) and the request's own matcher.

The matcher is the constraint's state over the tokens generated so far. It is advanced only by
``accept`` with each newly sampled token, so it has always accepted exactly the request's output
tokens, whatever the engine does with the KV cache (a preempted request recomputes its tokens
without sampling them again, and its matcher is left as it is).

With a reasoning end (the ids of ``</think>``), the output begins in reasoning and the
constraint waits for it to end, as vLLM's structured outputs wait with a reasoning parser::

    output    <think> I  should  answer  </think>  {  "a"  :  1  }  <eos>
    matcher   -       -  -       -       -         {  "a"  :  1  }  <eos>
    bitmask   none (free sampling) ................ from here on, the grammar's

The matcher accepts exactly the tokens after the first occurrence of the end sequence; until
then ``constraining`` is False, the bitmask leaves the row alone and the text cannot terminate.

Speculative decoding looks ahead without moving: ``fill_bitmask_ahead`` advances over the
proposals to fill one bitmask row per verification position, then rolls the matcher (and the
reasoning watch) back, so the scheduler still advances it only over the tokens emitted.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


class GrammarError(ValueError):
    """The constraint does not compile (an invalid schema, regex or grammar) or this engine
    cannot compile constraints at all. The message starts with the field's path."""


class RequestGrammar:
    """The grammar of one request. ``future`` resolves to an ``xgrammar.CompiledGrammar`` or
    raises ``GrammarError``."""

    def __init__(self, kind: str, future: Future[Any], reasoning_end: Sequence[int] = ()) -> None:
        """``reasoning_end``: the token ids whose first occurrence in the output ends the
        reasoning, after which the constraint applies; empty: it applies from the start."""
        self.kind = kind
        self.future = future
        self._matcher: Any = None  # xgrammar.GrammarMatcher, made once the grammar is compiled
        self.num_accepted = 0  # output tokens seen: those of the reasoning, then the matcher's
        self._reasoning_end = tuple(reasoning_end)
        self._recent: list[int] = []  # the reasoning's last len(reasoning_end) tokens
        self.constraining = not self._reasoning_end

    def ready(self) -> bool:
        """Whether the grammar is compiled (its matcher is made then); never blocks. Raises the
        ``GrammarError`` of a grammar that does not compile."""
        if self._matcher is not None:
            return True
        if not self.future.done():
            return False
        compiled = self.future.result()  # raises GrammarError
        import xgrammar as xgr

        self._matcher = xgr.GrammarMatcher(compiled)
        return True

    def accept(self, token_id: int) -> bool:
        """Advance past a sampled token; False when the grammar does not allow it. A token of
        the reasoning is always allowed and only watched for the reasoning's end."""
        if not self.constraining:
            self._watch_reasoning(token_id)
        elif not self._matcher.accept_token(token_id):
            return False
        self.num_accepted += 1
        return True

    def _watch_reasoning(self, token_id: int) -> None:
        end, recent = self._reasoning_end, self._recent
        recent.append(token_id)
        if len(recent) > len(end):
            del recent[0]
        if len(recent) == len(end) and tuple(recent) == end:
            self.constraining = True
            self._recent = []

    @property
    def is_terminated(self) -> bool:
        """The text is complete and its end (an EOS token) has been accepted."""
        return bool(
            self.constraining and self._matcher is not None and self._matcher.is_terminated()
        )

    def fill_bitmask_ahead(self, bitmask: torch.Tensor, row: int, tokens: Sequence[int]) -> int:
        """Speculative decoding: write into ``bitmask[row + j]`` the tokens allowed after the
        output followed by ``tokens[:j]``, for j = 0 .. m, where m is how many of ``tokens``
        the grammar accepts in a row (it stops at the first it refuses: the positions after it
        are never reached). Returns m. The state is left as it was::

            tokens      d0   d1   d2 (refused)  d3
            rows        row  +1   +2            -         m = 2: d2 is masked out at row + 2

        After an accepted end of the text nothing is constrained (the request stops there)."""
        saved = (self.num_accepted, self.constraining, list(self._recent))
        advanced = 0  # tokens the matcher took (reasoning tokens never reach it)
        m = 0
        try:
            self.fill_bitmask(bitmask, row)
            while m < len(tokens):
                constraining = self.constraining
                if not self.accept(tokens[m]):
                    break
                advanced += constraining
                m += 1
                if self.is_terminated:
                    bitmask[row + m].fill_(-1)
                    break
                self.fill_bitmask(bitmask, row + m)
        finally:
            if advanced:
                self._matcher.rollback(advanced)
            self.num_accepted, self.constraining, self._recent = saved
        return m

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into ``bitmask[row]`` (1 bit per token, 1 = allowed):
        every token while the reasoning lasts."""
        if not self.constraining:
            bitmask[row].fill_(-1)  # all 32 bits of every word set
            return
        self._matcher.fill_next_token_bitmask(bitmask, row)
