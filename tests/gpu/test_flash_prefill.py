"""FlashAttention-2 prefill (``kernels.flash_prefill``, torch's variable-length kernel) against
the torch reference on random batches: whole prompts (read from the step's own K/V) and chunks
after a cached prefix (contexts gathered from the paged cache), decodes in the same step (left
to the decode kernel), GQA ratios 1-8, head sizes 64-256, contexts up to 8192, float16 and
bfloat16; unused cache slots and the output NaN-poisoned. Then the cuda backend with the flash
prefill on: the engine's attention (decode kernel + flash prefill) equals the reference."""

from __future__ import annotations

import functools
import random

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from kernels import flash_prefill, reference  # noqa: E402
from tests.gpu.helpers import ATTN_TOL, AttentionCase, make_case  # noqa: E402

_case = functools.partial(make_case, index_dtype=torch.int32)
DTYPES = [torch.float16, torch.bfloat16]


def _lens(n: int, lo: int, hi: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(lo, hi) for _ in range(n)]


def _check(case: AttentionCase, with_new_kv: bool) -> None:
    meta = case.meta
    reason = flash_prefill.unsupported(case.query.device, case.query.dtype, case.query.shape[-1])
    if reason is not None:
        pytest.skip(reason)
    want = reference.paged_attention(case.query, case.key_cache, case.value_cache, meta, case.scale)
    new_kv = None
    if with_new_kv:
        flat = (case.key_cache.flatten(0, 1), case.value_cache.flatten(0, 1))
        new_kv = (flat[0][meta.slot_mapping], flat[1][meta.slot_mapping])
    case.poison_unused_slots()
    out = torch.full_like(case.query, float("nan"))
    flash_prefill.prefill(
        out, case.query, case.key_cache, case.value_cache, meta, case.scale, new_kv
    )
    torch.cuda.synchronize()
    rows = slice(meta.query_start_loc_cpu[meta.num_decodes], meta.num_tokens)
    assert out[: rows.start].isnan().all(), "the decode rows are not the prefill's to write"
    assert not out[rows].isnan().any(), f"{int(out[rows].isnan().sum())} NaN outputs"
    torch.testing.assert_close(out[rows], want[rows], **ATTN_TOL[case.query.dtype])


# (q_lens, seq_lens, num_heads, num_kv_heads, head_dim)
PREFILL = [
    ([5], [5], 8, 8, 64),
    ([300], [300], 32, 8, 128),
    ([2048], [2048], 16, 8, 128),
    ([8192], [8192], 16, 8, 128),  # the Qwen3-0.6B chunk
    ([64], [2064], 32, 4, 128),  # a chunk after a long cached prefix
    ([1024], [2048], 16, 8, 128),
    ([1, 1, 40, 33, 100], [20, 600, 40, 70, 1000], 32, 8, 128),  # decodes, then prefills
    ([31, 32, 33, 65], [31, 48, 100, 65], 16, 16, 64),
    (_lens(16, 1, 80, 7), [s + 200 for s in _lens(16, 0, 80, 8)], 8, 1, 128),  # GQA 8
    ([16] * 64, [400] * 64, 16, 8, 128),  # prefix-hit tails
    ([70], [90], 8, 8, 256),
    ([17, 9], [17, 50], 8, 2, 96),
]


@pytest.mark.parametrize("with_new_kv", [True, False], ids=["new_kv", "gathered"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("spec", PREFILL, ids=lambda s: f"r{len(s[0])}-h{s[2]}/{s[3]}-d{s[4]}")
def test_flash_prefill_matches_reference(
    spec: tuple, dtype: torch.dtype, with_new_kv: bool
) -> None:
    q_lens, seq_lens, h, hkv, d = spec
    seq_lens = [max(s, q) for q, s in zip(q_lens, seq_lens, strict=True)]
    _check(_case(q_lens, seq_lens, h, hkv, d, dtype), with_new_kv)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_backend_with_flash_prefill(dtype: torch.dtype) -> None:
    pytest.importorskip("cupy", reason="the decode kernel loads through CuPy")
    from kernels.attention_backends import CudaAttention

    if flash_prefill.unsupported(torch.device("cuda"), dtype, 128):
        pytest.skip("no FlashAttention-2 here")
    case = _case([1, 1, 1, 40, 16, 300], [900, 33, 5000, 40, 400, 300], 16, 8, 128, dtype)
    want = reference.paged_attention(case.query, case.key_cache, case.value_cache, case.meta,
                                     case.scale)  # fmt: skip
    case.poison_unused_slots()
    got = CudaAttention(flash_prefill=True).forward(
        case.query, case.key_cache, case.value_cache, case.meta, case.scale
    )
    torch.cuda.synchronize()
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, **ATTN_TOL[dtype])
