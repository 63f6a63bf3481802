"""The batched LoRA op: every token of a step gets its own adapter's delta, in one pass over the
batch (Punica's SGMV: segments of tokens that share an adapter, one pair of matmuls each).

The adapters on the device sit in ``S`` slots, stacked per adapted linear and zero-padded to
the largest rank ``R``. A fused linear (q/k/v, gate/up) has ``n`` shards: their A matrices sit
side by side along the rank axis (one shrink matmul for the fused input) and their B matrices
side by side along the output axis (one expand matmul per shard, into its columns)::

    a[slot]  [in, n * R]   = [A_q.T | A_k.T | A_v.T]     (each A_i.T zero-padded to R columns)
    b[slot]  [R, out]      = [B_q.T | B_k.T | B_v.T]     (zero-padded to R rows, scaling folded in)
    h = x[rows] @ a[slot]                                 [rows, n * R]
    y[rows, shard i] += h[:, i*R : (i+1)*R] @ b[slot][:, shard i]

A step's tokens are grouped once (``LoRAMapping.build``, on the host, from the per-token slot
indices; -1 is the base model): runs of consecutive tokens with the same slot are used in place
(x and y sliced, no copies). When the runs are many (decode rows of different adapters
interleaved), the adapter tokens are sorted by slot once, gathered, and the deltas scattered back
with one ``index_add_``. Steps without any adapter token build no mapping and cost nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

# More runs than this many per distinct slot: sort the tokens (one gather, one scatter) rather
# than slicing run by run (benchmarks/lora_ops.py measures the two).
SORT_RUNS_PER_SLOT = 2


@dataclass(frozen=True)
class LoRAMapping:
    """One step's tokens grouped by device slot, for :func:`add_lora`.

    ``segments`` are (slot, start, end): rows [start, end) of x when ``perm`` is None, else of
    ``x[perm]`` (the adapter tokens sorted by slot)."""

    segments: tuple[tuple[int, int, int], ...]
    perm: torch.Tensor | None
    num_tokens: int  # tokens of the step (rows of x)

    @classmethod
    def build(
        cls,
        token_slots: np.ndarray,
        device: torch.device,
        sort_runs_per_slot: int = SORT_RUNS_PER_SLOT,
    ) -> LoRAMapping | None:
        """Group the step's tokens by slot (``token_slots[i]``: slot of token i, -1: none).
        Returns None when no token uses an adapter: the model then skips LoRA entirely."""
        slots = np.asarray(token_slots, dtype=np.int64)
        n = int(slots.shape[0])
        used = slots >= 0
        if not used.any():
            return None
        # run boundaries: positions where the slot changes
        change = np.flatnonzero(np.diff(slots)) + 1
        starts = np.concatenate([[0], change])
        ends = np.concatenate([change, [n]])
        keep = slots[starts] >= 0
        starts, ends = starts[keep], ends[keep]
        num_slots = int(np.unique(slots[used]).size)
        if len(starts) <= sort_runs_per_slot * num_slots:
            segments = tuple(
                (int(slots[s]), int(s), int(e)) for s, e in zip(starts, ends, strict=True)
            )
            return cls(segments, None, n)
        rows = np.flatnonzero(used)
        order = rows[np.argsort(slots[rows], kind="stable")]
        sorted_slots = slots[order]
        bounds = np.flatnonzero(np.diff(sorted_slots)) + 1
        seg_starts = np.concatenate([[0], bounds])
        seg_ends = np.concatenate([bounds, [len(order)]])
        segments = tuple(
            (int(sorted_slots[s]), int(s), int(e))
            for s, e in zip(seg_starts, seg_ends, strict=True)
        )
        perm = torch.from_numpy(order).to(device, non_blocking=True)
        return cls(segments, perm, n)


def add_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    mapping: LoRAMapping,
    a: torch.Tensor,
    b: torch.Tensor,
    out_sizes: Sequence[int],
    live: Sequence[bool] | None = None,
) -> None:
    """``y[t] += x[t] @ A(t).T @ B(t).T`` for every token t with a slot, in place.

    y [T, out], x [T, in], a [S, in, n * R], b [S, R, out] (one dtype); ``out_sizes``: the n
    shards' widths (summing to out). ``live[slot]`` False: that slot's adapter leaves this
    linear alone (its tokens are skipped)."""
    segments = mapping.segments
    if live is not None:
        segments = tuple(seg for seg in segments if live[seg[0]])
        if not segments:
            return
    if mapping.perm is None:
        for slot, start, end in segments:
            _expand(y[start:end], torch.mm(x[start:end], a[slot]), b[slot], out_sizes)
        return
    xs = x.index_select(0, mapping.perm)
    delta = torch.zeros(xs.shape[0], y.shape[1], dtype=y.dtype, device=y.device)
    for slot, start, end in segments:
        _expand(delta[start:end], torch.mm(xs[start:end], a[slot]), b[slot], out_sizes)
    y.index_add_(0, mapping.perm, delta)


def _expand(y: torch.Tensor, h: torch.Tensor, b: torch.Tensor, out_sizes: Sequence[int]) -> None:
    """y[:, shard i] += h[:, rank block i] @ b[:, shard i]: one small matmul per shard (cheaper
    than one block-diagonal matmul, measured in benchmarks/lora_ops.py)."""
    if len(out_sizes) == 1:
        y.addmm_(h, b)
        return
    rank = b.shape[0]
    offset = 0
    for i, out in enumerate(out_sizes):
        y[:, offset : offset + out].addmm_(
            h[:, i * rank : (i + 1) * rank], b[:, offset : offset + out]
        )
        offset += out


def add_lora_gather(
    y: torch.Tensor,
    x: torch.Tensor,
    token_slots: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    out_sizes: Sequence[int],
) -> None:
    """The same as :func:`add_lora` by gathering every token's own A and B (Punica's BGMV):
    batched matmuls, no grouping, but [T, in, n * R] + [T, R, out] of gathered weights. Kept as
    the measured alternative and a second reference; ``token_slots`` [T] int64 on x's device."""
    used = token_slots >= 0
    idx = token_slots.clamp(min=0)
    h = torch.bmm(x.unsqueeze(1), a.index_select(0, idx))  # [T, 1, n * R]
    bt = b.index_select(0, idx)  # [T, R, out]
    rank = b.shape[1]
    delta = torch.empty_like(y)
    offset = 0
    for i, out in enumerate(out_sizes):
        hi = h[:, :, i * rank : (i + 1) * rank]
        delta[:, offset : offset + out] = torch.bmm(hi, bt[:, :, offset : offset + out]).squeeze(1)
        offset += out
    y.add_(delta * used.unsqueeze(1).to(delta.dtype))
