"""Logprobs in the two OpenAI shapes: completions (parallel lists) and chat (per-token objects)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from frontend_svc.engine_types import TokenLogprob
from frontend_svc.tokenizer import Tokenizer


class CompletionLogprobs:
    """Builds the completions ``logprobs`` object; ``text_offset`` continues across calls."""

    def __init__(self, tokenizer: Tokenizer, num_top: int, start_offset: int = 0) -> None:
        self._tok = tokenizer
        self._num_top = num_top
        self.offset = start_offset

    def build(
        self, token_ids: Sequence[int], entries: Sequence[TokenLogprob | None]
    ) -> dict[str, Any]:
        """``entries[i]`` is the logprob of ``token_ids[i]`` (None: the first prompt token)."""
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        top: list[dict[str, float] | None] = []
        offsets: list[int] = []
        for token_id, entry in zip(token_ids, entries, strict=True):
            text = self._tok.token_text(token_id)
            tokens.append(text)
            offsets.append(self.offset)
            self.offset += len(text)
            if entry is None:
                token_logprobs.append(None)
                top.append(None)
                continue
            token_logprobs.append(entry.logprob)
            alternatives = {self._tok.token_text(t): lp for t, lp in entry.top[: self._num_top]}
            alternatives.setdefault(text, entry.logprob)
            top.append(alternatives)
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top,
            "text_offset": offsets,
        }


def chat_logprobs(
    tokenizer: Tokenizer, entries: Sequence[TokenLogprob], num_top: int
) -> dict[str, Any]:
    """The chat ``logprobs`` object: ``{"content": [...], "refusal": None}``."""

    def item(token_id: int, logprob: float) -> dict[str, Any]:
        text = tokenizer.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    content = []
    for e in entries:
        entry = item(e.token_id, e.logprob)
        entry["top_logprobs"] = [item(t, lp) for t, lp in e.top[:num_top]]
        content.append(entry)
    return {"content": content, "refusal": None}
