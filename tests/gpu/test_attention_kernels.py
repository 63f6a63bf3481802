"""CUDA paged attention (paged_decode.cu, paged_prefill.cu) against the torch reference on random
batches: block boundaries, GQA ratios 1/4/7/8, contexts 1..8192, batch 1..256, head sizes 24 to
256, int32 block tables (the engine's) and int64 ones (converted by the wrapper). Unused cache
slots, the output, the allocator and the split-K workspace are NaN-poisoned, so a kernel that
reads outside a context or leaves an element unwritten fails. Tolerances:
tests/gpu/helpers.ATTN_TOL.

The decode kernel's tiled variant (``tiled_decode=True``) runs the same decode cases.

Split-K: the decode result does not depend on the partition count (P = 1, 2, 7 and the policy's
value, contexts crossing partition and block boundaries), and a decode launch captured in a CUDA
graph and replayed after its inputs changed in place gives the same bits as an eager launch on
the changed inputs."""

from __future__ import annotations

import dataclasses
import functools
import random

import pytest
import torch

pytestmark = pytest.mark.gpu
pytest.importorskip("cupy", reason="the CUDA kernels load through CuPy")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from kernels import cuda_ops, reference  # noqa: E402
from tests.gpu.helpers import ATTN_TOL, DTYPES, AttentionCase, make_case, poison_allocator  # noqa: E402


def _check(case: AttentionCase, tiled: bool = False) -> None:
    want = reference.paged_attention(
        case.query, case.key_cache, case.value_cache, case.meta, case.scale
    )
    case.poison_unused_slots()
    poison_allocator()
    out = torch.full_like(case.query, float("nan"))
    got = cuda_ops.paged_attention(
        case.query, case.key_cache, case.value_cache, case.meta, case.scale, out=out,
        tiled_decode=tiled,
    )  # fmt: skip
    torch.cuda.synchronize()
    assert got.data_ptr() == out.data_ptr()
    assert not got.isnan().any(), f"{int(got.isnan().sum())} NaN outputs"
    torch.testing.assert_close(got, want, **ATTN_TOL[case.query.dtype])


# make_case with the engine's int32 block tables, seq_lens and query_start_loc.
_case = functools.partial(make_case, index_dtype=torch.int32)


def _lens(n: int, lo: int, hi: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(lo, hi) for _ in range(n)]


