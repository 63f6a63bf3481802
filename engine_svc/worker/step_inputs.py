"""One step's model inputs, built from the persistent batch with vectorized numpy operations into
static buffers (the same device memory every step: what CUDA graph replay reads).

The flattened batch puts decodes first, then multi-token chunks::

    request     r0      r1      r2 (chunk of 4 after 8 cached)
    tokens      [a]     [b]     [c c c c]
    positions   [17]    [40]    [8 9 10 11]
    slot        block_table[row][pos // bs] * bs + pos % bs

A step of decodes only may be padded to a size bucket (the CUDA graph sizes): padding rows read
token 0 at position 0 over a one-token context (slot 0 of block 0, whoever holds it), and write
nowhere (slot -1); their outputs are never used.

A verification step (speculative decoding: every request computes its last token and its ``k``
proposals, ``1 + k`` tokens, and no prefill chunk is in the step) is attended as decodes: each of
its tokens is a row of its own over its request's block table, its context ending at itself, so
the attention is causal within the request as a chunk's would be, and the step is decode-only
(the same kernel per token as without speculation, and a captured CUDA graph of that many rows
replays it)::

    request     r0 (decode)    r1 (1 + 2 proposals, after 40 tokens)
    tokens      [a]            [b    d1   d2]
    rows        r0             r1   r1   r1          (block table of each: its request's)
    seq_lens    18             41   42   43

The requests' own bookkeeping (``batch``, ``rows``, ``last_index``) stays per request.

Within the decodes (and within the chunks), requests are grouped by LoRA adapter, so the tokens
of one adapter form runs the batched LoRA op slices in place; ``token_lora`` gives each token's
adapter id (0: none, padding included), None when no request of the step has one.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from engine_svc.core.scheduler import ScheduledRequest
from engine_svc.worker.input_batch import InputBatch
from kernels.attention_metadata import AttentionMetadata

_ALIGN = 16  # bytes: every region starts 16-byte aligned (vector loads, typed views)
_MAX_GRAPH_SIZE = 512  # default largest CUDA graph batch (vLLM's default cap)


def decode_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes a decode step is padded to: 1, 2, 4, 8, 16, 24, ... up to max_num_seqs."""
    sizes = [b for b in (1, 2, 4) if b < max_num_seqs]
    sizes += list(range(8, max_num_seqs, 8))
    return [*sizes, max_num_seqs]


def graph_sizes(max_num_seqs: int, requested: tuple[int, ...] | None) -> list[int]:
    """The decode batch sizes captured as CUDA graphs (and padded to), as vLLM reads
    ``--cuda-graph-sizes``: None, up to max_num_seqs (at most 512); one value, the buckets up to
    it; several, exactly those. Sizes above max_num_seqs are dropped: no step has more rows."""
    if requested is None:
        return decode_buckets(min(max_num_seqs, _MAX_GRAPH_SIZE))
    if len(requested) == 1:
        return decode_buckets(min(requested[0], max_num_seqs))
    return sorted({n for n in requested if n <= max_num_seqs})


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens] (padded) on the device, views of the static buffers
    positions: torch.Tensor
    meta: AttentionMetadata
    batch: list[ScheduledRequest]  # in row order of the flattened batch (decodes first)
    rows: np.ndarray  # persistent-batch row of each entry of ``batch``
    last_index: np.ndarray  # index of each request's last token in the flattened batch
    num_padded_reqs: int  # rows of padding after the real ones (0 unless padded)
    token_lora: np.ndarray | None = None  # [num_tokens] adapter id per token; None: no adapter

    @property
    def decode_only(self) -> bool:
        return self.meta.num_decodes == self.meta.num_reqs


_SMALL = (  # the per-token and per-request inputs, packed in this order at the arena's front
    ("input_ids", "int64", "tokens"),
    ("positions", "int64", "tokens"),
    ("slot_mapping", "int64", "tokens"),
    ("seq_lens", "int32", "reqs"),
    ("query_start_loc", "int32", "reqs+1"),
)
_TORCH = {"int64": torch.int64, "int32": torch.int32}
Region = tuple[str, int, str, int]  # name, byte offset, dtype name, length


