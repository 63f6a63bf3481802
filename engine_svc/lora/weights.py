"""The device side of LoRA serving: for every adaptable linear of the model, its adapters'
weights stacked in ``max_loras`` slots (layout: see ``lora.ops``), and the copies that put an
adapter into a slot.

Our model fuses q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj``; an adapter's
per-module matrices land in the fused stack's shard, at the shard's output offset::

    qkv_proj  out = [ q (heads * head_dim) | k (kv_heads * head_dim) | v (...) ]
              a[slot][:, 0:r]       = A_q.T     b[slot][0:r, 0:q]          = B_q.T
              a[slot][:, R:R+r]     = A_k.T     b[slot][0:r, q:q+kv]       = B_k.T
              a[slot][:, 2R:2R+r]   = A_v.T     b[slot][0:r, q+kv:q+2kv]   = B_v.T

Tensor parallelism (``plan`` of more than one rank): each rank's stacks are the slice of the
adapter that goes with its shard of the base layer, cut by the base layer's own rule
(``ShardPlan.checkpoint_cut``), and the rest is replicated::

    column-parallel (qkv, gate_up)   A whole; B's output rows of this rank's q / k / v (or gate /
                                     up) columns, each shard cut like the base weight's (KV heads
                                     replicated when there are fewer than ranks)
    row-parallel (o, down)           A's input columns of this rank's share; B whole: the delta
                                     of the partial input is a partial sum, added to the layer's
                                     partial output before its all-reduce

Every rank holds the whole adapter on the host (read from its directory and checked against
the whole model) and copies only its slice to the device.
"""

from __future__ import annotations

import torch

from engine_svc.lora.adapter import LoRAAdapter, LoRAModule, ModelDims
from engine_svc.lora.ops import LoRAMapping, add_lora
from engine_svc.models.parallel import CheckpointCut, ShardPlan, read_cut

# fused linear of our model -> the checkpoint modules it holds, in output order
FUSED: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}


class LoRALinearStack:
    """The slots of one (fused) linear: a [S, in, n * R], b [S, R, out] (this rank's ``in`` and
    ``out``). ``cuts[i]``: the slice of shard i's matrices this rank holds (None: all of it); a
    cut along dim 0 is of B's output rows (column-parallel), along dim 1 of A's input columns
    (row-parallel)."""

    def __init__(
        self,
        shards: tuple[str, ...],
        in_features: int,
        out_sizes: tuple[int, ...],
        num_slots: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        cuts: tuple[CheckpointCut | None, ...] | None = None,
    ) -> None:
        self.shards = shards
        self.max_rank = max_rank
        self.out_sizes = out_sizes
        self.cuts = cuts or (None,) * len(shards)
        k = len(shards) * max_rank
        self.a = torch.zeros(num_slots, in_features, k, dtype=dtype, device=device)
        self.b = torch.zeros(num_slots, max_rank, sum(out_sizes), dtype=dtype, device=device)
        # live[slot]: the adapter in the slot adapts this linear (else its tokens skip it)
        self.live = [False] * num_slots

    def load(self, slot: int, modules: dict[str, LoRAModule]) -> None:
        """Put one adapter's matrices for this linear (by checkpoint module name) in ``slot``.
        Runs on the engine loop thread (torch work: the scaling, the cast, the copy)."""
        self.live[slot] = bool(modules)
        if not modules:
            return
        a, b = self.a[slot], self.b[slot]
        a.zero_()
        b.zero_()
        offset = 0
        shards = zip(self.shards, self.out_sizes, self.cuts, strict=True)
        for i, (shard, out, cut) in enumerate(shards):
            m = modules.get(shard)
            if m is not None:
                k0, r = i * self.max_rank, m.rank
                ma, mb = m.a, m.b
                if cut is not None and cut.dim == 0:  # column-parallel: this rank's outputs
                    mb = read_cut(mb, cut, f"{shard}.lora_B")
                elif cut is not None:  # row-parallel: this rank's inputs
                    ma = read_cut(ma, cut, f"{shard}.lora_A")
                a[:, k0 : k0 + r].copy_(ma.t())
                # scaling folded into B, in float32 before the cast to the serving dtype
                b[:r, offset : offset + out].copy_(mb.t().float() * m.scaling)
            offset += out

    def clear(self, slot: int) -> None:
        self.live[slot] = False

    def apply(self, y: torch.Tensor, x: torch.Tensor, mapping: LoRAMapping) -> None:
        """``y += delta`` for the tokens of ``mapping`` whose slot adapts this linear."""
        add_lora(y, x, mapping, self.a, self.b, self.out_sizes, self.live)


class LoRAWeights:
    """Every adaptable linear's slots: ``layers[i][fused_name]``. ``plan``: the rank whose
    shard of the model they go with (None: the whole model, one process)."""

    def __init__(
        self,
        dims: ModelDims,
        num_slots: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        plan: ShardPlan | None = None,
    ) -> None:
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.plan = plan
        self.layers = [
            {
                fused: _stack(fused, shards, dims, plan, num_slots, max_rank, dtype, device)
                for fused, shards in FUSED.items()
            }
            for _ in range(dims.num_layers)
        ]

    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        """Copy ``adapter`` (host memory) into device slot ``slot``, over what was there."""
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"LoRA slot {slot} out of range [0, {self.num_slots})")
        for layer, stacks in enumerate(self.layers):
            for stack in stacks.values():
                modules = {
                    s: m for s in stack.shards if (m := adapter.modules.get((layer, s))) is not None
                }
                stack.load(slot, modules)

    def clear(self, slot: int) -> None:
        """Forget what ``slot`` holds (no token may use it until the next load)."""
        for stacks in self.layers:
            for stack in stacks.values():
                stack.clear(slot)

    def tensors(self) -> list[torch.Tensor]:
        """Every slot tensor (what sleep mode takes off the device and puts back)."""
        return [t for stacks in self.layers for s in stacks.values() for t in (s.a, s.b)]

    @property
    def nbytes(self) -> int:
        return sum(
            s.a.numel() * s.a.element_size() + s.b.numel() * s.b.element_size()
            for stacks in self.layers
            for s in stacks.values()
        )


def _stack(
    fused: str,
    shards: tuple[str, ...],
    dims: ModelDims,
    plan: ShardPlan | None,
    num_slots: int,
    max_rank: int,
    dtype: torch.dtype,
    device: torch.device,
) -> LoRALinearStack:
    """The slots of linear ``fused`` for this rank: each shard cut as the base weight is."""
    in_features = dims.features[shards[0]][0]
    out_sizes = [dims.features[s][1] for s in shards]
    base = f"layers.0.{fused}.weight"  # the base weight (every layer is cut alike)
    cuts: list[CheckpointCut | None] = []
    for i in range(len(shards)):
        cut = None if plan is None else plan.checkpoint_cut(base, i if len(shards) > 1 else None)
        if cut is not None and cut.dim == 0:
            out_sizes[i] = cut.size
        elif cut is not None:
            in_features = cut.size
        cuts.append(cut)
    return LoRALinearStack(
        shards, in_features, tuple(out_sizes), num_slots, max_rank, dtype, device, tuple(cuts)
    )
