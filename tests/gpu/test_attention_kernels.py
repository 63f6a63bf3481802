"""CUDA paged attention (paged_decode.cu, paged_prefill.cu) against the torch reference on random
batches: block boundaries, GQA ratios 1/4/7/8, contexts 1..8192, batch 1..256, head sizes 24 to
256. Unused cache slots, the output and the allocator are NaN-poisoned, so a kernel that reads
outside a context or leaves an element unwritten fails. Tolerances: tests/gpu/helpers.ATTN_TOL."""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = pytest.mark.gpu
pytest.importorskip("cupy", reason="the CUDA kernels load through CuPy")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from kernels import cuda_ops, reference  # noqa: E402
from tests.gpu.helpers import ATTN_TOL, AttentionCase, make_case, poison_allocator  # noqa: E402

DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def _check(case: AttentionCase) -> None:
    want = reference.paged_attention(
        case.query, case.key_cache, case.value_cache, case.meta, case.scale
    )
    case.poison_unused_slots()
    poison_allocator()
    out = torch.full_like(case.query, float("nan"))
    got = cuda_ops.paged_attention(
        case.query, case.key_cache, case.value_cache, case.meta, case.scale, out=out
    )
    torch.cuda.synchronize()
    assert got.data_ptr() == out.data_ptr()
    assert not got.isnan().any(), f"{int(got.isnan().sum())} NaN outputs"
    torch.testing.assert_close(got, want, **ATTN_TOL[case.query.dtype])


def _lens(n: int, lo: int, hi: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(lo, hi) for _ in range(n)]


# (seq_lens, num_heads, num_kv_heads, head_dim, block_size)
DECODE = [
    ([1], 8, 8, 128, 16),
    ([15, 16, 17, 31, 32, 33], 32, 8, 128, 16),
    ([511, 512, 513, 1023, 1024, 1025], 32, 4, 128, 16),  # partition boundaries
    ([1, 100, 4097, 777, 8192], 32, 8, 128, 16),
    (_lens(64, 1, 2048, 1), 32, 8, 128, 16),
    (_lens(256, 1, 1024, 2), 16, 4, 64, 16),
    (_lens(7, 1, 3000, 3), 28, 4, 128, 16),  # ratio 7: one head per thread block
    (_lens(9, 1, 1500, 4), 8, 1, 256, 16),
    (_lens(6, 1, 700, 5), 4, 2, 24, 16),  # the tiny test models' head size
    ([8192, 3], 64, 8, 128, 32),
    (_lens(5, 1, 600, 6), 8, 2, 64, 1),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("spec", DECODE, ids=lambda s: f"b{len(s[0])}-h{s[1]}/{s[2]}-d{s[3]}")
def test_decode_matches_reference(spec: tuple, dtype: torch.dtype) -> None:
    seq_lens, h, hkv, d, bs = spec
    _check(make_case([1] * len(seq_lens), seq_lens, h, hkv, d, dtype, block_size=bs))


# (q_lens, seq_lens, num_heads, num_kv_heads, head_dim)
PREFILL = [
    ([5], [5], 8, 8, 64),
    ([300], [300], 32, 8, 128),
    ([64], [2064], 32, 4, 128),  # a chunk after a long cached prefix
    ([1, 1, 40, 33, 100], [20, 600, 40, 70, 1000], 32, 8, 128),  # decodes, then prefills
    ([31, 32, 33, 65], [31, 48, 100, 65], 16, 16, 64),  # BLOCK_M boundaries
    (_lens(16, 1, 80, 7), [s + 200 for s in _lens(16, 0, 80, 8)], 8, 1, 128),
    ([17, 9], [17, 50], 4, 2, 24),
    ([70], [90], 8, 8, 256),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("spec", PREFILL, ids=lambda s: f"r{len(s[0])}-h{s[2]}/{s[3]}-d{s[4]}")
def test_prefill_matches_reference(spec: tuple, dtype: torch.dtype) -> None:
    q_lens, seq_lens, h, hkv, d = spec
    seq_lens = [max(s, q) for q, s in zip(q_lens, seq_lens, strict=True)]
    if dtype == torch.float32 and d > 128:
        pytest.skip("fp32 prefill supports head_dim <= 128")
    _check(make_case(q_lens, seq_lens, h, hkv, d, dtype))


def test_unsupported_head_dim_is_a_clear_error() -> None:
    case = make_case([1], [10], 4, 4, 20, torch.float16)  # 20 halves: not whole 16-byte chunks
    with pytest.raises(ValueError, match="head_dim"):
        cuda_ops.paged_attention(
            case.query, case.key_cache, case.value_cache, case.meta, case.scale
        )


def test_shape_and_dtype_checks() -> None:
    case = make_case([1, 1], [10, 20], 8, 2, 64, torch.float16)
    with pytest.raises(ValueError, match="must match"):
        cuda_ops.paged_attention(
            case.query.float(), case.key_cache, case.value_cache, case.meta, case.scale
        )
    with pytest.raises(ValueError, match="CUDA tensor"):
        cuda_ops.paged_attention(
            case.query.cpu(), case.key_cache, case.value_cache, case.meta, case.scale
        )
