"""The tensor-parallel group a process belongs to, set up once over torch.distributed.

One engine shards its model over ``size`` processes, one per device (gloo on the CPU, NCCL on
CUDA). Every process builds its layers from the same :class:`TPGroup`, passed down explicitly:
nothing here keeps state of its own beyond what torch.distributed holds, and a model built with
:data:`SINGLE` (the default) never touches torch.distributed at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    """This process's place in its tensor-parallel group: ``rank`` of ``size``. ``group``: the
    torch.distributed process group (None: the default, whole-world group)."""

    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} of a group of {self.size}: out of range")

    @property
    def is_first(self) -> bool:
        """Rank 0: the one whose sampled tokens the engine reads."""
        return self.rank == 0


SINGLE = TPGroup()  # one process: every collective is a no-op


def backend_for(device: torch.device) -> str:
    """The torch.distributed backend for ``device``: NCCL on CUDA, gloo elsewhere."""
    return "nccl" if device.type == "cuda" else "gloo"


def init_tensor_parallel(
    rank: int,
    size: int,
    init_method: str,
    device: torch.device,
    timeout_s: float = 120.0,
) -> TPGroup:
    """Join the ``size``-process group as ``rank`` (every rank calls this with the same
    ``init_method``, e.g. ``tcp://127.0.0.1:PORT`` or ``file:///tmp/store``) and return it.

    At ``size`` 1 nothing is initialised and :data:`SINGLE` comes back. On CUDA the process's
    current device must already be the one it owns (NCCL binds to it)."""
    if size == 1:
        return SINGLE
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised in this process")
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(
        backend=backend_for(device),
        init_method=init_method,
        rank=rank,
        world_size=size,
        timeout=timedelta(seconds=timeout_s),
        **kwargs,  # type: ignore[arg-type]
    )
    return TPGroup(rank, size, None)


def world_group() -> TPGroup:
    """The group torch.distributed was initialised with in this process (:data:`SINGLE` when it
    was not): for code handed no group, e.g. a worker entry point."""
    if not dist.is_available() or not dist.is_initialized():
        return SINGLE
    return TPGroup(dist.get_rank(), dist.get_world_size(), None)


def destroy_tensor_parallel(tp: TPGroup) -> None:
    """Leave the group (a no-op for :data:`SINGLE` or when torch.distributed is not set up)."""
    if tp.size > 1 and dist.is_initialized():
        dist.destroy_process_group()
