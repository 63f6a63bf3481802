"""Sampling as functions of (logits, per-row parameters): no host sync until token ids return.

Order of operations on each row:
    raw logprobs (what ``logprobs`` reports) -> min_tokens ban -> penalties -> greedy argmax
    or: temperature -> min_p -> top_k -> top_p -> exponential race sample

The exponential race (argmax of p / q with q ~ Exp(1)) draws exactly from p; a seeded request
draws its q from its own generator, so its tokens do not depend on what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_NEG_INF = float("-inf")


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor  # [B] float32, 0 for greedy rows
    all_greedy: bool
    top_k: torch.Tensor | None  # [B] int64, vocab size where disabled
    top_p: torch.Tensor | None  # [B] float32
    min_p: torch.Tensor | None  # [B] float32
    generators: dict[int, torch.Generator]  # row -> seeded generator
    # Penalties, None when no row uses them.
    presence: torch.Tensor | None = None  # [B]
    frequency: torch.Tensor | None = None  # [B]
    repetition: torch.Tensor | None = None  # [B]
    output_counts: torch.Tensor | None = None  # [B, V] occurrences in the output so far
    seen_mask: torch.Tensor | None = None  # [B, V] token in prompt or output
    banned: list[tuple[int, list[int]]] | None = None  # (row, token ids) while under min_tokens
    max_num_logprobs: int | None = None  # top-N for rows asking for logprobs


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
    logits = logits.float()
    raw_logprobs = torch.log_softmax(logits, dim=-1) if md.max_num_logprobs is not None else None

    if md.banned:
        logits = logits.clone()
        for row, ids in md.banned:
            logits[row, ids] = _NEG_INF
    if md.presence is not None:
        logits = apply_penalties(logits, md)

    greedy = logits.argmax(dim=-1)
    if md.all_greedy:
        tokens = greedy
    else:
        tokens = _random_sample(logits, md, greedy)

    out = SamplerOutput(token_ids=tokens)
    if raw_logprobs is not None:
        out.sampled_logprobs, out.sampled_ranks, out.top_ids, out.top_logprobs = gather_logprobs(
            raw_logprobs, tokens, md.max_num_logprobs or 0
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


def apply_penalties(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """OpenAI presence/frequency penalties on output tokens; repetition penalty (divide positive,
    multiply negative logits) on every token seen in prompt or output."""
    assert md.output_counts is not None and md.seen_mask is not None
    assert md.presence is not None and md.frequency is not None and md.repetition is not None
    rep = md.repetition.unsqueeze(1)
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(md.seen_mask, penalized, logits)
    counts = md.output_counts.to(logits.dtype)
    logits = logits - md.frequency.unsqueeze(1) * counts
    logits = logits - md.presence.unsqueeze(1) * (counts > 0).to(logits.dtype)
    return logits


def _random_sample(
    logits: torch.Tensor, md: SamplingMetadata, greedy: torch.Tensor
) -> torch.Tensor:
    is_greedy = md.temperature < 1e-5
    temperature = torch.where(is_greedy, torch.ones_like(md.temperature), md.temperature)
    logits = logits / temperature.unsqueeze(1)
    if md.min_p is not None:
        probs = torch.softmax(logits, dim=-1)
        threshold = probs.amax(dim=-1, keepdim=True) * md.min_p.unsqueeze(1)
        logits = logits.masked_fill(probs < threshold, _NEG_INF)
    if md.top_k is not None or md.top_p is not None:
        logits = _top_k_top_p(logits, md.top_k, md.top_p)
    probs = torch.softmax(logits, dim=-1)

    q = torch.empty_like(probs)
    if len(md.generators) < probs.shape[0]:
        q.exponential_()
    for row, gen in md.generators.items():
        q[row].exponential_(generator=gen)
    sampled = (probs / q).argmax(dim=-1)
    return torch.where(is_greedy, greedy, sampled)


def _top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=False)
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
