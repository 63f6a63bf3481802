"""Verifying proposed tokens against the target model, exactly.

A request with ``n`` proposed tokens ``d_0 .. d_{n-1}`` is run through the target model with
those tokens appended, which gives the target's distribution at ``n + 1`` positions: ``p_0``
(the next token after the context), ``p_1`` (after ``d_0``), ..., ``p_n``. Verification
emits between 1 and ``n + 1`` tokens::

    greedy    d_j is accepted while d_j == argmax p_j; at the first j where it is not, the
              target's argmax_j is emitted instead and the run ends; if all n are accepted the
              bonus token argmax p_n follows. Exactly the tokens greedy decoding would produce.
    sampled   d_j is accepted with probability min(1, p_j(d_j) / q_j(d_j)), q_j the proposer's
              distribution (a point mass for n-gram proposals: q_j(d_j) = 1). At the first
              rejection a token is drawn from the residual norm(max(p_j - q_j, 0)) and the run
              ends; if all n are accepted the bonus token is drawn from p_n. Each emitted token
              is distributed as the target's, whatever q is (Leviathan et al. 2023, Chen et al.
              2023).

``p_j`` here is the distribution the sampler would draw from without speculation: the caller
applies temperature, penalties, bias, bans, allowed ids, min-p, top-k and top-p to each
position's logits first, with position j's state including the j proposed tokens before it.

Draws use the exponential-race form of sampling (argmax of prob / Exp(1)), the sampler's own,
and a request with a seed draws from its generator only (one uniform per proposal of its own,
then the final token's noise), so a seeded request gives the same tokens whatever else is in
the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class Verified:
    """``tokens[r, :num_emitted[r]]``: the tokens request ``r`` emits this step (its accepted
    proposals, then one target token); ``num_accepted[r] = num_emitted[r] - 1`` proposals were
    accepted. Entries past ``num_emitted`` are -1."""

    tokens: torch.Tensor  # [R, K + 1] int64
    num_emitted: torch.Tensor  # [R] int64

    @property
    def num_accepted(self) -> torch.Tensor:
        return self.num_emitted - 1


def _accepted_prefix(accept: torch.Tensor, num_draft: torch.Tensor) -> torch.Tensor:
    """Per row, the number of leading True entries of ``accept`` [R, K] among its first
    ``num_draft`` columns."""
    k = accept.shape[1]
    within = torch.arange(k, device=accept.device) < num_draft.unsqueeze(1)
    run = (accept & within).to(torch.int64).cumprod(dim=1)
    return run.sum(dim=1)


def _emit(draft: torch.Tensor, accepted: torch.Tensor, final: torch.Tensor) -> Verified:
    """Accepted proposals, then ``final`` [R] (the correction or the bonus), padded with -1."""
    r, k = draft.shape
    cols = torch.arange(k + 1, device=draft.device).unsqueeze(0)
    padded = torch.cat([draft, torch.full((r, 1), -1, dtype=draft.dtype, device=draft.device)], 1)
    tokens = torch.where(cols < accepted.unsqueeze(1), padded, torch.full_like(padded, -1))
    tokens.scatter_(1, accepted.unsqueeze(1), final.unsqueeze(1))
    return Verified(tokens, accepted + 1)


def verify_greedy(
    target_argmax: torch.Tensor, draft: torch.Tensor, num_draft: torch.Tensor
) -> Verified:
    """``target_argmax`` [R, K + 1]: argmax of p_0 .. p_K per row (rows with fewer proposals:
    the first ``num_draft + 1`` columns count); ``draft`` [R, K] int64; ``num_draft`` [R]."""
    accepted = _accepted_prefix(target_argmax[:, :-1] == draft, num_draft)
    final = target_argmax.gather(1, accepted.unsqueeze(1)).squeeze(1)
    return _emit(draft, accepted, final)


def _noise(
    kind: str,
    shape: tuple[int, ...],
    device: torch.device,
    generators: dict[int, torch.Generator],
    lengths: Sequence[int] | None = None,
) -> torch.Tensor:
    """Uniform(0, 1) (``kind`` "uniform") or Exp(1) ("exponential") noise [R, ...]: rows in
    ``generators`` from their own generator (only ``lengths[row]`` values when given: what the
    row uses, not what the batch's widest row needs), the others from the global one."""
    x = torch.empty(shape, device=device)
    if len(generators) < shape[0]:
        getattr(x, f"{kind}_")()
    for row, gen in generators.items():
        getattr(x[row] if lengths is None else x[row, : lengths[row]], f"{kind}_")(generator=gen)
    return x


def verify_sampled(
    target_probs: torch.Tensor,
    draft: torch.Tensor,
    num_draft: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    generators: dict[int, torch.Generator] | None = None,
    num_draft_host: Sequence[int] | None = None,
) -> Verified:
    """``target_probs`` [R, K + 1, V] float32 (each row a distribution, already processed);
    ``draft`` [R, K] int64; ``num_draft`` [R]; ``draft_probs`` [R, K, V] (None: point masses
    on ``draft``, as n-gram proposals are); ``generators``: row -> seeded generator;
    ``num_draft_host``: ``num_draft`` on the host, for the seeded rows' draws (None: read from
    the device)."""
    generators = generators or {}
    if generators and num_draft_host is None:
        num_draft_host = num_draft.tolist()
    r, k1, v = target_probs.shape
    k = k1 - 1
    dev = target_probs.device
    p_draft = target_probs[:, :k].gather(2, draft.unsqueeze(2)).squeeze(2)  # p_j(d_j)
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
    else:
        q_draft = draft_probs.gather(2, draft.unsqueeze(2)).squeeze(2)
    u = _noise("uniform", (r, k), dev, generators, num_draft_host) if k else p_draft
    accept = u * q_draft < p_draft  # u < p / q without dividing by a zero q
    accepted = _accepted_prefix(accept, num_draft)

    # The distribution of the final token: the residual at a rejection, p_n after all n.
    at = accepted.view(r, 1, 1).expand(r, 1, v)
    p_final = target_probs.gather(1, at).squeeze(1)
    rejected = accepted < num_draft
    if k:
        if draft_probs is None:
            q_final = torch.zeros_like(p_final)
            q_final.scatter_(1, draft.gather(1, accepted.clamp(max=k - 1).unsqueeze(1)), 1.0)
        else:
            q_final = draft_probs.gather(1, at.clamp(max=k - 1)).squeeze(1)
        residual = (p_final - q_final).clamp_(min=0)
        # A residual of all zeros only arises from rounding when p == q (then a rejection has
        # probability zero); fall back to p there rather than divide by zero.
        empty = residual.sum(dim=1, keepdim=True) <= 0
        residual = torch.where(empty, p_final, residual)
        p_final = torch.where(rejected.unsqueeze(1), residual, p_final)
    noise = _noise("exponential", (r, v), dev, generators)
    final = (p_final / noise).argmax(dim=1)
    return _emit(draft, accepted, final)
