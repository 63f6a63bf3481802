"""The batched LoRA op: token grouping, parity with a per-token loop, and parity with PEFT's own
mixed-adapter batches on every adapted linear of a tiny Llama (fused q/k/v and gate/up shards
included), several adapters of different ranks and targets plus the base model in one batch."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from engine_svc.lora.adapter import LoRAAdapter, ModelDims, load_adapter
from engine_svc.lora.ops import LoRAMapping, add_lora, add_lora_gather
from engine_svc.lora.weights import FUSED, LoRAWeights
from engine_svc.models.llama import DecoderSpec
from engine_svc.models.loader import architecture_of, read_hf_config
from tests.lora_peft import load_peft, make_adapter

CPU = torch.device("cpu")


# ------------------------------------------------------------------ grouping the tokens


def test_no_adapter_token_builds_no_mapping() -> None:
    assert LoRAMapping.build(np.full(5, -1), CPU) is None


def test_runs_of_one_slot_are_used_in_place() -> None:
    m = LoRAMapping.build(np.array([1, 1, -1, -1, 0, 0, 0, 1]), CPU)
    assert m is not None and m.perm is None and m.num_tokens == 8
    assert m.segments == ((1, 0, 2), (0, 4, 7), (1, 7, 8))


def test_interleaved_slots_are_sorted_once() -> None:
    # 7 runs for 3 slots (more than SORT_RUNS_PER_SLOT each): one sort instead
    m = LoRAMapping.build(np.array([0, 1, 0, -1, 1, 0, 1, 2]), CPU)
    assert m is not None and m.perm is not None
    assert m.perm.tolist() == [0, 2, 5, 1, 4, 6, 7]  # slot 0's tokens, then 1's, then 2's
    assert m.segments == ((0, 0, 3), (1, 3, 6), (2, 6, 7))


# ------------------------------------------------------------------ against a per-token loop


def per_token(
    y: torch.Tensor,
    x: torch.Tensor,
    slots: list[int],
    a: torch.Tensor,
    b: torch.Tensor,
    sizes: tuple[int, ...],
) -> torch.Tensor:
    out = y.clone()
    rank = b.shape[1]
    for t, s in enumerate(slots):
        if s < 0:
            continue
        h = x[t] @ a[s]
        offset = 0
        for i, width in enumerate(sizes):
            out[t, offset : offset + width] += (
                h[i * rank : (i + 1) * rank] @ b[s][:, offset : offset + width]
            )
            offset += width
    return out


@pytest.mark.parametrize("sizes", [(40,), (32, 16, 16), (24, 24)])
@pytest.mark.parametrize(
    "slots",
    [
        [0] * 9,
        [2, 2, 2, -1, -1, 1, 1, 1, 1],  # runs
        [0, 1, 2, 0, 1, 2, -1, 0, 1, 2, 0],  # interleaved: sorted
        [-1, 3, -1, 3, -1, 3, -1, 3, 0],
    ],
)
def test_matches_a_per_token_loop(sizes: tuple[int, ...], slots: list[int]) -> None:
    torch.manual_seed(0)
    num_slots, rank, fin = 4, 5, 24
    a = torch.randn(num_slots, fin, len(sizes) * rank, dtype=torch.float64)
    b = torch.randn(num_slots, rank, sum(sizes), dtype=torch.float64)
    x = torch.randn(len(slots), fin, dtype=torch.float64)
    y = torch.randn(len(slots), sum(sizes), dtype=torch.float64)
    expected = per_token(y, x, slots, a, b, sizes)
    m = LoRAMapping.build(np.array(slots), CPU)
    assert m is not None
    got = y.clone()
    add_lora(got, x, m, a, b, sizes)
    torch.testing.assert_close(got, expected)
    gathered = y.clone()
    add_lora_gather(gathered, x, torch.tensor(slots), a, b, sizes)
    torch.testing.assert_close(gathered, expected)
    # a slot whose adapter leaves this linear alone: its tokens are skipped
    live = [True, False, True, True]
    masked = [s if s >= 0 and live[s] else -1 for s in slots]
    skipped = y.clone()
    add_lora(skipped, x, m, a, b, sizes, live)
    torch.testing.assert_close(skipped, per_token(y, x, masked, a, b, sizes))


# ------------------------------------------------------------------ against PEFT


@pytest.fixture(scope="module")
def adapters(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict:
    base = tiny_models["llama"]
    root = tmp_path_factory.mktemp("lora_ops")
    return {
        "qv4": make_adapter(base, root / "qv4", r=4, alpha=8, targets=["q_proj", "v_proj"], seed=1),
        "all8": make_adapter(
            base, root / "all8", r=8, alpha=16, targets="all-linear", seed=2, use_rslora=True
        ),
        "mlp2": make_adapter(
            base,
            root / "mlp2",
            r=2,
            alpha=4,
            targets=["o_proj", "gate_proj", "up_proj", "down_proj"],
            seed=3,
            rank_pattern={"down_proj": 1},
        ),
    }


@pytest.mark.parametrize(
    "names",
    [
        ["qv4", "qv4", None, "all8", "mlp2", "all8", "qv4", None, "mlp2", "mlp2", "all8", "qv4"],
        ["all8", "all8", "all8", "mlp2", "mlp2", None, None, "qv4", "qv4", "qv4"],
        ["mlp2"],
    ],
)
def test_fused_linears_match_peft_mixed_batches(
    tiny_models: dict[str, Path], adapters: dict[str, Path], names: list[str | None]
) -> None:
    base = tiny_models["llama"]
    cfg = read_hf_config(base)
    dims = ModelDims.from_spec(DecoderSpec.from_hf_config(cfg, architecture_of(cfg)))
    loaded: dict[str, LoRAAdapter] = {
        n: load_adapter(p, dims, max_rank=8) for n, p in adapters.items()
    }
    slot_of = {"all8": 0, "qv4": 2, "mlp2": 3}  # slot 1 stays empty
    weights = LoRAWeights(dims, num_slots=4, max_rank=8, dtype=torch.float32, device=CPU)
    for n, slot in slot_of.items():
        weights.load(slot, loaded[n])
    slots = np.array([slot_of[n] if n else -1 for n in names])
    mapping = LoRAMapping.build(slots, CPU)
    assert mapping is not None

    peft_model = load_peft(base, adapters)
    adapter_names = [n or "__base__" for n in names]
    torch.manual_seed(5)
    layers = peft_model.base_model.model.model.layers
    with torch.no_grad():
        for layer_index, layer in enumerate(layers):
            for fused, shards in FUSED.items():
                block = layer.mlp if fused in ("gate_up_proj", "down_proj") else layer.self_attn
                peft_linears = [getattr(block, s) for s in shards]
                fin = peft_linears[0].in_features
                x = torch.randn(len(names), fin)
                expected = torch.cat(
                    [lin(x, adapter_names=adapter_names) for lin in peft_linears], dim=-1
                )
                base_w = torch.cat([lin.base_layer.weight for lin in peft_linears])
                y = x @ base_w.t()
                weights.layers[layer_index][fused].apply(y, x, mapping)
                torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
                # changed exactly where some token's adapter adapts this linear (else the
                # comparison above would prove nothing)
                adapted = any(
                    (layer_index, s) in loaded[n].modules for n in names if n for s in shards
                )
                assert torch.equal(y, x @ base_w.t()) is not adapted


def test_slot_reload_replaces_everything(
    tiny_models: dict[str, Path], adapters: dict[str, Path]
) -> None:
    """An adapter loaded over another leaves none of the old one's modules behind."""
    cfg = read_hf_config(tiny_models["llama"])
    dims = ModelDims.from_spec(DecoderSpec.from_hf_config(cfg, architecture_of(cfg)))
    weights = LoRAWeights(dims, num_slots=1, max_rank=8, dtype=torch.float32, device=CPU)
    weights.load(0, load_adapter(adapters["all8"], dims, max_rank=8))
    assert all(s.live[0] for s in weights.layers[0].values())
    weights.load(0, load_adapter(adapters["qv4"], dims, max_rank=8))
    live = {name: s.live[0] for name, s in weights.layers[0].items()}
    assert live == {"qkv_proj": True, "o_proj": False, "gate_up_proj": False, "down_proj": False}
    qkv = weights.layers[0]["qkv_proj"]
    # k's shard (rank block 1, columns q:q+kv) is zero: qv4 has no k_proj
    assert not qkv.a[0, :, 8:16].any() and not qkv.b[0, :, 96:144].any()
    assert qkv.a[0, :, 0:4].any() and not qkv.a[0, :, 4:8].any()  # rank 4 of 8: padded
