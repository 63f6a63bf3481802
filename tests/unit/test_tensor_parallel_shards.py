"""How the model splits over tensor-parallel ranks, checked in one process (building and loading
a rank's shard needs no process group; its forward does: tests/parity/test_tensor_parallel.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from engine_svc.distributed import SINGLE, TPGroup, all_gather_last, all_reduce
from engine_svc.models import loader
from engine_svc.models.llama import LlamaForCausalLM
from engine_svc.models.parallel import (
    ParallelLMHead,
    RowParallelLinear,
    ShardPlan,
    TensorSlice,
    VocabParallelEmbedding,
    padded_vocab_size,
)
from tests.conftest import build_tiny_checkpoint


def _plan(rank: int, size: int, heads: int = 8, kv_heads: int = 2, vocab: int = 385) -> ShardPlan:
    return ShardPlan.build(TPGroup(rank, size), heads, kv_heads, 16, 96, vocab)


def test_kv_heads_split_or_replicate_as_vllm_does() -> None:
    # 2 KV heads over 4 ranks: each held by 2 consecutive ranks, one per rank.
    assert [(_plan(r, 4).num_kv_heads, _plan(r, 4).kv_head_start) for r in range(4)] == [
        (1, 0),
        (1, 0),
        (1, 1),
        (1, 1),
    ]
    # 4 KV heads over 2 ranks: 2 each.
    assert [(p.num_kv_heads, p.kv_head_start) for p in (_plan(r, 2, 8, 4) for r in range(2))] == [
        (2, 0),
        (2, 2),
    ]
    assert _plan(0, 4).num_heads == 2 and _plan(0, 4).intermediate_size == 24


def test_the_vocabulary_is_padded_as_vllm_pads_it() -> None:
    assert padded_vocab_size(385, 1) == 385  # one rank: the model as it is
    assert padded_vocab_size(383, 2) == 384
    assert padded_vocab_size(385, 2) == 448  # to a multiple of 64
    assert padded_vocab_size(100, 3) == 192  # lcm(64, 3)
    assert [(p.vocab_start, p.vocab_rows) for p in (_plan(r, 2) for r in range(2))] == [
        (0, 224),
        (224, 161),  # 63 padding rows
    ]


@pytest.mark.parametrize(("heads", "kv_heads", "size"), [(6, 2, 4), (8, 3, 2), (8, 8, 3)])
def test_shapes_that_do_not_split_are_refused(heads: int, kv_heads: int, size: int) -> None:
    with pytest.raises(ValueError, match=f"cannot split over {size} tensor-parallel ranks"):
        ShardPlan.build(TPGroup(0, size), heads, kv_heads, 16, 96, 384)


def test_collectives_are_the_identity_for_one_rank() -> None:
    x = torch.randn(3, 5)
    assert all_reduce(x, SINGLE) is x
    assert all_gather_last(x, SINGLE) is x


def test_one_rank_builds_the_unsharded_model(tiny_models: dict[str, Path]) -> None:
    """TP=1: the plain torch modules of the unsharded model, nothing of the parallel ones."""
    model = loader.load_model(tiny_models["qwen3"], torch.float32, torch.device("cpu"), 64)
    parallel = (RowParallelLinear, VocabParallelEmbedding, ParallelLMHead)
    assert not [m for m in model.modules() if isinstance(m, parallel)]
    assert type(model.embed_tokens) is nn.Embedding and type(model.lm_head) is nn.Linear
    layer: Any = model.layers[0]
    assert type(layer.self_attn.o_proj) is nn.Linear and type(layer.mlp.down_proj) is nn.Linear
    spec = model.spec
    assert model.embed_tokens.weight.shape == (spec.vocab_size, spec.hidden_size)
    qkv = (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim
    assert layer.self_attn.qkv_proj.weight.shape == (qkv, spec.hidden_size)


_SLICES = loader.iter_safetensor_slices


class _Recorded:
    """A checkpoint slice that counts the elements read through it."""

    def __init__(self, inner: TensorSlice, read: dict[str, int], name: str) -> None:
        self._inner, self._read, self._name = inner, read, name

    def get_shape(self) -> list[int]:
        return self._inner.get_shape()

    def __getitem__(self, index: Any) -> torch.Tensor:
        t = self._inner[index]
        self._read[self._name] = self._read.get(self._name, 0) + t.numel()
        return t


def _load_rank(
    model_dir: Path, rank: int, monkeypatch: pytest.MonkeyPatch
) -> tuple[LlamaForCausalLM, dict[str, int]]:
    read: dict[str, int] = {}

    def recorded(d: str | Path) -> Iterator[tuple[str, TensorSlice]]:
        for name, s in _SLICES(d):
            yield name, _Recorded(s, read, name)

    def whole(d: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
        raise AssertionError("a rank of a sharded model read whole tensors")

    monkeypatch.setattr(loader, "iter_safetensor_slices", recorded)
    monkeypatch.setattr(loader, "iter_safetensors", whole)
    tp = TPGroup(rank, 2)
    model = loader.load_model(model_dir, torch.float32, torch.device("cpu"), 64, None, tp)
    return model, read


def test_each_rank_reads_only_its_slice_of_the_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fewer KV heads than ranks (each rank reads the one KV head whole) and a vocabulary that
    needs padding: every rank reads from the file exactly the elements it holds, and the ranks'
    shards put together are the checkpoint."""
    model_dir = build_tiny_checkpoint(
        tmp_path / "m", "LlamaForCausalLM", vocab_size=383, num_key_value_heads=1
    )
    ckpt = load_file(model_dir / "model.safetensors")
    ranks = [_load_rank(model_dir, r, monkeypatch) for r in range(2)]
    for model, read in ranks:
        held = sum(p.numel() for p in model.parameters())
        padding = model.plan.vocab_per_rank - model.plan.vocab_rows
        pad_elems = 2 * padding * model.spec.hidden_size  # embedding and lm_head
        assert sum(read.values()) == held - pad_elems < sum(t.numel() for t in ckpt.values())
        assert model.plan.num_kv_heads == 1 and model.plan.kv_head_start == 0
    (m0, _), (m1, _) = ranks
    cat = torch.cat
    a0: Any = m0.layers[1].self_attn
    a1: Any = m1.layers[1].self_attn
    prefix = "model.layers.1.self_attn"
    q0, k0, _ = a0.qkv_proj.weight.split([a0.q_size, a0.kv_size, a0.kv_size])
    q1, k1, _ = a1.qkv_proj.weight.split([a1.q_size, a1.kv_size, a1.kv_size])
    assert torch.equal(cat([q0, q1]), ckpt[f"{prefix}.q_proj.weight"])
    assert torch.equal(k0, ckpt[f"{prefix}.k_proj.weight"]) and torch.equal(k1, k0)
    assert torch.equal(
        cat([a0.o_proj.weight, a1.o_proj.weight], 1), ckpt[f"{prefix}.o_proj.weight"]
    )
    rows = m1.plan.vocab_rows
    assert m1.lm_head is not None and m0.lm_head is not None
    assert torch.equal(cat([m0.lm_head.weight, m1.lm_head.weight[:rows]]), ckpt["lm_head.weight"])
    assert not m1.embed_tokens.weight[rows:].any()  # padding rows: zeros
