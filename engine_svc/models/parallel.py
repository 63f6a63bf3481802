"""Tensor-parallel (Megatron-style) layers of the decoder, and which slice of each checkpoint
tensor a rank holds.

Per decoder layer, with ``size`` ranks::

    x (full) ─► qkv_proj   column-parallel: rank r's heads' rows of q, k and v ─► attention
              ─► o_proj     row-parallel: rank r's columns, a partial sum ─► all-reduce (1)
    x (full) ─► gate_up    column-parallel: rank r's rows of gate and of up ─► silu(g) * u
              ─► down_proj  row-parallel: rank r's columns, a partial sum ─► all-reduce (2)

The embedding and the LM head are split over the vocabulary: each rank holds ``vocab_per_rank``
rows (the vocabulary padded as vLLM pads it, to a multiple of 64, so that it divides evenly);
the embedding sums the ranks' lookups (a rank contributes zeros for ids outside its range), the
head gathers the ranks' logits and drops the padding columns.

KV heads follow the q heads they serve. With fewer KV heads than ranks each is replicated on
``size // num_kv_heads`` consecutive ranks (vLLM's rule: rank r holds KV head
``r // (size // num_kv_heads)``), so every rank holds exactly one.

For a group of one (:data:`~engine_svc.distributed.SINGLE`) the factories below return the
plain ``nn.Linear`` / ``nn.Embedding`` of the unsharded model, no padding: the single-process
model is the model it always was.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from engine_svc.distributed import TPGroup, all_gather_last, all_reduce

VOCAB_PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE


class TensorSlice(Protocol):
    """A checkpoint tensor not read yet (safetensors' ``get_slice``): indexing reads only the
    part asked for."""

    def get_shape(self) -> list[int]: ...

    def __getitem__(self, index: Any) -> torch.Tensor: ...


CheckpointTensor = torch.Tensor | TensorSlice


@dataclass(frozen=True)
class CheckpointCut:
    """Rows or columns [start, start + size) of a checkpoint tensor along ``dim``, whose full
    extent there is ``full``."""

    dim: int
    start: int
    size: int
    full: int


@dataclass(frozen=True)
class ShardPlan:
    """This rank's share of every sharded dimension (all of it for a group of one)."""

    tp: TPGroup
    head_dim: int
    total_heads: int
    total_kv_heads: int
    total_intermediate: int
    vocab_size: int  # the model's, unpadded: logits have this many columns
    num_heads: int  # q heads on this rank
    num_kv_heads: int  # KV heads on this rank (its KV cache's heads)
    kv_head_start: int  # the first of them, counted over all KV heads
    intermediate_size: int
    vocab_per_rank: int  # embedding / LM-head rows on this rank, padding included

    @classmethod
    def build(
        cls,
        tp: TPGroup,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        intermediate_size: int,
        vocab_size: int,
    ) -> ShardPlan:
        """Raises ``ValueError`` for a shape that does not split over ``tp.size`` ranks."""
        n = tp.size
        problems = []
        if num_heads % n:
            problems.append(f"{num_heads} attention heads")
        if num_kv_heads % n and n % num_kv_heads:
            problems.append(f"{num_kv_heads} KV heads (neither divides the other)")
        if intermediate_size % n:
            problems.append(f"intermediate size {intermediate_size}")
        if problems:
            raise ValueError(f"cannot split over {n} tensor-parallel ranks: {', '.join(problems)}")
        kv_per_rank = max(1, num_kv_heads // n)
        replicas = max(1, n // num_kv_heads)  # ranks holding each KV head
        return cls(
            tp=tp,
            head_dim=head_dim,
            total_heads=num_heads,
            total_kv_heads=num_kv_heads,
            total_intermediate=intermediate_size,
            vocab_size=vocab_size,
            num_heads=num_heads // n,
            num_kv_heads=kv_per_rank,
            kv_head_start=(tp.rank // replicas) * kv_per_rank,
            intermediate_size=intermediate_size // n,
            vocab_per_rank=padded_vocab_size(vocab_size, n) // n,
        )

    @property
    def vocab_start(self) -> int:
        return self.tp.rank * self.vocab_per_rank

    @property
    def vocab_rows(self) -> int:
        """Rows of this rank's vocabulary slice that are real tokens (the rest is padding)."""
        return max(0, min(self.vocab_size - self.vocab_start, self.vocab_per_rank))

    def checkpoint_cut(self, name: str, shard: int | None) -> CheckpointCut | None:
        """The slice of checkpoint tensor ``name`` (our parameter name; ``shard``: which part of
        a fused qkv / gate_up parameter) this rank loads; None: the whole tensor (a replicated
        one, or any tensor for a group of one)."""
        if self.tp.size == 1:
            return None
        rank, d = self.tp.rank, self.head_dim
        if ".qkv_proj." in name:
            if shard == 0:
                return CheckpointCut(0, rank * self.num_heads * d, self.num_heads * d,
                                     self.total_heads * d)  # fmt: skip
            return CheckpointCut(0, self.kv_head_start * d, self.num_kv_heads * d,
                                 self.total_kv_heads * d)  # fmt: skip
        if ".gate_up_proj." in name:
            size = self.intermediate_size
            return CheckpointCut(0, rank * size, size, self.total_intermediate)
        if name.endswith(".o_proj.weight"):
            size = self.num_heads * d
            return CheckpointCut(1, rank * size, size, self.total_heads * d)
        if name.endswith(".down_proj.weight"):
            size = self.intermediate_size
            return CheckpointCut(1, rank * size, size, self.total_intermediate)
        if name in ("embed_tokens.weight", "lm_head.weight"):
            return CheckpointCut(0, self.vocab_start, self.vocab_rows, self.vocab_size)
        return None  # norms, o/down biases (added once, by rank 0), the classifier head


def read_cut(src: CheckpointTensor, cut: CheckpointCut, name: str) -> torch.Tensor:
    """This rank's rows or columns of a checkpoint tensor: a view of a tensor, or only those
    bytes read from the file for a ``TensorSlice``."""
    shape = list(src.shape) if isinstance(src, torch.Tensor) else src.get_shape()
    if len(shape) <= cut.dim or shape[cut.dim] != cut.full:
        raise ValueError(
            f"shape mismatch for {name}: checkpoint {tuple(shape)}, expected {cut.full} "
            f"along dim {cut.dim}"
        )
    if isinstance(src, torch.Tensor):
        return src.narrow(cut.dim, cut.start, cut.size)
    rows = slice(cut.start, cut.start + cut.size)
    return src[rows] if cut.dim == 0 else src[:, rows]


def padded_vocab_size(vocab_size: int, size: int) -> int:
    """The vocabulary the ranks split: itself for one rank; else, as vLLM pads it, rounded up to
    a multiple of 64 (of lcm(64, size) when 64 does not divide over ``size``)."""
    if size == 1:
        return vocab_size
    step = VOCAB_PADDING if VOCAB_PADDING % size == 0 else math.lcm(VOCAB_PADDING, size)
    return -(-vocab_size // step) * step


class RowParallelLinear(nn.Linear):
    """This rank's input columns of a linear layer; its output is a partial sum that the caller
    all-reduces (after adding any adapter's partial delta). The bias is added by rank 0 only, so
    the sum holds it once."""

    def __init__(self, in_per_rank: int, out_features: int, bias: bool, tp: TPGroup) -> None:
        super().__init__(in_per_rank, out_features, bias)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias if self.tp.is_first else None)


class VocabParallelEmbedding(nn.Embedding):
    """Rows [start, start + vocab_per_rank) of the embedding; the lookup of an id outside them
    is zeros, and the sum over ranks is the full lookup."""

    def __init__(self, plan: ShardPlan, hidden_size: int) -> None:
        # An explicit empty weight: no init (see LlamaForCausalLM.__init__).
        weight = torch.empty(plan.vocab_per_rank, hidden_size)
        super().__init__(plan.vocab_per_rank, hidden_size, _weight=weight)
        self.tp, self.start = plan.tp, plan.vocab_start

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.num_embeddings)
        x = F.embedding(local.masked_fill_(outside, 0), self.weight)
        return all_reduce(x.masked_fill_(outside.unsqueeze(-1), 0.0), self.tp)


class ParallelLMHead(nn.Linear):
    """The LM head's rows for this rank's vocabulary slice; ``forward`` returns every rank's
    logits gathered, [rows, vocab_size], padding columns dropped."""

    def __init__(self, plan: ShardPlan, hidden_size: int) -> None:
        super().__init__(hidden_size, plan.vocab_per_rank, bias=False)
        self.tp, self.vocab_size = plan.tp, plan.vocab_size

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = all_gather_last(F.linear(hidden, self.weight), self.tp)
        if logits.shape[-1] == self.vocab_size:
            return logits
        return logits[..., : self.vocab_size].contiguous()


def row_parallel_linear(
    in_features: int, out_features: int, bias: bool, plan: ShardPlan
) -> nn.Linear:
    """``in_features``: this rank's share. A plain ``nn.Linear`` for a group of one."""
    if plan.tp.size == 1:
        return nn.Linear(in_features, out_features, bias)
    return RowParallelLinear(in_features, out_features, bias, plan.tp)


def vocab_embedding(plan: ShardPlan, hidden_size: int) -> nn.Embedding:
    """The token embedding: a plain ``nn.Embedding`` (uninitialised) for a group of one."""
    if plan.tp.size == 1:
        weight = torch.empty(plan.vocab_size, hidden_size)
        return nn.Embedding(plan.vocab_size, hidden_size, _weight=weight)
    return VocabParallelEmbedding(plan, hidden_size)


def vocab_lm_head(plan: ShardPlan, hidden_size: int) -> nn.Linear:
    """The language-model head: a plain ``nn.Linear`` for a group of one."""
    if plan.tp.size == 1:
        return nn.Linear(hidden_size, plan.vocab_size, bias=False)
    return ParallelLMHead(plan, hidden_size)