@functools.lru_cache(maxsize=4096)
def _packed(num_tokens: int, num_reqs: int) -> tuple[tuple[Region, ...], int]:
    """Where each small input of a step of that shape lies, and the bytes they take together
    (cached: a step asks twice, and shapes repeat)."""
    count = {"tokens": num_tokens, "reqs": num_reqs, "reqs+1": num_reqs + 1}
    regions: list[Region] = []
    offset = 0
    for name, dtype, size in _SMALL:
        n = count[size]
        regions.append((name, offset, dtype, n))
        offset += -(-n * np.dtype(dtype).itemsize // _ALIGN) * _ALIGN
    return tuple(regions), offset


@dataclass(frozen=True)
class StepTensors:
    """Device views of one step's inputs: a step of the same shape (tokens, requests) always
    gets views of the same memory."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64; -1: written nowhere
    seq_lens: torch.Tensor  # [R] int32
    query_start_loc: torch.Tensor  # [R + 1] int32
    block_tables: torch.Tensor  # [R, max_blocks] int32, full rows

    def metadata(
        self, num_decodes: int, seq_lens: list[int], query_start_loc: list[int]
    ) -> AttentionMetadata:
        """The attention metadata over these views, with the host-side copies of the lengths
        and offsets (the real ones, or the bounds a CUDA graph is captured with)."""
        return AttentionMetadata(
            num_reqs=len(seq_lens),
            num_decodes=num_decodes,
            num_tokens=query_start_loc[-1],
            slot_mapping=self.slot_mapping,
            block_tables=self.block_tables,
            seq_lens=self.seq_lens,
            query_start_loc=self.query_start_loc,
            seq_lens_cpu=seq_lens,
            query_start_loc_cpu=query_start_loc,
            max_decode_seq_len=max(seq_lens[:num_decodes], default=0),
            max_seq_len=max(seq_lens),
        )


class StepBuffers:
    """The step's model inputs in one device arena, filled from pinned host memory by two
    non-blocking copies per step: the small inputs, packed for the step's shape, and the used
    rows of the block tables, which stay at one place::

        arena  | ids i64[T] | positions i64[T] | slots i64[T] | seq_lens i32[R] | qsl i32[R+1] | ...
               |<------------------ copy 1: packed for this step's T and R ------------------>|
               ... | block_tables i32[max_reqs, max_blocks] (fixed offset)                  |
                   |<- copy 2: rows [0, R) ->|

    A decode step of B rows (padded to a graph size) always has T = R = B, so the views a CUDA
    graph of size B was captured over are the ones each such step fills. Rows keep their full
    width, so entries past a request's blocks are stale ids of earlier steps (valid, never
    read). Two pinned host twins are filled in turn; a twin is written again only once the copy
    out of it has run (an event per twin, queried first: in steady state it has long finished).
    On the CPU the arena is host memory itself and nothing is copied.
    """

    def __init__(
        self, max_tokens: int, max_reqs: int, max_blocks: int, device: torch.device
    ) -> None:
        self.device = device
        self.max_tokens, self.max_reqs, self.max_blocks = max_tokens, max_reqs, max_blocks
        _, small = _packed(max_tokens, max_reqs)
        self._tables_at = small
        size = small + max_reqs * max_blocks * 4
        self._device = torch.zeros(size, dtype=torch.uint8, device=device)
        if device.type == "cuda":
            self._twins = [torch.zeros(size, dtype=torch.uint8, pin_memory=True) for _ in (0, 1)]
            # One event per twin, recorded after its copy (one never recorded queries True).
            self._fences: list[torch.cuda.Event | None] = [torch.cuda.Event(), torch.cuda.Event()]
        else:
            self._twins = [self._device]
            self._fences = [None]
        self._twin_arrays = [t.numpy() for t in self._twins]
        self._next = 0
        self.block_tables = self._tables(self._device)
        self._decode_views: dict[int, StepTensors] = {}

    def _tables(self, arena: torch.Tensor) -> torch.Tensor:
        rows = arena[self._tables_at :].view(torch.int32)
        return rows.view(self.max_reqs, self.max_blocks)

    def views(self, num_tokens: int, num_reqs: int) -> StepTensors:
        """The device views for a step of ``num_tokens`` tokens and ``num_reqs`` requests."""
        cached = self._decode_views.get(num_reqs) if num_tokens == num_reqs else None
        if cached is not None:
            return cached
        regions, _ = _packed(num_tokens, num_reqs)
        t = {
            name: self._device[off : off + n * np.dtype(dt).itemsize].view(_TORCH[dt])
            for name, off, dt, n in regions
        }
        views = StepTensors(**t, block_tables=self.block_tables[:num_reqs])
        if num_tokens == num_reqs:
            self._decode_views[num_reqs] = views
        return views

    def host(self, num_tokens: int, num_reqs: int) -> dict[str, np.ndarray]:
        """Numpy views of the host twin to fill for a step of this shape (waits only if the
        copy out of it, two steps ago, has not run yet)."""
        fence = self._fences[self._next]
        if fence is not None and not fence.query():
            fence.synchronize()
        raw = self._twin_arrays[self._next]
        regions, _ = _packed(num_tokens, num_reqs)
        h: dict[str, np.ndarray] = {
            name: raw[off : off + n * np.dtype(dt).itemsize].view(dt)
            for name, off, dt, n in regions
        }
        h["block_tables"] = raw[self._tables_at :].view(np.int32).reshape(self.max_reqs, -1)
        return h

    def commit(self, num_tokens: int, num_reqs: int) -> None:
        """Copy what the step filled to the device arena: the packed inputs and ``num_reqs``
        rows of the block tables. Non-blocking; on the CPU, nothing to do."""
        twin = self._twins[self._next]
        if twin is not self._device:
            _, small = _packed(num_tokens, num_reqs)
            self._device[:small].copy_(twin[:small], non_blocking=True)
            self._tables(self._device)[:num_reqs].copy_(
                self._tables(twin)[:num_reqs], non_blocking=True
            )
            fence = self._fences[self._next]
            assert fence is not None
            fence.record()
        self._next = (self._next + 1) % len(self._twins)


def build_step(
    scheduled: list[ScheduledRequest],
    batch: InputBatch,
    buffers: StepBuffers,
    block_size: int,
    buckets: list[int] | None,
    verifies: bool = False,
) -> StepInputs:
    """Flatten this step's scheduled requests into model inputs (see the module docstring).

    ``buckets``: pad a decode-only step to the next bucket size (None: never pad; a step larger
    than the largest bucket is not padded). ``verifies``: some request verifies proposals; a
    step of decodes and verifications only (that fits the buffers' rows) is then attended as
    one decode row per token.
    """
    # decodes first, then by adapter (runs for the LoRA op); stable otherwise
    ordered = sorted(scheduled, key=lambda s: (s.num_tokens != 1, s.request.lora_id))
    rows = np.fromiter(
        (batch.row_of[s.request.request_id] for s in ordered), np.int64, len(ordered)
    )
    num_new = np.fromiter((s.num_tokens for s in ordered), np.int64, len(ordered))
    computed = np.fromiter((s.request.num_computed_tokens for s in ordered), np.int64, len(ordered))
    num_reqs = len(ordered)
    num_decodes = int(np.count_nonzero(num_new == 1))
    cu = np.zeros(num_reqs + 1, dtype=np.int64)
    np.cumsum(num_new, out=cu[1:])
    total = int(cu[-1])
    # Token k of the flattened batch belongs to request req_of[k], at position pos[k].
    req_of = np.repeat(np.arange(num_reqs), num_new)
    pos = computed[req_of] + (np.arange(total) - cu[:-1][req_of])
    token_rows = rows[req_of]
    req_lora = batch.lora_id[rows]
    token_lora = req_lora[req_of] if req_lora.any() else None
    seq_lens = (computed + num_new).astype(np.int32)
    max_blocks = int(batch.num_blocks[rows].max())
    last_index = cu[1:] - 1

    # The attention's rows: the requests, or one per token for a verification step.
    attn_rows, attn_cu = rows, cu
    if verifies and total <= buffers.max_reqs and _decodes_and_verifications(ordered):
        attn_rows, attn_cu = token_rows, np.arange(total + 1, dtype=np.int64)
        seq_lens = (pos + 1).astype(np.int32)
        num_decodes = total
    num_rows = len(attn_rows)

    size = num_rows
    if buckets is not None and num_decodes == num_rows:
        size = next((b for b in buckets if b >= num_rows), num_rows)
    padded = size - num_rows

    if padded:
        attn_cu = np.concatenate([attn_cu, total + np.arange(1, padded + 1)])
        seq_lens = np.concatenate([seq_lens, np.ones(padded, np.int32)])
        if token_lora is not None:
            token_lora = np.concatenate([token_lora, np.zeros(padded, np.int64)])
    num_tokens = total + padded

    h = buffers.host(num_tokens, size)
    h["input_ids"][:total] = batch.token_ids[token_rows, pos]
    h["positions"][:total] = pos
    slots = h["slot_mapping"][:total]
    blocks = batch.block_table[token_rows, pos // block_size]
    np.multiply(blocks, block_size, out=slots, dtype=np.int64)
    slots += pos % block_size
    h["seq_lens"][:] = seq_lens
    h["query_start_loc"][:] = attn_cu
    h["block_tables"][:num_rows, :max_blocks] = batch.block_table[attn_rows, :max_blocks]
    if padded:
        h["input_ids"][total:] = 0
        h["positions"][total:] = 0
        h["slot_mapping"][total:] = -1  # written nowhere
        h["block_tables"][num_rows:size, 0] = 0  # read, never written
        num_decodes = size
    buffers.commit(num_tokens, size)

    views = buffers.views(num_tokens, size)
    meta = views.metadata(num_decodes, seq_lens.tolist(), attn_cu.tolist())
    return StepInputs(
        input_ids=views.input_ids,
        positions=views.positions,
        meta=meta,
        batch=ordered,
        rows=rows,
        last_index=last_index,
        num_padded_reqs=padded,
        token_lora=token_lora,
    )


def _decodes_and_verifications(ordered: list[ScheduledRequest]) -> bool:
    """Every request computes its last token and its proposals only (no prefill chunk)."""
    return all(s.num_tokens == 1 + len(s.spec_token_ids) for s in ordered)
