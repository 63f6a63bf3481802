"""The model runner's side of speculative decoding: which requests get proposals, and turning
the logits of a verification step into the tokens each request emits.

A request verifies its proposals ``d_1 .. d_k`` in a step that computes ``1 + k`` query tokens
(its last sampled token, then the proposals; causal within the request, as a chunk of prefill).
The hidden states at those ``k + 1`` positions give the target's distribution before each
proposal and after the last (``rejection.py``). The tokens emitted are appended to the
persistent batch here and reported as the step's sampled token (the last) plus the accepted
proposals before it; the scheduler counts only their KV as computed.

Which requests: those whose every sampling parameter the verification applies exactly —
temperature (greedy or not), top-k, top-p, min-p and a seed; logprobs of the emitted tokens are
the raw model's at each position, as without speculation. A request with penalties, a logit
bias, bad words, allowed token ids, a grammar, min_tokens still to reach or prompt logprobs (or
a pooling request) decodes one token a step as without speculation, so its output keeps its
meaning; those features are the next step of issue 34.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine_svc.core.request import Logprobs, Request
from engine_svc.core.sampling_params import GREEDY_EPS
from engine_svc.spec_decode.rejection import verify_greedy, verify_sampled
from engine_svc.worker.sampler import gather_logprobs, target_probs
from engine_svc.worker.sampling_inputs import sampling_metadata
from engine_svc.worker.uploads import upload

if TYPE_CHECKING:
    from engine_svc.worker.input_batch import InputBatch
    from engine_svc.worker.step_inputs import StepInputs


def eligible(request: Request) -> bool:
    """Whether proposals for ``request`` are verified exactly (see the module's docstring)."""
    p = request.sampling_params
    return (
        request.pooling_params is None
        and request.grammar is None
        and p.structured_output is None
        and p.presence_penalty == 0.0
        and p.frequency_penalty == 0.0
        and p.repetition_penalty == 1.0
        and not p.logit_bias
        and not p.bad_words_token_ids
        and p.allowed_token_ids is None
        and p.prompt_logprobs is None
        and len(request.output_token_ids) >= p.min_tokens
    )


def verify_step(
    step: StepInputs,
    spec: np.ndarray,
    hidden: torch.Tensor,
    batch: InputBatch,
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    generators: dict[str, torch.Generator],
    sampled: dict[str, int],
    accepted: dict[str, list[int]],
    logprobs: dict[str, list[Logprobs]],
) -> None:
    """Verify the proposals of the step's requests ``spec`` (indices into ``step.batch``):
    append what each emits to ``batch`` and report it in ``sampled`` (the last token),
    ``accepted`` (the accepted proposals before it) and, for a request that asks for them,
    ``logprobs`` (one per emitted token). One host sync, one more with logprobs."""
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
    draft_t, num_t = upload(drafts, dev), upload(num, dev)

    tokens = torch.empty((r, k + 1), dtype=torch.int64, device=dev)
    emitted = torch.empty(r, dtype=torch.int64, device=dev)
    greedy = batch.temperature[rows] < GREEDY_EPS
    for group, is_greedy in ((np.flatnonzero(greedy), True), (np.flatnonzero(~greedy), False)):
        if not group.size:
            continue
        at = upload(group, dev)
        if is_greedy:
            v = verify_greedy(logits.index_select(0, at).argmax(dim=-1), draft_t[at], num_t[at])
        else:
            group_reqs = [reqs[i] for i in group]
            md = sampling_metadata(
                batch, np.repeat(rows[group], k + 1),
                [q for q in group_reqs for _ in range(k + 1)], generators, vocab,
            )  # fmt: skip
            probs = target_probs(logits.index_select(0, at).view(-1, vocab), md)
            seeded = {
                j: generators[q.request_id]
                for j, q in enumerate(group_reqs)
                if q.request_id in generators
            }
            v = verify_sampled(
                probs.view(len(group), k + 1, vocab), draft_t[at], num_t[at], None, seeded
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
