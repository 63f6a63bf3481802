"""Logprobs in the two OpenAI shapes, completions (parallel lists) and chat (per-token objects),
plus vLLM's ``prompt_logprobs`` (per prompt position: token id -> logprob, rank, decoded text)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from protos.types import TokenLogprob

# A token a structured-output constraint forbids has logprob -inf, which JSON cannot carry; it is
# shown as this (vLLM's choice) when it appears among the top alternatives.
MIN_LOGPROB = -9999.0


class TokenTexts(Protocol):
    """What the completions logprobs need of a tokenizer (``Tokenizer`` has it)."""

    def token_text(self, token_id: int) -> str: ...


class TokenIdTexts:
    """Tokens shown as ``token_id:N`` (vLLM's ``return_tokens_as_token_ids``): unambiguous
    where several ids decode to the same text or a token is part of a UTF-8 character."""

    def token_text(self, token_id: int) -> str:
        return f"token_id:{token_id}"


TOKEN_ID_TEXTS = TokenIdTexts()


class CompletionLogprobs:
    """Builds the completions ``logprobs`` object; ``text_offset`` continues across calls."""

    def __init__(self, tokenizer: TokenTexts, num_top: int, start_offset: int = 0) -> None:
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
            token_logprobs.append(max(entry.logprob, MIN_LOGPROB))
            top.append(self._top_by_text(entry))
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top,
            "text_offset": offsets,
        }

    def _top_by_text(self, entry: TokenLogprob) -> dict[str, float]:
        """The chosen (or echoed) token, then the top alternatives, keyed by decoded text, in
        that order (vLLM's).

        Several ids can decode to the same text; each text keeps the highest logprob among them,
        whether it came from an alternative or from the chosen token itself. So no entry shows
        less than the most likely token spelled that way, and the chosen token's own logprob
        appears under its text only when no likelier alternative reads the same.
        """
        best: dict[str, float] = {}
        candidates = [(entry.token_id, entry.logprob), *entry.top[: self._num_top]]
        for token_id, logprob in candidates:  # the chosen token, then the most likely first
            key = self._tok.token_text(token_id)
            if key not in best or logprob > best[key]:
                best[key] = max(logprob, MIN_LOGPROB)
        return best


def chat_logprobs(
    tokenizer: TokenTexts, entries: Sequence[TokenLogprob], num_top: int
) -> dict[str, Any]:
    """The chat ``logprobs`` object: ``{"content": [...], "refusal": None}``."""

    def item(token_id: int, logprob: float) -> dict[str, Any]:
        text = tokenizer.token_text(token_id)
        logprob = max(logprob, MIN_LOGPROB)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    content = []
    for e in entries:
        entry = item(e.token_id, e.logprob)
        entry["top_logprobs"] = [item(t, lp) for t, lp in e.top[:num_top]]
        content.append(entry)
    return {"content": content, "refusal": None}


def prompt_logprobs(
    tokenizer: TokenTexts, entries: Sequence[TokenLogprob], num_top: int
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs``: None for the first prompt token (nothing predicts it), then
    for each later one (``entries``, from the engine) the token itself followed by the
    ``num_top`` likeliest tokens, each ``{logprob, rank, decoded_token}`` keyed by its id."""

    def item(logprob: float, rank: int, token_id: int) -> dict[str, Any]:
        return {
            "logprob": max(logprob, MIN_LOGPROB),
            "rank": rank,
            "decoded_token": tokenizer.token_text(token_id),
        }

    out: list[dict[str, dict[str, Any]] | None] = [None]
    for e in entries:
        position = {str(e.token_id): item(e.logprob, e.rank, e.token_id)}
        for rank, (token_id, logprob) in enumerate(e.top[:num_top], start=1):
            position[str(token_id)] = item(logprob, rank, token_id)
        out.append(position)
    return out
