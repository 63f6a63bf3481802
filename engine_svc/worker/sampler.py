"""Sampling as functions of (logits, per-row parameters): no host sync until token ids return.

Order of operations on each row (vLLM's):
    raw logprobs (what ``logprobs`` reports) -> allowed_token_ids -> bad words and min_tokens
    bans -> logit_bias -> penalties -> greedy argmax
    or: temperature -> min_p -> top_k -> top_p -> exponential race sample

A row with a structured-output grammar arrives with the tokens its grammar forbids already at
-inf (``structured_output.bitmask``, applied by the model runner to its own logits), so every
step above, logprobs included, works on the constrained distribution.

The exponential race (argmax of p / q with q ~ Exp(1)) draws exactly from p; a seeded request
draws its q from its own generator, so its tokens do not depend on what else is in the batch.

The caller's logits are never written to. An all-greedy batch takes the argmax of the logits
as they are (bf16 -> fp32 is exact, so the index is the one a float copy would give). Allowed
token ids, bans, logit bias and penalties are computed on a float copy of the rows that have any
of them only (``_adjusted``); otherwise the first float tensor made is the temperature-divided
copy the random rows need anyway.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine_svc.worker.uploads import upload

_NEG_INF = float("-inf")


@dataclass
class ProposalCounts:
    """Verification rows (speculative decoding): the proposals before a position are output
    tokens there. ``counts[e]`` more occurrences of ``token_ids[e]`` in penalised row
    ``rows[e]`` (an index into ``Penalties.rows``) than its request's ``output_counts`` hold;
    each (row, token) once."""

    rows: torch.Tensor  # [E] int64
    token_ids: torch.Tensor  # [E] int64
    counts: torch.Tensor  # [E] int32


@dataclass
class Penalties:
    """The rows of the batch that have a penalty, with their parameters and token statistics.

    Each request's parameters and statistics serve ``positions`` consecutive rows: 1, or the
    ``k + 1`` positions of a verification step, whose statistics differ from the request's only
    by the proposals before each (``ahead``)."""

    rows: torch.Tensor  # [P * positions] int64: the logits rows that have any penalty
    presence: torch.Tensor  # [P] float32
    frequency: torch.Tensor  # [P] float32
    repetition: torch.Tensor  # [P] float32
    output_counts: torch.Tensor  # [P, V] int32: occurrences of each token in the row's output
    seen_mask: torch.Tensor  # [P, V] bool: token in the row's prompt or output
    positions: int = 1
    ahead: ProposalCounts | None = None


@dataclass
class AllowedTokens:
    """The rows of the batch that may only sample some tokens (allowed_token_ids)."""

    rows: torch.Tensor  # [A] int64: the logits rows
    mask: torch.Tensor  # [A, V] bool: True where the token may be sampled


@dataclass
class LogitBias:
    """The batch's logit_bias entries, flattened: ``logits[rows[i], token_ids[i]] += values[i]``."""

    rows: torch.Tensor  # [E] int64: the logits row of each entry
    token_ids: torch.Tensor  # [E] int64
    values: torch.Tensor  # [E] float32


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor | None  # [B] float32, 0 for greedy rows; None when all_greedy
    all_greedy: bool
    top_k: torch.Tensor | None  # [B] int64, vocab size (or more) where disabled
    top_p: torch.Tensor | None  # [B] float32, 1 where disabled
    min_p: torch.Tensor | None  # [B] float32
    generators: dict[int, torch.Generator]  # row -> seeded generator
    penalties: Penalties | None = None  # None when no row has a penalty
    # (row, token ids): EOS and stop ids while under min_tokens, the next token of a bad word.
    banned: list[tuple[int, list[int]]] | None = None
    allowed: AllowedTokens | None = None  # None when no row has allowed_token_ids
    logit_bias: LogitBias | None = None  # None when no row has a logit_bias
    # The rows of allowed, logit_bias, penalties and banned together, sorted, when any but the
    # penalties is set (``sampling_inputs`` knows them on the host; None: computed here, which
    # costs a device sync).
    adjusted_rows: torch.Tensor | None = None
    max_num_logprobs: int | None = None  # top-N for rows asking for logprobs
    # Host-side size of the top-k candidate set, when top_k is set: the largest top_k below the
    # vocab size, or the vocab size if a row has top_p < 1 without a top_k (that row needs a
    # full sort). None: read from top_k/top_p on the device (one device-to-host copy).
    max_top_k: int | None = None


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64
    # Present when some row asked for logprobs: raw-model logprobs of the sampled token,
    # its rank, and the top-N alternatives.
    sampled_logprobs: torch.Tensor | None = None  # [B]
    sampled_ranks: torch.Tensor | None = None  # [B]
    top_ids: torch.Tensor | None = None  # [B, N]
    top_logprobs: torch.Tensor | None = None  # [B, N]


