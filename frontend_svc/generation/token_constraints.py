"""Request fields about prompt and output tokens that need the model: checked against its
vocabulary and context length, bad words tokenized (vLLM's rules).

``parse_*`` in ``protocol`` checks their shape; what needs the served model happens here, once
per API call, before any engine request is sent.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from frontend_svc.errors import invalid_parameter
from frontend_svc.protocol import SamplingOptions
from frontend_svc.text.tokenizer import Tokenizer
from protos.bad_words import EmptyBadWord, bad_words_token_ids


def resolve_token_constraints(
    options: SamplingOptions, tokenizer: Tokenizer, vocab_size: int
) -> SamplingOptions:
    """``options`` with its bad words as token sequences; 400 naming the parameter for a token
    id outside the vocabulary (logit_bias, allowed_token_ids, or a bad word's tokens)."""
    _check_vocab("logit_bias", [t for t, _ in options.logit_bias], vocab_size)
    _check_vocab("allowed_token_ids", options.allowed_token_ids, vocab_size)
    if not options.bad_words:
        return options
    sequences = _bad_words_token_ids(tokenizer, options.bad_words)
    _check_vocab("bad_words", [t for s in sequences for t in s], vocab_size)
    return replace(options, bad_words_token_ids=tuple(sequences))


def _bad_words_token_ids(tokenizer: Tokenizer, words: Sequence[str]) -> list[tuple[int, ...]]:
    """vLLM's banned sequences for ``words`` (``protos.bad_words``); 400 for an empty one."""
    try:
        return bad_words_token_ids(
            lambda text: tokenizer.encode(text, add_special_tokens=False), words
        )
    except EmptyBadWord as e:
        raise invalid_parameter(
            f"Bad word {e.word!r} tokenizes to no token.", "bad_words"
        ) from None


def _check_vocab(param: str, token_ids: Sequence[int], vocab_size: int) -> None:
    bad = sorted({t for t in token_ids if t >= vocab_size})
    if bad:
        raise invalid_parameter(
            f"'{param}' holds token ids outside the vocabulary (size {vocab_size}): "
            f"{', '.join(map(str, bad[:5]))}{' ...' if len(bad) > 5 else ''}.",
            param,
        )


def truncated_prompt(
    token_ids: Sequence[int],
    truncate_prompt_tokens: int,
    requested_max_tokens: int | None,
    max_model_len: int,
    max_tokens_param: str,
    keep_prefix: int = 0,
) -> Sequence[int]:
    """The last ``truncate_prompt_tokens`` ids of the prompt (vLLM's truncate_prompt_tokens).

    As in vLLM it may not exceed the context length less the requested max_tokens (400 naming
    it); -1 means that many, or the context length less one when max_tokens is left to the rest
    of the context (at least one token is generated). ``keep_prefix`` first ids survive a cut:
    the special tokens (BOS) a tokenizer put before a text prompt, which its own left truncation
    keeps too.
    """
    room = max_model_len - (requested_max_tokens or 0)
    k = truncate_prompt_tokens
    if k == -1:
        k = room if requested_max_tokens is not None else max_model_len - 1
    elif k > room:
        limit = (
            f"the context length ({max_model_len})"
            if requested_max_tokens is None
            else f"the context length ({max_model_len}) less '{max_tokens_param}' "
            f"({requested_max_tokens}), {room}"
        )
        raise invalid_parameter(
            f"'truncate_prompt_tokens' ({k}) must not exceed {limit}.", "truncate_prompt_tokens"
        )
    if len(token_ids) <= k or k < 1:  # k < 1: max_tokens alone fills the context (refused later)
        return token_ids
    keep = keep_prefix if keep_prefix < k else 0
    return [*token_ids[:keep], *token_ids[len(token_ids) - (k - keep) :]]
