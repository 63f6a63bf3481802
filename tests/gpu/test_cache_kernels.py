"""CUDA write_kv_cache (cache_ops.cu) against the torch reference: exact, including the slots
it must leave alone (NaN-poisoned) and padding tokens (slot -1), for every access width."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
pytest.importorskip("cupy", reason="the CUDA kernels load through CuPy")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from kernels import cuda_ops, reference  # noqa: E402


def _views(
    t: int, h: int, hkv: int, d: int, dtype: torch.dtype, offset: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V as the model has them: strided views into one fused qkv projection output,
    shifted by ``offset`` elements to exercise the narrower copy widths."""
    width = offset + (h + 2 * hkv) * d
    qkv = torch.randn(t, width, generator=gen).to("cuda", dtype)
    k = qkv[:, offset + h * d : offset + (h + hkv) * d].view(t, hkv, d)
    v = qkv[:, offset + (h + hkv) * d :].view(t, hkv, d)
    return k, v


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize(
    "t,h,hkv,d,offset",
    [
        (1, 8, 8, 128, 0),
        (37, 32, 8, 128, 0),
        (256, 16, 4, 64, 0),
        (19, 4, 2, 24, 0),
        (33, 8, 2, 64, 1),
        (5, 8, 1, 256, 2),
    ],  # fmt: skip
)
def test_write_kv_cache_matches_reference(
    t: int, h: int, hkv: int, d: int, offset: int, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(t * 131 + d)
    num_blocks, bs = 64, 16
    k, v = _views(t, h, hkv, d, dtype, offset, gen)
    slots = torch.randperm(num_blocks * bs, generator=gen)[:t]
    slots[::5] = -1  # padding tokens: must not be written
    slots = slots.cuda()
    shape = (num_blocks, bs, hkv, d)
    kc = torch.full(shape, float("nan"), dtype=dtype, device="cuda")
    vc = torch.full(shape, float("nan"), dtype=dtype, device="cuda")
    kc_ref, vc_ref = kc.clone(), vc.clone()
    keep = slots >= 0
    reference.write_kv_cache(k[keep], v[keep], kc_ref, vc_ref, slots[keep])
    cuda_ops.write_kv_cache(k, v, kc, vc, slots)
    torch.cuda.synchronize()
    torch.testing.assert_close(kc, kc_ref, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(vc, vc_ref, atol=0, rtol=0, equal_nan=True)


def test_write_kv_cache_checks() -> None:
    kc = torch.zeros(4, 16, 2, 64, dtype=torch.float16, device="cuda")
    k = torch.zeros(3, 2, 64, dtype=torch.float16, device="cuda")
    with pytest.raises(ValueError, match="slot_mapping must be int64"):
        cuda_ops.write_kv_cache(k, k, kc, kc.clone(), torch.zeros(3, dtype=torch.int32).cuda())
    with pytest.raises(ValueError, match="key must be"):
        cuda_ops.write_kv_cache(k[:, :1], k[:, :1], kc, kc.clone(), torch.zeros(3).long().cuda())