def sample(logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
    tokens = _greedy_sample(logits, md) if md.all_greedy else _random_sample(logits, md)
    out = SamplerOutput(token_ids=tokens)
    if md.max_num_logprobs is not None:
        raw_logprobs = torch.log_softmax(logits.float(), dim=-1)
        out.sampled_logprobs, out.sampled_ranks, out.top_ids, out.top_logprobs = gather_logprobs(
            raw_logprobs, tokens, md.max_num_logprobs
        )
    return out


def gather_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, num: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logprob of token, its 1-based rank, top-``num`` ids, their logprobs) per row."""
    chosen = logprobs.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)
    ranks = (logprobs > chosen.unsqueeze(-1)).sum(-1) + 1
    top_lp, top_ids = (
        logprobs.topk(num, dim=-1) if num > 0 else (logprobs[:, :0], token_ids[:, None][:, :0])
    )
    return chosen, ranks, top_ids, top_lp


def apply_penalties(logits: torch.Tensor, penalties: Penalties) -> torch.Tensor:
    """The rows ``penalties.rows`` of ``logits`` as a new [P, V] float32 tensor, penalised:
    OpenAI presence/frequency penalties on output tokens; repetition penalty (divide positive,
    multiply negative logits) on every token seen in prompt or output."""
    return _penalize(logits.index_select(0, penalties.rows).float(), penalties)


def _penalize(x: torch.Tensor, penalties: Penalties) -> torch.Tensor:
    """``apply_penalties`` on rows already gathered: ``x`` is [P * positions, V] float32. The
    positions of a request share its statistics (broadcast, not copied); the few entries the
    proposals before a position change are computed again with their own counts."""
    pen, n = penalties, penalties.positions
    p = pen.output_counts.shape[0]
    out = _penalty(
        x.view(p, n, -1),
        pen.repetition.view(p, 1, 1),
        pen.frequency.view(p, 1, 1),
        pen.presence.view(p, 1, 1),
        pen.output_counts.unsqueeze(1),
        pen.seen_mask.unsqueeze(1),
    ).view(x.shape)
    ahead = pen.ahead
    if ahead is not None:
        at, tok = ahead.rows, ahead.token_ids
        owner = at // n
        counts = pen.output_counts[owner, tok] + ahead.counts
        seen = torch.ones_like(counts, dtype=torch.bool)  # an output token is seen
        out[at, tok] = _penalty(
            x[at, tok],
            pen.repetition[owner],
            pen.frequency[owner],
            pen.presence[owner],
            counts,
            seen,
        )
    return out


def _penalty(
    x: torch.Tensor,
    repetition: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
    counts: torch.Tensor,
    seen: torch.Tensor,
) -> torch.Tensor:
    """The penalties, elementwise (the arguments broadcast against ``x``)."""
    penalized = torch.where(x > 0, x / repetition, x * repetition)
    x = torch.where(seen, penalized, x)
    c = counts.to(x.dtype)
    x = x - frequency * c
    x = x - presence * (c > 0).to(x.dtype)
    return x


def _adjusted(
    logits: torch.Tensor, md: SamplingMetadata
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(rows, x): the logits rows that have allowed token ids, a logit bias, a penalty or banned
    tokens, as a new [R, V] float32 tensor with those applied (allowed -> bias -> penalties, then
    the bans: a -inf stays -inf through the others, so this is vLLM's order); None when no row
    has any. Rows without them cost nothing here."""
    pen = md.penalties
    if md.allowed is None and md.logit_bias is None and not md.banned:
        return None if pen is None else (pen.rows, apply_penalties(logits, pen))
    rows = md.adjusted_rows if md.adjusted_rows is not None else _union_rows(md, logits.device)
    x = logits.index_select(0, rows).float()
    allowed = md.allowed
    if allowed is not None:
        at = torch.searchsorted(rows, allowed.rows)
        x.index_copy_(0, at, x.index_select(0, at).masked_fill_(~allowed.mask, _NEG_INF))
    bias = md.logit_bias
    if bias is not None:
        at = torch.searchsorted(rows, bias.rows)
        x.index_put_((at, bias.token_ids), bias.values, accumulate=True)
    if pen is not None:
        at = torch.searchsorted(rows, pen.rows)
        x.index_copy_(0, at, _penalize(x.index_select(0, at), pen))
    if md.banned:
        ban_rows = [row for row, ids in md.banned for _ in ids]
        ban_ids = [t for _, ids in md.banned for t in ids]
        at = torch.searchsorted(rows, upload(ban_rows, x.device))
        ninf = torch.full((), _NEG_INF, device=x.device)  # made there: no host copy
        x.index_put_((at, upload(ban_ids, x.device)), ninf)
    return rows, x


