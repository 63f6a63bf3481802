"""A step's ``SamplingMetadata``, read from the persistent batch's per-row arrays.

Nothing here walks the whole vocabulary or the requests' token lists, and nothing makes the host
wait for the device: parameters are gathered by row from numpy arrays and uploaded without a
sync (``uploads``; an all-greedy batch needs none of them), penalties come from the batch's
device-side counts (kept up to date as tokens are sampled), allowed token ids from the batch's
device-side masks, and only the rows that need something special (a seed, min_tokens still to
reach, a logit bias, bad words, logprobs) are visited one by one.

Verification rows (speculative decoding, ``num_draft``): each request's logits come as ``k + 1``
rows, position j seeing the request's output followed by its first j proposals (which the runner
wrote into the batch's token array after its known tokens). Position-independent parameters
(temperature, top-k/p, min-p, logit bias, allowed ids) repeat over the positions; at position j
the penalties count those j proposals as output (the request's device-side counts are shared by
its positions, plus a few (row, token) corrections: ``ProposalCounts``), min_tokens counts them
in the output length, and bad words are matched against the output followed by them.
"""

from __future__ import annotations

import numpy as np
import torch

from engine_svc.core.request import Request
from engine_svc.core.sampling_params import GREEDY_EPS
from engine_svc.worker.input_batch import InputBatch
from engine_svc.worker.sampler import (
    AllowedTokens,
    LogitBias,
    Penalties,
    ProposalCounts,
    SamplingMetadata,
)
from engine_svc.worker.uploads import upload


def sampling_metadata(
    batch: InputBatch,
    rows: np.ndarray,
    reqs: list[Request],
    generators: dict[str, torch.Generator],
    vocab: int,
    num_draft: np.ndarray | None = None,
    positions: int | None = None,
) -> SamplingMetadata:
    """Metadata for the logits rows of ``reqs`` (persistent-batch ``rows``, in that order).
    ``generators`` holds each seeded request's generator (created here on first use).

    With ``num_draft`` (each request's number of proposals) the rows are a verification step's:
    ``positions`` (default ``num_draft.max() + 1``) consecutive logits rows per request, row j
    after ``min(j, num_draft)`` of its proposals (see the module's docstring)."""
    dev = batch.device

    def tensor(values: np.ndarray) -> torch.Tensor:
        return upload(values, dev)

    # Verification: every per-row parameter below is read for the expanded rows, position j of
    # request i at index i * k1 + j, with ``ahead`` proposals before it.
    req_rows, k1, ahead = rows, 1, None
    if num_draft is not None:
        k1 = int(num_draft.max()) + 1 if positions is None else positions
        ahead = np.minimum(np.arange(k1)[None, :], num_draft[:, None]).reshape(-1)
        rows = np.repeat(rows, k1)
        reqs = [q for q in reqs for _ in range(k1)]

    temperature = batch.temperature[rows]
    all_greedy = bool((temperature < GREEDY_EPS).all())
    md = SamplingMetadata(
        temperature=None if all_greedy else tensor(temperature),
        all_greedy=all_greedy,
        top_k=None,
        top_p=None,
        min_p=None,
        generators={},
    )
    if not all_greedy:
        top_k = batch.top_k[rows]
        if (top_k > 0).any():
            md.top_k = tensor(np.where(top_k > 0, top_k, vocab).astype(np.int64))
        top_p = batch.top_p[rows]
        if (top_p < 1.0).any():
            md.top_p = tensor(top_p)
        if md.top_k is not None or md.top_p is not None:
            # How many candidates the sampler keeps per row, known here without a device sync:
            # the largest top_k, or the whole vocabulary for a top_p row without one.
            limited = (top_k > 0) & (top_k < vocab)
            md.max_top_k = int(np.where(limited, top_k, np.where(top_p < 1.0, vocab, 0)).max())
        min_p = batch.min_p[rows]
        if (min_p > 0.0).any():
            md.min_p = tensor(min_p)
        for i in np.flatnonzero(temperature >= GREEDY_EPS):
            request = reqs[i]
            seed = request.sampling_params.seed
            if seed is None:
                continue
            gen = generators.get(request.request_id)
            if gen is None:
                gen = torch.Generator(device=dev)
                gen.manual_seed(seed % 2**64)
                generators[request.request_id] = gen
            md.generators[int(i)] = gen

    penalized_reqs = np.flatnonzero(batch.has_penalty[req_rows])
    penalized = penalized_reqs
    if k1 > 1:  # every position of those requests
        penalized = (penalized_reqs[:, None] * k1 + np.arange(k1)[None, :]).reshape(-1)
    if penalized.size:
        assert batch.output_counts is not None and batch.seen_mask is not None
        prows = req_rows[penalized_reqs]
        at = tensor(prows)
        md.penalties = Penalties(
            rows=tensor(penalized.astype(np.int64)),
            presence=tensor(batch.presence[prows]),
            frequency=tensor(batch.frequency[prows]),
            repetition=tensor(batch.repetition[prows]),
            output_counts=batch.output_counts.index_select(0, at),
            seen_mask=batch.seen_mask.index_select(0, at),
            positions=k1,
        )
        if num_draft is not None:
            md.penalties.ahead = _proposal_counts(batch, prows, num_draft[penalized_reqs], k1, dev)

    allowed = np.flatnonzero(batch.has_allowed[rows])
    if allowed.size:
        assert batch.allowed_mask is not None
        md.allowed = AllowedTokens(
            rows=tensor(allowed.astype(np.int64)),
            mask=batch.allowed_mask.index_select(0, tensor(rows[allowed])),
        )
    biased = np.flatnonzero(batch.has_bias[rows])
    if biased.size:
        entries = [e for i in biased if (e := batch.bias[rows[i]]) is not None]  # all of them
        md.logit_bias = LogitBias(
            rows=tensor(np.repeat(biased.astype(np.int64), [len(ids) for ids, _ in entries])),
            token_ids=tensor(np.concatenate([ids for ids, _ in entries])),
            values=tensor(np.concatenate([values for _, values in entries])),
        )

    # min_tokens: EOS and stop_token_ids are banned while the output is shorter. Not on rows with
    # a grammar: it alone decides when their text ends (once complete, only EOS is left to them).
    num_out = batch.num_tokens[rows] - batch.num_prompt_tokens[rows]
    if ahead is not None:
        num_out = num_out + ahead
    banned: dict[int, list[int]] = {}
    for i in np.flatnonzero((num_out < batch.min_tokens[rows]) & ~batch.has_grammar[rows]):
        request = reqs[i]
        p = request.sampling_params
        ids = list(p.stop_token_ids) + ([] if p.ignore_eos else list(request.eos_token_ids))
        ids = [t for t in ids if t < vocab]
        if ids:
            banned[int(i)] = ids
    for i in np.flatnonzero(batch.has_bad_words[rows]):
        row = int(rows[i])
        words = batch.bad_words[row]
        assert words is not None
        end = batch.num_tokens[row] + (0 if ahead is None else ahead[i])
        output = batch.token_ids[row, batch.num_prompt_tokens[row] : end]
        ids = bad_word_bans(words, output)
        if ids:
            banned.setdefault(int(i), []).extend(ids)
    md.banned = list(banned.items()) or None
    if allowed.size or biased.size or banned:
        # The rows the sampler adjusts (the union, sorted): all it copies out of the logits.
        adjusted = np.union1d(np.union1d(allowed, biased), penalized)
        md.adjusted_rows = tensor(np.union1d(adjusted, list(banned)).astype(np.int64))
    wanted = [r.sampling_params.logprobs for r in reqs if r.sampling_params.logprobs is not None]
    md.max_num_logprobs = max(wanted) if wanted else None
    return md


