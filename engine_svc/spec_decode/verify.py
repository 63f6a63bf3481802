"""The model runner's side of speculative decoding: which requests get proposals, and turning
the logits of a verification step into the tokens each request emits.

A request verifies its proposals ``d_1 .. d_k`` in a step that computes ``1 + k`` query tokens
(its last sampled token, then the proposals; causal within the request, as a chunk of prefill).
The hidden states at those ``k + 1`` positions give the target's distribution before each
proposal and after the last (``rejection.py``). The tokens emitted are appended to the
persistent batch here and reported as the step's sampled token (the last) plus the accepted
proposals before it; the scheduler counts only their KV as computed.

Every sampling feature keeps its meaning: each of the ``k + 1`` positions is sampled from (or,
greedy, takes the argmax of) exactly what decoding without speculation would use there, given
that the proposals before it were accepted (as vLLM's rejection sampler applies its sampling
metadata per position)::

    position            0           1              2                 ...   k
    output seen         out         out d1         out d1 d2               out d1 .. dk
    grammar mask        matcher     matcher + d1   matcher + d1 d2   (up to the first refused)

- position-independent, repeated over the positions: temperature, top-k, top-p, min-p, a seed,
  logit bias, allowed token ids;
- position-dependent (``sampling_inputs`` with ``num_draft``): repetition, frequency and
  presence penalties count the proposals before the position as output; min_tokens bans stop
  ids and EOS while the output with them is shorter; bad words match the output with them;
- a grammar (structured outputs): each position is masked with what the matcher allows after
  the proposals before it (``GrammarBitmask.apply_ahead``: advanced, then rolled back); the
  positions after the first proposal it refuses are never reached, and that proposal is
  masked out where it stands, so it is rejected. The scheduler advances the matcher over the
  emitted tokens only.

Logprobs of the emitted tokens are the model's at each position (after the grammar's mask, as
without speculation). Prompt logprobs come from the prefill, which never verifies. Only pooling
requests get no proposals (they never sample).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine_svc.core.request import Logprobs, Request
from engine_svc.core.sampling_params import GREEDY_EPS
from engine_svc.spec_decode.draft_model import stack_draft_probs
from engine_svc.spec_decode.rejection import verify_greedy, verify_sampled
from engine_svc.worker.sampler import gather_logprobs, greedy_tokens, target_probs
from engine_svc.worker.sampling_inputs import sampling_metadata
from engine_svc.worker.uploads import upload

if TYPE_CHECKING:
    from engine_svc.structured_output.bitmask import GrammarBitmask
    from engine_svc.worker.input_batch import InputBatch
    from engine_svc.worker.step_inputs import StepInputs


def eligible(request: Request) -> bool:
    """Whether proposals for ``request`` are verified exactly (see the module's docstring)."""
    return request.pooling_params is None


def verify_step(
    step: StepInputs,
    spec: np.ndarray,
    hidden: torch.Tensor,
    batch: InputBatch,
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    grammar_bitmask: GrammarBitmask,
    generators: dict[str, torch.Generator],
    sampled: dict[str, int],
    accepted: dict[str, list[int]],
    logprobs: dict[str, list[Logprobs]],
    draft_probs: dict[str, torch.Tensor] | None = None,
) -> None:
    """Verify the proposals of the step's requests ``spec`` (indices into ``step.batch``):
    append what each emits to ``batch`` and report it in ``sampled`` (the last token),
    ``accepted`` (the accepted proposals before it) and, for a request that asks for them,
    ``logprobs`` (one per emitted token). One host sync, one more with logprobs. A request with
    a grammar has its positions masked in ``logits`` first (``grammar_bitmask``).
    ``draft_probs``: a draft model's q of each sampled request's proposals (None: point
    masses, as n-gram proposals are)."""
    subs = [step.batch[i] for i in spec]
    reqs = [s.request for s in subs]
    rows = step.rows[spec]
    num = np.array([len(s.spec_token_ids) for s in subs], dtype=np.int64)
    r, k = len(subs), int(num.max())
    # Hidden rows of each request's k + 1 positions (its last 1 + num tokens; padding repeats
    # the last position, whose columns past ``num`` the verification ignores).
    last = step.last_index[spec].astype(np.int64)
    cols = np.minimum(np.arange(k + 1)[None, :], num[:, None])
    index = last[:, None] - num[:, None] + cols
    dev = hidden.device
    logits = compute_logits(hidden.index_select(0, upload(index.reshape(-1), dev)))
    vocab = logits.shape[-1]
    logits = logits.view(r, k + 1, vocab)
    drafts = np.zeros((r, k), dtype=np.int64)
    for i, s in enumerate(subs):
        drafts[i, : num[i]] = s.spec_token_ids
    constrained = [
        (i, g, subs[i].spec_token_ids) for i, q in enumerate(reqs) if (g := q.grammar) is not None
    ]
    if constrained:  # in place, before anything reads the logits (logprobs included)
        flat = logits.view(r * (k + 1), vocab)
        reached = grammar_bitmask.apply_ahead(flat, k + 1, constrained)
        for (i, _, _), m in zip(constrained, reached, strict=True):
            # The first proposal the grammar refuses stays, masked out of its row: rejected
            # (the residual a draft's q calls for is drawn there); those after are not reached.
            num[i] = min(num[i], m + 1)
    draft_t, num_t = upload(drafts, dev), upload(num, dev)

    tokens = torch.empty((r, k + 1), dtype=torch.int64, device=dev)
    emitted = torch.empty(r, dtype=torch.int64, device=dev)
    greedy = batch.temperature[rows] < GREEDY_EPS
    for group, is_greedy in ((np.flatnonzero(greedy), True), (np.flatnonzero(~greedy), False)):
        if not group.size:
            continue
        at = upload(group, dev)
        group_reqs = [reqs[i] for i in group]
        # Each position's parameters, penalties and bans given the proposals before it.
        md = sampling_metadata(batch, rows[group], group_reqs, generators, vocab, num[group], k + 1)
        group_logits = logits.index_select(0, at).view(-1, vocab)
        if is_greedy:
            argmax = greedy_tokens(group_logits, md).view(len(group), k + 1)
            v = verify_greedy(argmax, draft_t[at], num_t[at])
        else:
            probs = target_probs(group_logits, md)
            seeded = {
                j: generators[q.request_id]
                for j, q in enumerate(group_reqs)
                if q.request_id in generators
            }
            q = None
            if draft_probs:
                ids = [r.request_id for r in group_reqs]
                q = stack_draft_probs(draft_probs, ids, num[group], k, vocab)
            v = verify_sampled(
                probs.view(len(group), k + 1, vocab),
                draft_t[at],
                num_t[at],
                q,
                seeded,
                num[group].tolist(),
            )
        tokens[at] = v.tokens
        emitted[at] = v.num_emitted

    host_tokens, host_emitted = tokens.tolist(), emitted.tolist()  # the sync
    for j in range(max(host_emitted)):
        which = [i for i in range(r) if host_emitted[i] > j]
        batch.append_sampled(
            [int(rows[i]) for i in which],
            [host_tokens[i][j] for i in which],
            tokens[upload(np.asarray(which, dtype=np.int64), dev), j],
        )
    for i, q in enumerate(reqs):
        n = host_emitted[i]
        sampled[q.request_id] = host_tokens[i][n - 1]
        accepted[q.request_id] = host_tokens[i][: n - 1]
        top = q.sampling_params.logprobs
        if top is not None:  # the raw model's, at each emitted token's position
            raw = torch.log_softmax(logits[i, :n].float(), dim=-1)
            chosen = upload(np.asarray(host_tokens[i][:n], dtype=np.int64), dev)
            lp, ranks, top_ids, top_lp = (t.tolist() for t in gather_logprobs(raw, chosen, top))
            logprobs[q.request_id] = [
                Logprobs(
                    host_tokens[i][j],
                    lp[j],
                    ranks[j],
                    dict(zip(top_ids[j], top_lp[j], strict=True)),
                )
                for j in range(n)
            ]
