"""Tensor parallelism over torch.distributed: the group a process belongs to and the
collectives the sharded model runs (no-ops for a group of one)."""

from engine_svc.distributed.collectives import all_gather_last, all_reduce, min_over_ranks
from engine_svc.distributed.parallel_state import (
    SINGLE,
    TPGroup,
    backend_for,
    destroy_tensor_parallel,
    init_tensor_parallel,
    world_group,
)

__all__ = [
    "SINGLE",
    "TPGroup",
    "all_gather_last",
    "all_reduce",
    "backend_for",
    "destroy_tensor_parallel",
    "init_tensor_parallel",
    "min_over_ranks",
    "world_group",
]
