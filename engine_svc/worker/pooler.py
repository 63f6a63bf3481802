"""Pooling rows of a step: hidden states -> one embedding, label scores or relevance score each.

A pooling request is prefill only. Its chunks arrive over one or more steps; in the step that
computes its last prompt token it is pooled::

    LAST   the state at its last prompt token (always computed: the prefix cache leaves it)
    MEAN   sum of every prompt position's state / prompt length; the sum is kept across
           chunked-prefill steps per request (such requests skip the prefix cache)
    CLS    the state at prompt position 0, kept from the request's first chunk

then, for embed: cut to ``dimensions`` and L2-normalized (unless ``normalize`` is False); for
classify / score: the classifier head (``score``) and softmax over the labels, or sigmoid for
one label (unless ``activation`` is False). The finishing rows' states are gathered with one
index op, the heads run on the batch, and the results cross to the host in one copy.

Where a request's tokens sit in the step's flattened batch (``StepInputs``)::

    entry i      tokens first[i] .. last_index[i]     first[i] = last_index[i] - num_tokens + 1
    positions    num_computed_tokens .. num_computed_tokens + num_tokens - 1

Tensor parallelism: every rank's hidden states are whole (the row-parallel layers all-reduce)
and the classifier head is replicated, so rank 0 pools alone and its results are the step's; a
worker's pooler returns nothing and keeps no state (pooling runs no collective).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F

from engine_svc.core.pooling_params import PoolingParams, PoolingType
from engine_svc.core.request import Request
from engine_svc.models.llama import LlamaForCausalLM
from engine_svc.worker.step_inputs import StepInputs
from engine_svc.worker.uploads import upload
from protos.types import PoolingTask

PooledResults = dict[str, npt.NDArray[np.float32]]


class Pooler:
    """Pools the finishing pooling rows of each step; keeps the MEAN sums and CLS states of
    requests whose prompt spans several steps, by request id."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        self.model = model
        self._pools = model.plan.tp.is_first  # a tensor-parallel worker's results are unused
        self._sums: dict[str, torch.Tensor] = {}  # MEAN: float32 [hidden] over positions so far
        self._first: dict[str, torch.Tensor] = {}  # CLS: float32 [hidden] at position 0

    def drop(self, request_id: str) -> None:
        """Forget a request's partial state (finished, aborted, or preempted: it starts over)."""
        self._sums.pop(request_id, None)
        self._first.pop(request_id, None)

    @property
    def num_partial(self) -> int:
        """Requests with state kept between steps (tests check nothing is left behind)."""
        return len(self._sums) + len(self._first)

    def pool(self, step: StepInputs, hidden: torch.Tensor, entries: np.ndarray) -> PooledResults:
        """Pool the pooling ``entries`` (indices into ``step.batch``) whose prompt ends in this
        step; keep partial state for the others. Returns request id -> float32 result."""
        if not self._pools:
            return {}
        reqs = [step.batch[i].request for i in entries]
        params = [_params(r) for r in reqs]
        num_tokens = np.fromiter((step.batch[i].num_tokens for i in entries), np.int64, len(reqs))
        last = step.last_index[entries]
        first = last - num_tokens + 1
        kinds = [p.pooling_type for p in params]
        dev = hidden.device

        mean = [j for j, k in enumerate(kinds) if k is PoolingType.MEAN]
        if mean:
            sums = _segment_sums(hidden, first[mean], num_tokens[mean])
            for row, j in enumerate(mean):
                rid = reqs[j].request_id
                prev = self._sums.get(rid)
                self._sums[rid] = sums[row] if prev is None else prev + sums[row]
        cls = [
            j
            for j, k in enumerate(kinds)
            if k is PoolingType.CLS and reqs[j].num_computed_tokens == 0
        ]
        if cls:
            states = hidden.index_select(0, _index(first[cls], dev)).float()
            for row, j in enumerate(cls):
                self._first[reqs[j].request_id] = states[row]

        done = [
            j
            for j, r in enumerate(reqs)
            if r.num_computed_tokens + int(num_tokens[j]) >= r.num_prompt_tokens
        ]
        if not done:
            return {}
        pooled = torch.empty(len(done), hidden.shape[-1], dtype=torch.float32, device=dev)
        at_last = [r for r, j in enumerate(done) if kinds[j] is PoolingType.LAST]
        if at_last:
            rows = hidden.index_select(0, _index(last[[done[r] for r in at_last]], dev))
            pooled[_index(np.asarray(at_last), dev)] = rows.float()
        for r, j in enumerate(done):
            rid = reqs[j].request_id
            if kinds[j] is PoolingType.MEAN:  # every position was computed: MEAN skips the cache
                pooled[r] = self._sums.pop(rid) / reqs[j].num_prompt_tokens
            elif kinds[j] is PoolingType.CLS:
                pooled[r] = self._first.pop(rid)
        return self._heads(pooled, [params[j] for j in done], [reqs[j] for j in done], hidden)

    def _heads(
        self,
        pooled: torch.Tensor,
        params: list[PoolingParams],
        reqs: list[Request],
        hidden: torch.Tensor,
    ) -> PooledResults:
        """Embed rows: cut, normalize. Classify / score rows: the classifier head, activation.
        One device -> host copy for the whole step."""
        parts: list[torch.Tensor | None] = [None] * len(params)
        embed = [r for r, p in enumerate(params) if p.task is PoolingTask.EMBED]
        if embed:
            vecs = pooled[_index(np.asarray(embed), pooled.device)]
            if all(params[r].dimensions is None for r in embed):
                normalized = F.normalize(vecs, dim=-1)
                for row, r in enumerate(embed):
                    parts[r] = normalized[row] if params[r].normalize else vecs[row]
            else:  # Matryoshka: cut first, then normalize what is left (as vLLM)
                for row, r in enumerate(embed):
                    vec = vecs[row, : params[r].dimensions]
                    parts[r] = F.normalize(vec, dim=-1) if params[r].normalize else vec
        labelled = [r for r, p in enumerate(params) if p.task is not PoolingTask.EMBED]
        if labelled:
            states = pooled[_index(np.asarray(labelled), pooled.device)]
            logits = self.model.classify(states.to(hidden.dtype)).float()
            if logits.shape[-1] == 1:
                activated = torch.sigmoid(logits)
            else:
                activated = torch.softmax(logits, dim=-1)
            for row, r in enumerate(labelled):
                parts[r] = activated[row] if params[r].activation else logits[row]
        done = [p for p in parts if p is not None]
        flat = torch.cat(done).cpu().numpy()  # the one host copy
        ends = np.cumsum([p.shape[0] for p in done])
        return {
            req.request_id: chunk
            for req, chunk in zip(reqs, np.split(flat, ends[:-1]), strict=True)
        }


def _segment_sums(hidden: torch.Tensor, starts: np.ndarray, counts: np.ndarray) -> torch.Tensor:
    """[len(starts), hidden] float32: the sum of ``hidden`` rows starts[i] .. starts[i] +
    counts[i] - 1 for each i, in one gather and one index_add."""
    offsets = np.zeros(len(counts), np.int64)
    np.cumsum(counts[:-1], out=offsets[1:])
    segment = np.repeat(np.arange(len(counts)), counts)
    token = starts[segment] + (np.arange(int(counts.sum())) - offsets[segment])
    dev = hidden.device
    sums = torch.zeros(len(counts), hidden.shape[-1], dtype=torch.float32, device=dev)
    return sums.index_add_(
        0, _index(segment, dev), hidden.index_select(0, _index(token, dev)).float()
    )


def _params(request: Request) -> PoolingParams:
    p = request.pooling_params
    assert p is not None and p.pooling_type is not None, "pooling row without resolved params"
    return p


def _index(values: np.ndarray, device: torch.device) -> torch.Tensor:
    return upload(np.asarray(values, dtype=np.int64), device)
