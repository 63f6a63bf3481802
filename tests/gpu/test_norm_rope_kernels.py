"""CUDA RMSNorm (plain and fused with the residual add) and neox rotary embedding (norm_rope.cu)
against the torch references in kernels.reference_norm_rope.

Tolerances: the residual sum is rounded exactly as torch rounds it (compared exactly); the normed
output differs from the reference only by reduction order and rsqrt, at most one rounding step
of the dtype. The rotary kernel computes in fp32 and rounds once, so it is compared with the
reference run in fp32 and rounded (one step), and loosely with the reference in the dtype itself
(which rounds cos, sin and each product)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
pytest.importorskip("cupy", reason="the CUDA kernels load through CuPy")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from kernels import cuda_ops  # noqa: E402
from kernels import reference_norm_rope as ref  # noqa: E402
from tests.gpu.helpers import DTYPES, ONE_STEP  # noqa: E402

IN_DTYPE = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=1e-2, rtol=1e-2),
    torch.bfloat16: dict(atol=5e-2, rtol=3e-2),
}


def _rand(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to("cuda", dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 64), (7, 4096), (33, 5120), (256, 8192), (5, 1000),
                                   (9, 8, 128)])  # fmt: skip
def test_rms_norm_matches_reference(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    x = _rand(*shape, dtype=dtype, seed=1, scale=3.0)
    w = _rand(shape[-1], dtype=dtype, seed=2, scale=0.1) + 1
    got = cuda_ops.rms_norm(x, w, 1e-6)
    torch.testing.assert_close(got, ref.rms_norm(x, w, 1e-6), **ONE_STEP[dtype])
    # Strided rows: a slice of a wider tensor.
    wide = _rand(shape[0], 2 * shape[-1], dtype=dtype, seed=3)
    xs = wide[:, : shape[-1]]
    torch.testing.assert_close(
        cuda_ops.rms_norm(xs, w, 1e-5), ref.rms_norm(xs, w, 1e-5), **ONE_STEP[dtype]
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 64), (7, 4096), (256, 8192), (5, 1000)])
def test_fused_add_rms_norm_matches_reference(shape: tuple[int, int], dtype: torch.dtype) -> None:
    x = _rand(*shape, dtype=dtype, seed=4, scale=2.0)
    res = _rand(*shape, dtype=dtype, seed=5, scale=2.0)
    w = _rand(shape[-1], dtype=dtype, seed=6, scale=0.1) + 1
    out, summed = cuda_ops.fused_add_rms_norm(x, res, w, 1e-6)
    want_out, want_sum = ref.fused_add_rms_norm(x, res, w, 1e-6)
    torch.testing.assert_close(summed, want_sum, atol=0, rtol=0)
    torch.testing.assert_close(out, want_out, **ONE_STEP[dtype])


def _tables(max_pos: int, rot: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot))
    freqs = torch.outer(torch.arange(max_pos).float(), inv)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().cuda(), emb.sin().cuda()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "t,h,hkv,d,rot",
    [
        (1, 8, 8, 128, 128),
        (37, 32, 8, 128, 128),
        (300, 16, 2, 64, 64),
        (11, 4, 2, 24, 24),
        (13, 8, 4, 128, 64),
    ],  # fmt: skip
)
def test_rotary_matches_reference(
    t: int, h: int, hkv: int, d: int, rot: int, dtype: torch.dtype
) -> None:
    cos, sin = _tables(4096, rot)
    positions = torch.randint(0, 4096, (t,), generator=torch.Generator().manual_seed(t)).cuda()
    qkv = _rand(t, (h + 2 * hkv) * d, dtype=dtype, seed=7, scale=2.0)
    q = qkv[:, : h * d].view(t, h, d)  # strided views, as the model has them
    k = qkv[:, h * d : (h + hkv) * d].view(t, hkv, d)
    q32, k32 = q.float(), k.float()
    ref.rotary_embedding(positions, q32, k32, cos, sin)
    q_ref, k_ref = q.clone(), k.clone()
    ref.rotary_embedding(positions, q_ref, k_ref, cos, sin)
    v_before = qkv[:, (h + hkv) * d :].clone()
    cuda_ops.rotary_embedding(positions, q, k, cos, sin)
    torch.testing.assert_close(q, q32.to(dtype), **ONE_STEP[dtype])
    torch.testing.assert_close(k, k32.to(dtype), **ONE_STEP[dtype])
    torch.testing.assert_close(q, q_ref, **IN_DTYPE[dtype])
    torch.testing.assert_close(k, k_ref, **IN_DTYPE[dtype])
    assert torch.equal(qkv[:, (h + hkv) * d :], v_before)  # V untouched


def test_norm_checks() -> None:
    x = torch.zeros(4, 64, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(TypeError, match="weight dtype"):
        cuda_ops.rms_norm(x, torch.ones(64, device="cuda"), 1e-6)
    with pytest.raises(ValueError, match="weight must be"):
        cuda_ops.rms_norm(x, torch.ones(32, dtype=torch.bfloat16, device="cuda"), 1e-6)
