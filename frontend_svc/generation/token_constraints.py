"""Request fields about prompt and output tokens that need the model: checked against its
vocabulary and context length, bad words tokenized (vLLM's rules).

``parse_*`` in ``protocol`` checks their shape; what needs the served model happens here, once
per API call, before any engine request is sent. The context-length rule of a generation request
is :func:`fit_context`, the gateway's one check of it (the engine keeps its own, the contract's,
for every client of the gRPC service).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from frontend_svc.errors import invalid_parameter
from frontend_svc.protocol import SamplingOptions
from frontend_svc.text.tokenizer import Tokenizer
from protos.bad_words import EmptyBadWord, bad_words_token_ids


@dataclass(frozen=True)
class PreparedPrompt:
    token_ids: tuple[int, ...]
    max_tokens: int


def prepare_prompt(
    token_ids: Sequence[int],
    requested_max_tokens: int | None,
    max_model_len: int,
    vocab_size: int,
    prompt_param: str,
    max_tokens_param: str,
    min_tokens: int = 0,
    num_tokens: int | None = None,
    truncate_prompt_tokens: int | None = None,
    keep_prefix: int = 0,
) -> PreparedPrompt:
    """Check the prompt against the context length and resolve max_tokens (default: the rest).

    The length is checked before the ids are scanned, so a huge prompt costs no per-id work here.
    ``num_tokens``: the prompt's length when ``token_ids`` holds only its first ids (a prompt
    longer than the context, cut at tokenization). With ``truncate_prompt_tokens`` the prompt
    is cut to its last ids first (``token_ids`` must then be the whole prompt; ``keep_prefix``:
    see :func:`truncated_prompt`).
    """
    if truncate_prompt_tokens is not None:
        token_ids = truncated_prompt(
            token_ids,
            truncate_prompt_tokens,
            requested_max_tokens,
            max_model_len,
            max_tokens_param,
            keep_prefix,
        )
        num_tokens = None
    n = len(token_ids) if num_tokens is None else num_tokens
    if n == 0:
        raise invalid_parameter("The prompt is empty after tokenization.", prompt_param)
    max_tokens = fit_context(
        n, requested_max_tokens, min_tokens, max_model_len, prompt_param, max_tokens_param
    )
    bad = next((t for t in token_ids if t >= vocab_size), None)
    if bad is not None:
        raise invalid_parameter(
            f"Token id {bad} is out of the vocabulary (size {vocab_size}).", prompt_param
        )
    return PreparedPrompt(tuple(token_ids), max_tokens)


def fit_context(
    num_prompt_tokens: int,
    requested_max_tokens: int | None,
    min_tokens: int,
    max_model_len: int,
    prompt_param: str,
    max_tokens_param: str,
) -> int:
    """The context-length rule: the prompt and the tokens to generate fit in ``max_model_len``
    (the tightest among the engines), and at least one token is generated (``min_tokens`` when
    max_tokens is left to the rest of the context). Returns max_tokens (default: the rest); a
    400 ``context_length_exceeded`` names the parameter to change, as vLLM's does."""
    n = num_prompt_tokens
    room = max_model_len - n  # tokens left for the output
    if room < 1:
        raise invalid_parameter(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"prompt has {n} tokens, which leaves no room for a completion. Please reduce the "
            "length of the prompt.",
            prompt_param,
            code="context_length_exceeded",
        )
    if requested_max_tokens is not None and requested_max_tokens > room:
        raise invalid_parameter(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {n + requested_max_tokens} tokens ({n} in the prompt, "
            f"{requested_max_tokens} in the completion). Please reduce the length of the prompt "
            f"or '{max_tokens_param}'.",
            max_tokens_param,
            code="context_length_exceeded",
        )
    max_tokens = room if requested_max_tokens is None else requested_max_tokens
    if min_tokens > max_tokens:  # only when max_tokens was left to the rest of the context
        raise invalid_parameter(
            f"This model's maximum context length is {max_model_len} tokens and your prompt has "
            f"{n}, which leaves room for {max_tokens} tokens, fewer than 'min_tokens' "
            f"({min_tokens}).",
            "min_tokens",
            code="context_length_exceeded",
        )
    return max_tokens


def resolve_token_constraints(
    options: SamplingOptions, tokenizer: Tokenizer, vocab_size: int
) -> SamplingOptions:
    """``options`` with its bad words as token sequences; 400 naming the parameter for a token
    id outside the vocabulary (logit_bias, allowed_token_ids, or a bad word's tokens)."""
    _check_vocab("logit_bias", [t for t, _ in options.engine.logit_bias], vocab_size)
    _check_vocab("allowed_token_ids", options.engine.allowed_token_ids, vocab_size)
    if not options.bad_words:
        return options
    sequences = _bad_words_token_ids(tokenizer, options.bad_words)
    _check_vocab("bad_words", [t for s in sequences for t in s], vocab_size)
    return replace(options, engine=replace(options.engine, bad_words=tuple(sequences)))


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
    it: the parameter's own bound; the prompt it leaves is checked by :func:`fit_context`); -1
    means that many, or the context length less one when max_tokens is left to the rest of the
    context (at least one token is generated). ``keep_prefix`` first ids survive a cut: the
    special tokens (BOS) a tokenizer put before a text prompt, which its own left truncation
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
