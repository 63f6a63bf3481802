"""The collectives the sharded model needs, each a no-op for a group of one.

    all_reduce        sum of every rank's partial result (row-parallel linears, the embedding)
    all_gather_last   every rank's slice of the last dim, concatenated in rank order (logits)
    min_over_ranks    the smallest of an integer each rank holds (KV blocks: what every rank fits)

At size 1 each returns its input untouched after one integer comparison: the single-process
model runs exactly the ops it ran before tensor parallelism existed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from engine_svc.distributed.parallel_state import TPGroup

# torch >= 2.13 names it all_gather_single (all_gather_into_tensor warns there)
_gather_dim0 = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_reduce(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Sum ``x`` over the group, in place; returns ``x``."""
    if tp.size == 1:
        return x
    dist.all_reduce(x, group=tp.group)
    return x


def all_gather_last(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """[..., n] on each rank -> [..., size * n], rank r's slice at columns [r * n, (r + 1) * n).

    One collective into a rank-major buffer, then one copy into the column layout::

        gathered  [size, rows, n]      (rank 0 rows | rank 1 rows | ...)
        result    [rows, size * n]     row i = rank 0's row i | rank 1's row i | ...
    """
    if tp.size == 1:
        return x
    x = x.contiguous()
    flat = x.view(-1, x.shape[-1])
    gathered = x.new_empty((tp.size * flat.shape[0], flat.shape[1]))  # ranks along dim 0
    _gather_dim0(gathered, flat, group=tp.group)
    columns = gathered.view(tp.size, *flat.shape).movedim(0, 1)
    return columns.reshape(*x.shape[:-1], tp.size * x.shape[-1])


def min_over_ranks(value: int, tp: TPGroup, device: torch.device) -> int:
    """The smallest ``value`` of the group's ranks (NCCL needs ``device`` to be the rank's GPU)."""
    if tp.size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=tp.group)
    return int(t.item())
