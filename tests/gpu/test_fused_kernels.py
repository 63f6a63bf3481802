"""The fused CUDA kernels against their torch references: SiLU-and-multiply (activation.cu) and the
attention prologue qk_norm_rope_kv (norm_rope.cu: q/k RMSNorm, neox rotary, KV cache write), in
float32, float16 and bfloat16. Outputs and caches are NaN-poisoned: an element the kernel should
write and does not stays NaN, and a cache slot it should leave alone (padding tokens, slot -1;
every slot no token maps to) must still be NaN. Also: after ``preload`` every wrapper launches
without compiling or loading anything (what CUDA graph capture needs).

Tolerances. The rotation rounds where torch rounds (cos/sin to the dtype, the first product, one
fma), so without q/k norms it is exact in float16 and bfloat16 (products of two 16-bit values are
exact in fp32); float32 is allowed an ulp-level difference. The norm's mean and rsqrt differ from
torch's in reduction order and rsqrt, so with norms one rounding step of the dtype is allowed.
SiLU: expf and the division in fp32 like torch's, then the same two roundings: one step."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
pytest.importorskip("cupy", reason="the CUDA kernels load through CuPy")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from kernels import cuda, cuda_ops, reference  # noqa: E402
from kernels import reference_norm_rope as ref  # noqa: E402
from tests.gpu.helpers import DTYPES, ONE_STEP, make_case  # noqa: E402

EXACT = dict(atol=0.0, rtol=0.0)


def _rand(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to("cuda", dtype)


# --------------------------------------------------------------------------------------------
# silu_and_mul


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "shape", [(1, 2 * 11008), (7, 2 * 4096), (33, 2 * 1000), (5, 2 * 7), (3, 2 * 13), (1, 2),
              (2, 5, 2 * 64), (300, 2 * 24)],
)  # fmt: skip
def test_silu_and_mul_matches_reference(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    gate_up = _rand(*shape, dtype=dtype, seed=sum(shape), scale=3.0)
    before = gate_up.clone()
    want = reference.silu_and_mul(gate_up.clone())
    got = cuda_ops.silu_and_mul(gate_up)
    torch.cuda.synchronize()
    assert got.shape == (*shape[:-1], shape[-1] // 2) and got.is_contiguous()
    torch.testing.assert_close(got, want, **ONE_STEP[dtype])
    assert torch.equal(gate_up, before), "gate_up was written"
    out = torch.full(got.shape, float("nan"), dtype=dtype, device="cuda")
    assert cuda_ops.silu_and_mul(gate_up, out=out) is out
    torch.cuda.synchronize()
    assert not out.isnan().any(), f"{int(out.isnan().sum())} elements left unwritten"
    torch.testing.assert_close(out, got, **EXACT)
    ref_out = torch.full_like(out, float("nan"))
    torch.testing.assert_close(reference.silu_and_mul(gate_up, out=ref_out), want, **EXACT)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("offset", [1, 2, 3], ids=lambda o: f"offset{o}")
def test_silu_and_mul_unaligned_rows(offset: int, dtype: torch.dtype) -> None:
    """Rows that are slices of a wider tensor starting ``offset`` elements in: not 16-byte
    aligned (the scalar path), with a row stride that is not a multiple of the vector width."""
    inter = 64
    wide = _rand(9, 2 * inter + offset + 5, dtype=dtype, seed=offset, scale=3.0)
    gate_up = wide[:, offset : offset + 2 * inter]
    want = reference.silu_and_mul(gate_up.clone())
    out = torch.full((9, inter), float("nan"), dtype=dtype, device="cuda")
    cuda_ops.silu_and_mul(gate_up, out=out)
    torch.cuda.synchronize()
    assert not out.isnan().any()
    torch.testing.assert_close(out, want, **ONE_STEP[dtype])


def test_silu_and_mul_checks() -> None:
    x = torch.zeros(4, 7, dtype=torch.float16, device="cuda")
    with pytest.raises(ValueError, match="2 \\* I"):
        cuda_ops.silu_and_mul(x)
    x = torch.zeros(4, 8, dtype=torch.float16, device="cuda")
    with pytest.raises(ValueError, match="out must be"):
        cuda_ops.silu_and_mul(x, out=torch.empty(4, 4, device="cuda"))
    assert cuda_ops.silu_and_mul(torch.zeros(0, 8, device="cuda")).shape == (0, 4)


# --------------------------------------------------------------------------------------------
# qk_norm_rope_kv


def _tables(max_pos: int, rot: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot))
    freqs = torch.outer(torch.arange(max_pos).float(), inv)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().cuda(), emb.sin().cuda()


# (num_tokens, num_heads, num_kv_heads, head_dim, rot_dim, q/k norms, row padding)
PROLOGUE = [
    (1, 8, 8, 128, 128, True, 0),
    (37, 32, 8, 128, 128, True, 0),  # Qwen3-like: GQA 4, norms
    (37, 32, 8, 128, 128, False, 0),  # Llama-like: no norms
    (300, 16, 2, 64, 64, True, 8),  # rows of a wider tensor
    (11, 4, 2, 24, 24, True, 0),  # the tiny test models' head size
    (13, 8, 4, 128, 64, True, 0),  # partial rotary
    (9, 28, 4, 128, 32, False, 3),  # partial rotary, no norms, odd row padding
    (5, 8, 1, 256, 256, True, 0),
    (6, 4, 2, 256, 128, False, 0),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "spec", PROLOGUE, ids=lambda s: f"t{s[0]}-h{s[1]}/{s[2]}-d{s[3]}-r{s[4]}-n{int(s[5])}"
)
def test_qk_norm_rope_kv_matches_reference(spec: tuple, dtype: torch.dtype) -> None:
    t, h, hkv, d, rot, norms, pad = spec
    width = (h + 2 * hkv) * d
    gen = torch.Generator().manual_seed(t * 7 + d)
    qkv = _rand(t, width + pad, dtype=dtype, seed=t + d, scale=2.0)[:, :width]
    positions = torch.randint(0, 4096, (t,), generator=gen).cuda()
    cos, sin = _tables(4096, rot)
    qw = kw = None
    if norms:
        qw = _rand(d, dtype=dtype, seed=1, scale=0.1) + 1
        kw = _rand(d, dtype=dtype, seed=2, scale=0.1) + 1
    num_blocks, bs = 64, 16
    slots = torch.randperm(num_blocks * bs, generator=gen)[:t]
    slots[::5] = -1  # padding tokens: their K/V are written nowhere
    slots = slots.cuda()
    shape = (num_blocks, bs, hkv, d)
    kc = torch.full(shape, float("nan"), dtype=dtype, device="cuda")
    vc = torch.full(shape, float("nan"), dtype=dtype, device="cuda")
    qkv_ref, kc_ref, vc_ref = qkv.clone(), kc.clone(), vc.clone()
    v_before = qkv[:, (h + hkv) * d :].clone()

    want_q = ref.qk_norm_rope_kv(
        qkv_ref, positions, cos, sin, qw, kw, 1e-6, kc_ref, vc_ref, slots, h, hkv
    )
    q = cuda_ops.qk_norm_rope_kv(qkv, positions, cos, sin, qw, kw, 1e-6, kc, vc, slots, h, hkv)
    torch.cuda.synchronize()

    assert q.shape == (t, h, d) and q.data_ptr() == qkv.data_ptr(), "q must be a view of qkv"
    tol = EXACT if not norms and dtype != torch.float32 else ONE_STEP[dtype]
    torch.testing.assert_close(q, want_q, **tol)
    k, k_ref = qkv[:, h * d : (h + hkv) * d], qkv_ref[:, h * d : (h + hkv) * d]
    torch.testing.assert_close(k, k_ref, **tol)
    assert torch.equal(qkv[:, (h + hkv) * d :], v_before), "the v part of qkv was written"
    # Slots no real token maps to must still be NaN; written ones must equal the reference.
    assert torch.equal(kc.isnan(), kc_ref.isnan()) and torch.equal(vc.isnan(), vc_ref.isnan())
    torch.testing.assert_close(kc, kc_ref, equal_nan=True, **tol)
    torch.testing.assert_close(vc, vc_ref, equal_nan=True, **EXACT)


def test_qk_norm_rope_kv_checks() -> None:
    t, h, hkv, d = 3, 4, 2, 64
    qkv = torch.zeros(t, (h + 2 * hkv) * d, dtype=torch.bfloat16, device="cuda")
    cos, sin = _tables(16, d)
    kc = torch.zeros(4, 16, hkv, d, dtype=torch.bfloat16, device="cuda")
    pos = torch.zeros(t, dtype=torch.int64, device="cuda")
    w = torch.ones(d, dtype=torch.bfloat16, device="cuda")
    args = (kc, kc.clone(), pos.clone())
    with pytest.raises(ValueError, match="both be given"):
        cuda_ops.qk_norm_rope_kv(qkv, pos, cos, sin, w, None, 1e-6, *args, h, hkv)
    with pytest.raises(ValueError, match="positions must be"):
        cuda_ops.qk_norm_rope_kv(qkv, pos.int(), cos, sin, w, w, 1e-6, *args, h, hkv)
    with pytest.raises(ValueError, match="qkv must be"):
        cuda_ops.qk_norm_rope_kv(qkv[:, 1:], pos, cos, sin, w, w, 1e-6, *args, h, hkv)
    with pytest.raises(ValueError, match="num_kv_heads"):
        cuda_ops.qk_norm_rope_kv(qkv, pos, cos, sin, w, w, 1e-6, *args, h, 1)
    empty = cuda_ops.qk_norm_rope_kv(qkv[:0], pos[:0], cos, sin, w, w, 1e-6, kc, kc.clone(),
                                     pos[:0], h, hkv)  # fmt: skip
    assert empty.shape == (0, h, d)


# --------------------------------------------------------------------------------------------
# preload


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_nothing_compiles_or_loads_after_preload(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    d = 128
    cuda_ops.preload(dtype, d)

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"compiled or loaded after preload: {args}")

    monkeypatch.setattr(cuda, "function", refuse)
    case = make_case([1, 1, 20], [700, 5, 40], 8, 2, d, dtype, index_dtype=torch.int32)
    m = case.meta
    cuda_ops.paged_attention(case.query, case.key_cache, case.value_cache, m, case.scale)
    cuda_ops.paged_attention(
        case.query, case.key_cache, case.value_cache, m, case.scale, partitions=3
    )
    t = m.num_tokens
    qkv = _rand(t, 12 * d, dtype=dtype, seed=3)
    positions = torch.arange(t, device="cuda")
    cos, sin = _tables(64, d)
    w = torch.ones(d, dtype=dtype, device="cuda")
    kc, vc = case.key_cache, case.value_cache
    q = cuda_ops.qk_norm_rope_kv(qkv, positions, cos, sin, w, w, 1e-6, kc, vc, m.slot_mapping, 8, 2)
    k, v = qkv[:, 8 * d : 10 * d].view(t, 2, d), qkv[:, 10 * d :].view(t, 2, d)
    for offset in (0, 1):  # the 16-byte and a narrower access width
        kv = qkv[:, offset : offset + 4 * d].reshape(t, 2, 2 * d)[..., :d]
        cuda_ops.write_kv_cache(kv, kv, kc, vc, m.slot_mapping)
    cuda_ops.write_kv_cache(k, v, kc, vc, m.slot_mapping)
    x = q.reshape(t, 8 * d)
    hidden_w = torch.ones(8 * d, dtype=dtype, device="cuda")
    cuda_ops.rms_norm(x, hidden_w, 1e-6)
    cuda_ops.fused_add_rms_norm(x, x.clone(), hidden_w, 1e-6)
    cuda_ops.silu_and_mul(qkv)
    cuda_ops.silu_and_mul(qkv[:, 1:-1])  # the unaligned path: the same entry point
    torch.cuda.synchronize()