def _proposal_counts(
    batch: InputBatch, rows: np.ndarray, num_draft: np.ndarray, k1: int, dev: torch.device
) -> ProposalCounts | None:
    """How often each proposal occurs before each verification position of the requests in
    persistent-batch ``rows`` (penalised row ``i * k1 + j``: request i, position j)::

        proposals    d0 d1 d2           (num_draft 3, k1 4)
        position 0   -                  nothing before it: the request's own counts
        position 1   d0                 +1 at (1, d0)
        position 2   d0 d1              +1 at (2, d0), (2, d1)  (+2 at one entry when d0 == d1)
        position 3   d0 d1 d2
    """
    k = k1 - 1
    if k == 0:
        return None
    width = batch.token_ids.shape[1]
    cols = np.minimum(batch.num_tokens[rows][:, None] + np.arange(k)[None, :], width - 1)
    drafts = batch.token_ids[rows[:, None], cols].astype(np.int64)  # [P, k]
    pos, idx = np.arange(k1)[None, :, None], np.arange(k)[None, None, :]
    before = (idx < pos) & (idx < num_draft[:, None, None])  # [P, k1, k]: d_idx before pos
    req, at, which = np.nonzero(before)
    if not req.size:
        return None
    vocab = int(batch.vocab_size)
    key = (req * k1 + at) * vocab + drafts[req, which]
    unique, counts = np.unique(key, return_counts=True)
    return ProposalCounts(
        rows=upload(unique // vocab, dev),
        token_ids=upload(unique % vocab, dev),
        counts=upload(counts.astype(np.int32), dev),
    )


def bad_word_bans(words: list[tuple[list[int], int]], output: np.ndarray) -> list[int]:
    """The tokens that would complete a bad word after ``output`` (the tokens generated so far):
    each word's last token when the output ends with the rest of it (vLLM's rule)."""
    longest = max(len(prefix) for prefix, _ in words)
    tail = output[max(len(output) - longest, 0) :].tolist()
    return [
        last
        for prefix, last in words
        if len(prefix) <= len(tail) and tail[len(tail) - len(prefix) :] == prefix
    ]