def _union_rows(md: SamplingMetadata, device: torch.device) -> torch.Tensor:
    parts = [p.rows for p in (md.allowed, md.logit_bias, md.penalties) if p is not None]
    parts.append(torch.tensor([row for row, _ in md.banned or ()], dtype=torch.int64))
    return torch.cat([p.to(device) for p in parts]).unique(sorted=True)


def _greedy_sample(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    # No float copy: bf16/fp16 -> fp32 is exact, and argmax returns the first maximum either way.
    tokens = logits.argmax(dim=-1)
    adjusted = _adjusted(logits, md)
    if adjusted is not None:
        rows, x = adjusted
        tokens.index_copy_(0, rows, x.argmax(dim=-1))
    return tokens


def greedy_tokens(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Each row's argmax after allowed token ids, bans, logit bias and penalties: the token a
    greedy row samples (speculative decoding verifies greedy proposals against it)."""
    return _greedy_sample(logits, md)


def _processed(
    logits: torch.Tensor, md: SamplingMetadata, temperature: torch.Tensor
) -> torch.Tensor:
    """A new float32 tensor: the logits divided by ``temperature``, with the rows ``_adjusted``
    changes (allowed token ids, bias, penalties, bans) replaced by their adjusted values."""
    out = logits / temperature.unsqueeze(1)  # bf16 / fp32 computes in fp32
    adjusted = _adjusted(logits, md)
    if adjusted is not None:
        rows, x = adjusted
        out.index_copy_(0, rows, x / temperature.index_select(0, rows).unsqueeze(1))
    return out


def _random_sample(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    probs, is_greedy, greedy = _target_probs(logits, md)
    q = torch.empty_like(probs)
    if len(md.generators) < probs.shape[0]:
        q.exponential_()
    for row, gen in md.generators.items():
        q[row].exponential_(generator=gen)
    sampled = (probs / q).argmax(dim=-1)
    return torch.where(is_greedy, greedy, sampled)


def target_probs(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """The distribution each row's token is drawn from (float32 [B, V]): temperature, the
    adjusted rows, min-p, top-k and top-p applied, as ``sample`` draws (speculative decoding
    verifies proposals against it). Greedy rows (temperature ~0) get softmax(logits)."""
    return _target_probs(logits, md)[0]


def _target_probs(
    logits: torch.Tensor, md: SamplingMetadata
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(probs, is_greedy [B], each row's argmax after the adjustments)."""
    assert md.temperature is not None, "a batch with random rows has temperatures"
    is_greedy = md.temperature < 1e-5
    temperature = torch.where(is_greedy, torch.ones_like(md.temperature), md.temperature)
    logits = _processed(logits, md, temperature)
    greedy = logits.argmax(dim=-1)  # greedy rows were divided by exactly 1
    if md.min_p is not None:
        probs = torch.softmax(logits, dim=-1)
        threshold = probs.amax(dim=-1, keepdim=True) * md.min_p.unsqueeze(1)
        logits = logits.masked_fill(probs < threshold, _NEG_INF)
    if md.top_k is not None:
        num = md.max_top_k
        if num is None:
            num = _num_top_candidates(md.top_k, md.top_p, logits.shape[-1])
        logits = _top_k_top_p(logits, md.top_k, md.top_p, num)
    elif md.top_p is not None:
        logits = _sorted_top_k_top_p(logits, None, md.top_p)
    return torch.softmax(logits, dim=-1), is_greedy, greedy


def _num_top_candidates(top_k: torch.Tensor, top_p: torch.Tensor | None, vocab: int) -> int:
    """``SamplingMetadata.max_top_k`` computed on the device (one device-to-host copy)."""
    disabled = top_k >= vocab
    need = top_k.clamp(min=1).masked_fill(disabled, 0)
    if top_p is not None:
        need = need.masked_fill(disabled & (top_p < 1), vocab)
    return int(need.max())


def _top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor | None, num: int
) -> torch.Tensor:
    """Top-k (and top-p among the top-k) from the ``num`` largest values of each row.

    Same result as ``_sorted_top_k_top_p``: top-k keeps every value >= the k-th largest (ties
    kept); top-p then drops the ascending prefix whose cumulative probability is <= 1 - p,
    never the largest value; among equal values the lower token ids are dropped first (a stable
    sort). Rows with top_k >= vocab are left as they are, which needs their top_p to be 1:
    ``num`` is the vocab size otherwise, and the full sort is used.
    """
    vocab = logits.shape[-1]
    if num >= vocab:
        return _sorted_top_k_top_p(logits, top_k, top_p)
    if num <= 0:
        return logits
    vals = logits.topk(num, dim=-1).values  # [B, num], descending
    has_k = (top_k < vocab).unsqueeze(1)
    kth = vals.gather(1, top_k.clamp(1, num).unsqueeze(1) - 1).masked_fill(~has_k, _NEG_INF)
    if top_p is None:
        return logits.masked_fill(logits < kth, _NEG_INF)

    # The top-k set S of a row is {x >= kth}: the candidates >= kth, plus `missing` values
    # equal to kth that topk left out (a tie across position num).
    in_s = vals >= kth
    num_s = (logits >= kth).sum(-1, keepdim=True)
    num_in = in_s.sum(-1, keepdim=True)
    missing = num_s - num_in
    e = torch.exp(vals - vals[:, :1]).masked_fill(~in_s, 0.0)
    e_kth = torch.exp(kth - vals[:, :1])
    z = e.sum(-1, keepdim=True) + missing * e_kth
    m = e_kth / z  # probability of each value equal to kth
    cut = 1 - top_p.unsqueeze(1)
    # Ascending cumulative probability over S: the missing values (the smallest of S) first.
    asc = (e / z).flip(-1)
    asc[:, :1] += missing * m
    cum = asc.cumsum(-1)
    dropped = ((cum <= cut) & in_s.flip(-1)).sum(-1, keepdim=True)
    dropped_missing = torch.where(
        m > 0, torch.minimum((cut / m).floor(), missing.to(m.dtype)), missing.to(m.dtype)
    )
    keep_n = (num_s - dropped - dropped_missing.long()).clamp(min=1)

    # Keep the keep_n largest of S, the larger token id first among equal values: all values
    # above the cutoff value v, and the `need` highest ids of those equal to v.
    v = vals.gather(1, torch.minimum(keep_n, num_in) - 1)
    need = keep_n - (vals > v).sum(-1, keepdim=True)
    eq = logits == v
    rank = eq.cumsum(-1, dtype=torch.int32)  # equal values at ids <= this one
    keep = (logits > v) | (eq & (rank > rank[:, -1:] - need)) | ~has_k
    return logits.masked_fill(~keep, _NEG_INF)


def _sorted_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Top-k/top-p with a full sort of each row: for top-p without top-k."""
    sorted_logits, order = logits.sort(dim=-1, descending=False, stable=True)
    vocab = logits.shape[-1]
    if top_k is not None:
        # Keep the k largest: everything below the k-th largest value goes.
        kth = sorted_logits.gather(1, (vocab - top_k.clamp(1, vocab)).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, _NEG_INF)
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        cum = probs.cumsum(dim=-1)
        drop = cum <= (1 - top_p.unsqueeze(1))
        drop[:, -1] = False  # always keep the most likely token
        sorted_logits = sorted_logits.masked_fill(drop, _NEG_INF)
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
