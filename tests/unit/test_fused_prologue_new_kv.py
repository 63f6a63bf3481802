"""The fused attention prologue (q/k norm + rotary + K/V into the cache, one kernel on CUDA)
hands attention this step's rotated K and V, as the unfused path does: the flash prefill reads
a step with no cached prefix from them instead of gathering the cache. Run here with the
prologue's torch reference (the CUDA kernel is checked against it in tests/gpu)."""

from __future__ import annotations

import torch

from engine_svc.models.layers import RotaryEmbedding
from engine_svc.models.llama import Attention, DecoderSpec, RopeInputs
from kernels import reference_norm_rope
from kernels.attention_backends import Kernels, TorchAttention
from tests.gpu.helpers import make_case


class SpyAttention(TorchAttention):
    def __init__(self) -> None:
        self.new_kv: list[tuple[torch.Tensor, torch.Tensor] | None] = []

    def forward(self, query, key_cache, value_cache, meta, scale, new_kv=None):  # type: ignore[no-untyped-def]
        self.new_kv.append(None if new_kv is None else (new_kv[0].clone(), new_kv[1].clone()))
        return super().forward(query, key_cache, value_cache, meta, scale, new_kv)


@torch.inference_mode()
def test_fused_and_unfused_prologues_hand_attention_the_same_kv() -> None:
    torch.manual_seed(0)
    heads, kv_heads, d = 4, 2, 32
    spec = DecoderSpec(
        vocab_size=64, hidden_size=heads * d, intermediate_size=64, num_layers=1,
        num_heads=heads, num_kv_heads=kv_heads, head_dim=d, rms_norm_eps=1e-6,
        rope={"rope_theta": 10000.0}, max_position_embeddings=256, tie_word_embeddings=False,
        qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=True,
    )  # fmt: skip
    rotary = RotaryEmbedding(d, 256, spec.rope)
    case = make_case([1, 7, 5], [40, 7, 20], heads, kv_heads, d, torch.float32, device="cpu")
    meta = case.meta
    positions = torch.tensor(
        [s - q + i for q, s in ((1, 40), (7, 7), (5, 20)) for i in range(q)], dtype=torch.int64
    )
    x = torch.randn(meta.num_tokens, spec.hidden_size)
    outs, spies, caches = [], [], []
    for fused in (False, True):
        spy = SpyAttention()
        prologue = reference_norm_rope.qk_norm_rope_kv if fused else None
        kernels = Kernels(spy, reference_norm_rope.rms_norm, qk_norm_rope_kv=prologue)
        layer = Attention(spec, rotary, kernels)
        torch.manual_seed(1)
        for p in layer.parameters():
            torch.nn.init.normal_(p, std=0.2)
        kv = (case.key_cache.clone(), case.value_cache.clone())
        cos_sin = None if fused else rotary.lookup(positions, x.dtype)
        outs.append(layer(RopeInputs(positions, cos_sin), x, kv, meta))
        spies.append(spy)
        caches.append(kv)
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
    (unfused,), (fused_kv,) = spies[0].new_kv, spies[1].new_kv
    assert unfused is not None and fused_kv is not None
    for got, want, cache in zip(fused_kv, unfused, caches[1], strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        # ... and they are what the cache now holds at the step's slots.
        torch.testing.assert_close(got, cache.flatten(0, 1)[meta.slot_mapping])
