"""Draft-model proposals: a small model of the target's vocabulary guesses the next k tokens.

vLLM's draft-model proposer (``--speculative-config '{"model": PATH,
"num_speculative_tokens": k}'``). The draft is loaded with our own model code on the target's
device and dtype. Its KV cache is its own tensors (its layers, its heads) laid out over the
target's blocks: the same block ids, block tables and slot mapping, so the KV manager and the
scheduler know nothing of it beyond ``num_lookahead_tokens`` (k slots past a request's last
token, which the draft's proposals write), and the KV budget counts both caches per block.

Each step, after the target's, the draft catches up and proposes. A request whose step
computed positions ``c ..`` and emitted tokens (its sampled token, with any accepted
proposals before it) has its context known up to ``N - 1``::

    position    c ........ N-2   N-1         N     N+1 ... N+k-2
    target      committed        new token
    draft       catch-up: one forward over [c, N)  d_1 -> d_2 ... -> d_k  (one token a step)
    KV          draft's written at every position, rejected ones written over next step

The catch-up runs over every row of the step (a partial prefill chunk too: no proposal then),
so the draft's committed KV always covers the target's, prefix-cache hits included (a cached
block's draft KV was written by the request that computed it). The logits at ``N - 1`` give
``d_1``; ``k - 1`` single-token steps give the rest. Greedy requests take the argmax; sampled
ones draw from the draft's distribution under their own temperature, top-k, top-p and min-p
(``q``, kept until the next step verifies the proposals by rejection sampling: any ``q``
leaves the target's distribution unchanged, a closer one accepts more).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine_svc.core.request import Request
from engine_svc.core.sampling_params import GREEDY_EPS
from engine_svc.models.llama import DecoderSpec, KVCache, LlamaForCausalLM
from engine_svc.models.loader import architecture_of, load_model, read_hf_config
from engine_svc.spec_decode.config import DraftModelConfig
from engine_svc.worker.sampler import target_probs
from engine_svc.worker.sampling_inputs import sampling_metadata
from engine_svc.worker.uploads import upload
from kernels.attention_backends import DecodeShape, select_kernels
from kernels.attention_metadata import AttentionMetadata

if TYPE_CHECKING:
    from engine_svc.core.scheduler import ScheduledRequest
    from engine_svc.worker.input_batch import InputBatch


@dataclass
class _CaughtUp:
    """The last catch-up's hidden state at each emitting row's new token (``N - 1``)."""

    index: dict[str, int]  # request id -> row of ``hidden``
    hidden: torch.Tensor  # [rows, hidden_size]


class DraftModel:
    """The draft model, its KV cache over the target's blocks, and its proposals."""

    def __init__(
        self,
        config: DraftModelConfig,
        target: DecoderSpec,
        dtype: torch.dtype,
        device: torch.device,
        max_model_len: int,
        block_size: int,
        attention_backend: str,
        max_num_seqs: int,
        cache_dir: Path,
    ) -> None:
        """Load the draft; ValueError when it cannot serve as one (another vocabulary)."""
        self.config = config
        self.k = config.num_speculative_tokens
        self.device, self.dtype, self.block_size = device, dtype, block_size
        self.max_model_len = max_model_len
        hf = read_hf_config(config.model)
        spec = DecoderSpec.from_hf_config(hf, architecture_of(hf))
        if spec.vocab_size != target.vocab_size:
            raise ValueError(
                f"the draft model {config.model} has vocab_size {spec.vocab_size}, the target "
                f"{target.vocab_size}: a draft must share the target's tokenizer and vocabulary"
            )
        shape = DecodeShape(spec.num_heads, spec.num_kv_heads, max_model_len, max_num_seqs)
        kernels = select_kernels(
            attention_backend, device, dtype, spec.head_dim, block_size, cache_dir, shape
        )
        self.model: LlamaForCausalLM = load_model(
            config.model, dtype, device, max_model_len, kernels
        )
        if self.model.lm_head is None:
            raise ValueError(f"the draft model {config.model} has no language-model head")
        self.spec = spec
        self.kv_caches: list[KVCache] = []
        # Sampled requests' proposal distributions [num proposals, vocab] float32, kept until
        # the step that verifies them (request id -> q).
        self.probs: dict[str, torch.Tensor] = {}
        self._caught_up: _CaughtUp | None = None

    # ------------------------------------------------------------------ the KV cache
    @property
    def bytes_per_block(self) -> int:
        """The draft's K and V of one block, over all its layers (added to the target's)."""
        s = self.spec
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * s.num_layers * self.block_size * s.num_kv_heads * s.head_dim * elem

    def allocate_kv(self, num_blocks: int) -> None:
        """Zeroed ``[num_blocks, block_size, kv_heads, head_dim]`` K and V per draft layer:
        block ids are the target's."""
        shape = (num_blocks, self.block_size, self.spec.num_kv_heads, self.spec.head_dim)
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.zeros(shape, dtype=self.dtype, device=self.device),
            )
            for _ in range(self.spec.num_layers)
        ]

    def free_kv(self) -> None:
        self.kv_caches = []
        self.probs.clear()
        self._caught_up = None

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for kv in self.kv_caches for t in kv)

    def drop(self, request_id: str) -> None:
        """A request left the batch (finished or preempted): forget its proposals' q."""
        self.probs.pop(request_id, None)

    # ------------------------------------------------------------------ after the target's step
    @torch.inference_mode()
    def catch_up(
        self,
        scheduled: list[ScheduledRequest],
        rows: np.ndarray,
        batch: InputBatch,
        emitted: dict[str, int],
    ) -> None:
        """Run the draft over what the target's step committed for each of its rows (``rows``:
        their persistent-batch rows; ``batch`` already holds the emitted tokens), writing its
        KV at the same slots; for a row in ``emitted`` up to and including its new token. Call
        before the scheduler's update (``num_computed_tokens`` is still the step's start)."""
        self._caught_up = None
        if not scheduled:
            return
        starts = np.fromiter(
            (s.request.num_computed_tokens for s in scheduled), np.int64, len(scheduled)
        )
        chunk = np.fromiter((s.num_tokens for s in scheduled), np.int64, len(scheduled))
        emits = np.fromiter((s.request.request_id in emitted for s in scheduled), bool)
        ends = np.where(emits, batch.num_tokens[rows], starts + chunk)
        # Never past the row's slots: a request that reached the context bound has none for
        # its new token (it finishes; no proposal).
        ends = np.minimum(ends, batch.num_blocks[rows].astype(np.int64) * self.block_size)
        emits &= ends == batch.num_tokens[rows]
        order, last, hidden = self._forward(batch, rows, starts, ends - starts, None)
        at = np.flatnonzero(emits[order])
        if at.size:
            ids = [scheduled[order[i]].request.request_id for i in at]
            picked = hidden.index_select(0, upload(last[at], self.device))
            self._caught_up = _CaughtUp({rid: i for i, rid in enumerate(ids)}, picked)

    @torch.inference_mode()
    def propose(
        self,
        requests: list[Request],
        batch: InputBatch,
        generators: dict[str, torch.Generator],
    ) -> list[list[int]]:
        """Up to k proposals for each of ``requests`` (rows of the last catch-up that go on):
        as many as the context length and max_tokens leave room to verify. One host sync."""
        for r in requests:
            self.probs.pop(r.request_id, None)
        caught = self._caught_up
        out: list[list[int]] = [[] for _ in requests]
        if caught is None:
            return out
        which = [
            i
            for i, r in enumerate(requests)
            if r.request_id in caught.index and r.request_id in batch.row_of
        ]
        reqs = [requests[i] for i in which]
        rows = np.fromiter((batch.row_of[r.request_id] for r in reqs), np.int64, len(reqs))
        n = batch.num_tokens[rows].astype(np.int64)  # the new token is at n - 1
        room = np.fromiter(
            (r.max_tokens - len(r.output_token_ids) - 1 for r in reqs), np.int64, len(reqs)
        )
        # d_j's KV goes at n + j - 2 (j >= 2): within the row's slots (k lookahead ones).
        slots = batch.num_blocks[rows].astype(np.int64) * self.block_size - n + 1
        num = np.minimum(np.minimum(self.k, self.max_model_len - n), np.minimum(room, slots))
        keep = np.flatnonzero(num > 0)
        if not keep.size:
            return out
        reqs, rows, n, num = [reqs[i] for i in keep], rows[keep], n[keep], num[keep]
        index = [caught.index[r.request_id] for r in reqs]
        hidden = caught.hidden.index_select(0, upload(np.asarray(index, np.int64), self.device))
        greedy = batch.temperature[rows] < GREEDY_EPS
        tokens = torch.empty((len(reqs), int(num.max())), dtype=torch.int64, device=self.device)
        probs: list[list[torch.Tensor]] = [[] for _ in reqs]
        alive = np.arange(len(reqs))
        for j in range(int(num.max())):
            if j:  # d_j in at position n + j - 1 (its KV in a lookahead slot), d_{j+1} out
                alive = alive[num[alive] > j]
                at = upload(alive, self.device)
                ids = tokens[:, j - 1].index_select(0, at)
                pos = n[alive] + j - 1
                _, _, hidden = self._forward(batch, rows[alive], pos, np.ones_like(pos), ids)
            drawn, q = self._draw(
                self.model.compute_logits(hidden), rows[alive], [reqs[i] for i in alive],
                greedy[alive], batch, generators,
            )  # fmt: skip
            tokens[upload(alive, self.device), j] = drawn
            if q is not None:
                for i, qi in zip(alive[~greedy[alive]].tolist(), q, strict=True):
                    probs[i].append(qi)
        host = tokens.tolist()  # the sync
        for j, i in enumerate(keep.tolist()):
            out[which[i]] = host[j][: int(num[j])]
            if probs[j]:
                self.probs[reqs[j].request_id] = torch.stack(probs[j])
        return out

    # ------------------------------------------------------------------ pieces
    def _forward(
        self,
        batch: InputBatch,
        rows: np.ndarray,
        starts: np.ndarray,
        counts: np.ndarray,
        ids: torch.Tensor | None,
    ) -> tuple[np.ndarray, np.ndarray, torch.Tensor]:
        """The draft over ``counts[i]`` tokens of row ``rows[i]`` from position ``starts[i]``
        (their ids from the batch, or ``ids``: one per row), decodes first as the attention
        wants them. (order of the rows, index of each row's last token, hidden states)::

            slot of position p = block_table[row][p // block_size] * block_size + p % bs
        """
        order = np.argsort(counts != 1, kind="stable")
        rows, starts, counts = rows[order], starts[order], counts[order]
        cu = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(counts, out=cu[1:])
        req_of = np.repeat(np.arange(len(rows)), counts)
        pos = starts[req_of] + (np.arange(int(cu[-1])) - cu[:-1][req_of])
        token_rows = rows[req_of]
        bs = self.block_size
        slots = batch.block_table[token_rows, pos // bs].astype(np.int64) * bs + pos % bs
        seq_lens = (starts + counts).astype(np.int32)
        num_decodes = int(np.count_nonzero(counts == 1))
        tables = batch.block_table[rows, : -(-int(seq_lens.max()) // bs)]
        dev = self.device
        meta = AttentionMetadata(
            num_reqs=len(rows),
            num_decodes=num_decodes,
            num_tokens=int(cu[-1]),
            slot_mapping=upload(slots, dev),
            block_tables=upload(tables, dev),
            seq_lens=upload(seq_lens, dev),
            query_start_loc=upload(cu.astype(np.int32), dev),
            seq_lens_cpu=seq_lens.tolist(),
            query_start_loc_cpu=cu.tolist(),
            max_decode_seq_len=int(seq_lens[:num_decodes].max(initial=0)),
            max_seq_len=int(seq_lens.max()),
        )
        if ids is None:
            ids = upload(batch.token_ids[token_rows, pos].astype(np.int64), dev)
        hidden = self.model(ids, upload(pos, dev), self.kv_caches, meta)
        return order, cu[1:] - 1, hidden

    def _draw(
        self,
        logits: torch.Tensor,
        rows: np.ndarray,
        reqs: list[Request],
        greedy: np.ndarray,
        batch: InputBatch,
        generators: dict[str, torch.Generator],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One proposal per row: the argmax for greedy rows; for the others a draw from the
        draft's distribution under the request's sampling parameters, with that distribution
        (the sampled rows' q, in row order)."""
        tokens = logits.argmax(dim=-1)
        sampled = np.flatnonzero(~greedy)
        if not sampled.size:
            return tokens, None
        at = upload(sampled, self.device)
        md = sampling_metadata(
            batch, rows[sampled], [reqs[i] for i in sampled], generators, logits.shape[-1]
        )
        q = target_probs(logits.index_select(0, at), md)
        noise = torch.empty_like(q)
        if len(md.generators) < q.shape[0]:
            noise.exponential_()
        for row, gen in md.generators.items():  # a seeded request draws from its own stream
            noise[row].exponential_(generator=gen)
        tokens.index_copy_(0, at, (q / noise).argmax(dim=-1))
        return tokens, q


def stack_draft_probs(
    probs: dict[str, torch.Tensor], request_ids: list[str], num: np.ndarray, k: int, vocab: int
) -> torch.Tensor | None:
    """``[len(request_ids), k, vocab]``: each request's q of the proposals it verifies (rows
    past ``num`` zero, never read); None when none of them has q (n-gram proposals)."""
    if not any(rid in probs for rid in request_ids):
        return None
    first = next(iter(probs.values()))
    out = torch.zeros((len(request_ids), k, vocab), dtype=torch.float32, device=first.device)
    for i, rid in enumerate(request_ids):
        q = probs.get(rid)
        if q is not None:
            n = min(int(num[i]), q.shape[0])
            out[i, :n] = q[:n]
    return out