# (seq_lens, num_heads, num_kv_heads, head_dim, block_size)
DECODE = [
    ([1], 8, 8, 128, 16),
    ([15, 16, 17, 31, 32, 33], 32, 8, 128, 16),
    ([127, 128, 129, 255, 256, 257], 32, 4, 128, 16),  # MIN_PARTITION boundaries
    ([511, 512, 513, 1023, 1024, 1025], 32, 4, 128, 16),
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
@pytest.mark.parametrize("tiled", [False, True], ids=["plain", "tiled"])
def test_decode_matches_reference(spec: tuple, dtype: torch.dtype, tiled: bool) -> None:
    seq_lens, h, hkv, d, bs = spec
    _check(_case([1] * len(seq_lens), seq_lens, h, hkv, d, dtype, block_size=bs), tiled)


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
    _check(_case(q_lens, seq_lens, h, hkv, d, dtype))


@pytest.mark.parametrize("q_lens", [[1, 1, 1], [1, 1, 40]], ids=["decode", "mixed"])
def test_int64_block_tables_are_converted(q_lens: list[int]) -> None:
    """Tests (and the torch reference) may hand int64 tables and lengths: the wrapper converts
    them, and a table that is a strided view (a column slice) too."""
    _check(make_case(q_lens, [700, 33, 90], 8, 2, 64, torch.bfloat16))
    case = _case(q_lens, [700, 33, 90], 8, 2, 64, torch.float16)
    wide = torch.zeros(3, 2 * case.meta.block_tables.shape[1], dtype=torch.int32, device="cuda")
    wide[:, ::2] = case.meta.block_tables
    case.meta = dataclasses.replace(case.meta, block_tables=wide[:, ::2])
    _check(case)


# (seq_lens, num_heads, num_kv_heads, head_dim, block_size): contexts on both sides of
# partition lengths for P = 2 and 7 (multiples of 16, at least 128) and of block boundaries.
SPLITS = [
    ([1, 127, 128, 129, 256, 257, 895, 896, 897, 1000, 4097], 32, 8, 128, 16),
    (_lens(12, 1, 5000, 9), 16, 2, 64, 32),
    (_lens(5, 100, 2000, 10), 4, 2, 24, 16),
    (_lens(3, 1, 3000, 11), 8, 1, 256, 16),
]


@pytest.mark.parametrize("tiled", [False, True], ids=["plain", "tiled"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("spec", SPLITS, ids=lambda s: f"b{len(s[0])}-h{s[1]}/{s[2]}-d{s[3]}")
def test_decode_is_the_same_for_every_partition_count(
    spec: tuple, dtype: torch.dtype, tiled: bool
) -> None:
    seq_lens, h, hkv, d, bs = spec
    case = _case([1] * len(seq_lens), seq_lens, h, hkv, d, dtype, block_size=bs)
    args = (case.query, case.key_cache, case.value_cache, case.meta, case.scale)
    want = reference.paged_attention(*args)
    case.poison_unused_slots()
    dev = case.query.device
    policy = cuda_ops.decode_partitions(len(seq_lens), h, hkv, max(seq_lens), cuda_ops.num_sms(dev))
    counts = sorted({1, 2, 7, policy})
    # Every query-heads-per-block choice the group allows (kernels_decode.py --sweep's knob).
    widths = [n for n in (1, 2, 4, 8) if (h // hkv) % n == 0]
    workspace = cuda_ops.DecodeWorkspace(len(seq_lens), h, d, max(counts), dev)
    results = []
    for p, qpb in ((p, n) for p in counts for n in widths):
        for buf in (workspace.part_out, workspace.part_max, workspace.part_sum):
            buf.fill_(float("nan"))
        out = torch.full_like(case.query, float("nan"))
        cuda_ops.paged_attention(
            *args, out=out, partitions=p, workspace=workspace, tiled_decode=tiled,
            queries_per_block=qpb,
        )  # fmt: skip
        torch.cuda.synchronize()
        label = f"P={p} qpb={qpb}"
        assert not out.isnan().any(), f"{label}: {int(out.isnan().sum())} NaN outputs"
        torch.testing.assert_close(out, want, **ATTN_TOL[dtype], msg=lambda m, s=label: f"{s}: {m}")
        results.append((label, out))
    for label, out in results[1:]:
        torch.testing.assert_close(
            out, results[0][1], **ATTN_TOL[dtype], msg=lambda m, s=label: f"{s} vs first: {m}"
        )


def test_workspace_too_small_is_a_clear_error() -> None:
    case = _case([1, 1], [600, 20], 8, 2, 64, torch.float16)
    args = (case.query, case.key_cache, case.value_cache, case.meta, case.scale)
    small = cuda_ops.DecodeWorkspace(1, 8, 64, 4, "cuda")
    with pytest.raises(ValueError, match="too small"):
        cuda_ops.paged_attention(*args, partitions=4, workspace=small)
    with pytest.raises(ValueError, match="partitions must be"):
        cuda_ops.paged_attention(*args, partitions=0)
    for qpb in (3, 8):  # not a width built / not a divisor of the group of 4
        with pytest.raises(ValueError, match="queries_per_block must be"):
            cuda_ops.paged_attention(*args, partitions=2, workspace=small, queries_per_block=qpb)
    cuda_ops.paged_attention(*args, partitions=2, workspace=small)  # 2 x 8 x 2 rows fit 1 x 8 x 4


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_graph_replay_equals_eager(dtype: torch.dtype) -> None:
    """The engine's use: one decode launch captured per batch size with ``partitions`` from the
    context bound and a fixed workspace, replayed each step after the step's query, seq_lens and
    block tables were written into the same tensors. The replay must give exactly the eager
    launch's bits on the new inputs, whatever the contexts."""
    bound, (h, hkv, d) = 3000, (32, 8, 128)
    first = [3000, 1, 129, 700, 2048, 17, 1500, 2999]
    case = _case([1] * len(first), first, h, hkv, d, dtype)
    b, dev = len(first), case.query.device
    partitions = cuda_ops.decode_partitions(b, h, hkv, bound, cuda_ops.num_sms(dev))
    assert partitions > 1, "the test needs a split launch"
    workspace = cuda_ops.DecodeWorkspace(b, h, d, partitions, dev)
    for buf in (workspace.part_out, workspace.part_max, workspace.part_sum):
        buf.fill_(float("nan"))
    # The graph's metadata carries host-side lengths that are wrong for every later step: the
    # decode path with explicit partitions must not read them.
    meta = dataclasses.replace(case.meta, seq_lens_cpu=[1] * b, max_decode_seq_len=1)
    out = torch.full_like(case.query, float("nan"))

    def run() -> torch.Tensor:
        return cuda_ops.paged_attention(
            case.query, case.key_cache, case.value_cache, meta, case.scale,
            out=out, partitions=partitions, workspace=workspace,
        )  # fmt: skip

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture, as torch advises
        run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()

    # A new step in the same tensors: other contexts, other blocks, another query.
    lens = [5, 3000, 2048, 1, 130, 999, 2500, 64]
    gen = torch.Generator().manual_seed(1)
    num_blocks = case.key_cache.shape[0]
    tables = torch.randint(1, num_blocks, tuple(meta.block_tables.shape), generator=gen)
    meta.block_tables.copy_(tables.to(torch.int32))
    meta.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
    case.query.copy_(torch.randn(case.query.shape, generator=gen).to(dtype))
    out.fill_(float("nan"))
    graph.replay()
    replayed = out.clone()
    eager = cuda_ops.paged_attention(
        case.query, case.key_cache, case.value_cache, meta, case.scale,
        partitions=partitions, workspace=workspace,
    )  # fmt: skip
    torch.cuda.synchronize()
    assert not replayed.isnan().any(), f"{int(replayed.isnan().sum())} NaN outputs"
    assert torch.equal(replayed, eager), "replay differs from the eager launch"
    now = dataclasses.replace(meta, seq_lens_cpu=lens, max_decode_seq_len=max(lens))
    want = reference.paged_attention(case.query, case.key_cache, case.value_cache, now, case.scale)
    torch.testing.assert_close(replayed, want, **ATTN_TOL[dtype])


def test_unsupported_head_dim_is_a_clear_error() -> None:
    case = _case([1], [10], 4, 4, 20, torch.float16)  # 20 halves: not whole 16-byte chunks
    with pytest.raises(ValueError, match="head_dim"):
        cuda_ops.paged_attention(
            case.query, case.key_cache, case.value_cache, case.meta, case.scale
        )


def test_shape_and_dtype_checks() -> None:
    case = _case([1, 1], [10, 20], 8, 2, 64, torch.float16)
    with pytest.raises(ValueError, match="must match"):
        cuda_ops.paged_attention(
            case.query.float(), case.key_cache, case.value_cache, case.meta, case.scale
        )
    with pytest.raises(ValueError, match="CUDA tensor"):
        cuda_ops.paged_attention(
            case.query.cpu(), case.key_cache, case.value_cache, case.meta, case.scale
        )
