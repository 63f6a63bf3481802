"""One step's model inputs, built from the persistent batch with vectorized numpy operations and
copied into static buffers (the same memory every step: what CUDA graph replay needs).

The flattened batch puts decodes first, then multi-token chunks::

    request     r0      r1      r2 (chunk of 4 after 8 cached)
    tokens      [a]     [b]     [c c c c]
    positions   [17]    [40]    [8 9 10 11]
    slot        block_table[row][pos // bs] * bs + pos % bs

A step of decodes only may be padded to a size bucket (1, 2, 4, then multiples of 8): padding
rows read token 0 at position 0 over a one-token context, and write nowhere (slot -1); their
outputs are never used.

Within the decodes (and within the chunks), requests are grouped by LoRA adapter, so the tokens
of one adapter form runs the batched LoRA op slices in place; ``token_lora`` gives each token's
adapter id (0: none, padding included), None when no request of the step has one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine_svc.core.scheduler import ScheduledRequest
from engine_svc.worker.input_batch import InputBatch
from kernels.attention_metadata import AttentionMetadata


def decode_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes a decode step is padded to: 1, 2, 4, 8, 16, 24, ... up to max_num_seqs."""
    sizes = [b for b in (1, 2, 4) if b < max_num_seqs]
    sizes += list(range(8, max_num_seqs, 8))
    return [*sizes, max_num_seqs]


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


class StepBuffers:
    """Preallocated device tensors the step inputs are copied into."""

    def __init__(
        self, max_tokens: int, max_reqs: int, max_blocks: int, device: torch.device
    ) -> None:
        def make(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        self.input_ids = make(max_tokens, dtype=torch.int64)
        self.positions = make(max_tokens, dtype=torch.int64)
        self.slot_mapping = make(max_tokens, dtype=torch.int64)
        self.seq_lens = make(max_reqs, dtype=torch.int32)
        self.query_start_loc = make(max_reqs + 1, dtype=torch.int32)
        self.block_tables = make(max_reqs, max_blocks, dtype=torch.int32)


def _fill(buf: torch.Tensor, values: np.ndarray) -> torch.Tensor:
    """Copy ``values`` into the front of ``buf``; return that view."""
    n = values.shape[0]
    view = buf[:n] if values.ndim == 1 else buf[:n, : values.shape[1]]
    view.copy_(torch.from_numpy(values), non_blocking=True)
    return view


def build_step(
    scheduled: list[ScheduledRequest],
    batch: InputBatch,
    buffers: StepBuffers,
    block_size: int,
    buckets: list[int] | None,
) -> StepInputs:
    """Flatten this step's scheduled requests into model inputs (see the module docstring).

    ``buckets``: pad a decode-only step to the next bucket size (None: never pad).
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
    input_ids = batch.token_ids[token_rows, pos].astype(np.int64)
    slots = batch.block_table[token_rows, pos // block_size].astype(np.int64) * block_size
    slots += pos % block_size
    req_lora = batch.lora_id[rows]
    token_lora = req_lora[req_of] if req_lora.any() else None
    seq_lens = (computed + num_new).astype(np.int32)
    max_blocks = int(batch.num_blocks[rows].max())
    tables = batch.block_table[rows, :max_blocks]

    padded = 0
    if buckets is not None and num_decodes == num_reqs:
        size = next((b for b in buckets if b >= num_reqs), num_reqs)
        padded = size - num_reqs
        if padded:
            input_ids = np.concatenate([input_ids, np.zeros(padded, np.int64)])
            pos = np.concatenate([pos, np.zeros(padded, np.int64)])
            slots = np.concatenate([slots, np.full(padded, -1, np.int64)])  # written nowhere
            seq_lens = np.concatenate([seq_lens, np.ones(padded, np.int32)])
            tables = np.concatenate([tables, np.zeros((padded, max_blocks), np.int32)])
            cu = np.concatenate([cu, cu[-1] + np.arange(1, padded + 1)])
            if token_lora is not None:
                token_lora = np.concatenate([token_lora, np.zeros(padded, np.int64)])
            num_reqs = num_decodes = size
            total = size

    meta = AttentionMetadata(
        num_reqs=num_reqs,
        num_decodes=num_decodes,
        num_tokens=total,
        slot_mapping=_fill(buffers.slot_mapping, slots),
        block_tables=_fill(buffers.block_tables, np.ascontiguousarray(tables)),
        seq_lens=_fill(buffers.seq_lens, seq_lens),
        query_start_loc=_fill(buffers.query_start_loc, cu.astype(np.int32)),
        seq_lens_cpu=seq_lens.tolist(),
        query_start_loc_cpu=cu.tolist(),
        max_decode_seq_len=int(seq_lens[:num_decodes].max(initial=0)),
        max_seq_len=int(seq_lens.max()),
    )
    return StepInputs(
        input_ids=_fill(buffers.input_ids, input_ids),
        positions=_fill(buffers.positions, pos),
        meta=meta,
        batch=ordered,
        rows=rows,
        last_index=cu[1 : len(ordered) + 1] - 1,
        num_padded_reqs=padded,
        token_lora=token_lora,
    )
