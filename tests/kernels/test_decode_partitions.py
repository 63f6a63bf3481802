"""CPU checks of the CUDA decode's split-K layout and of the launch logic around the kernels, with
fakes for the CUDA calls; and of the new torch references against the model's unfused layers.

- ``decode_partitions``: at least 1, at most what the context bound can use, more for smaller
  batches, 1 for a batch that already fills the GPU.
- ``decode_partition_len`` (the mirror of paged_decode.cu's device-side rule): for many contexts
  and partition counts, the used partitions cover every token exactly once and number at most P;
  its constants equal the kernel's.
- ``DecodeWorkspace`` refuses a launch that does not fit.
- ``paged_attention`` with explicit ``partitions`` launches the grid it was given and reads no
  host-side length; ``preload`` resolves every kernel a model launches.
- ``reference_norm_rope.qk_norm_rope_kv`` equals norm -> lookup -> rotate_neox -> write_kv_cache
  exactly; ``reference.silu_and_mul(out=)`` equals the in-place form.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from engine_svc.models.layers import RMSNorm, RotaryEmbedding
from kernels import cuda, cuda_ops, reference, variants
from kernels import reference_norm_rope as ref
from tests.gpu.helpers import make_case

H100_SMS, H200_SMS = 132, 132


# --------------------------------------------------------------------------------------------
# The partition count and layout


def test_partition_constants_match_the_kernel() -> None:
    source = (cuda.KERNEL_DIR / "paged_decode.cu").read_text()
    for name in ("MIN_PARTITION", "PARTITION_ALIGN"):
        (value,) = re.findall(rf"^#define {name} (\d+)$", source, re.M)
        assert int(value) == getattr(cuda_ops, name), name


@pytest.mark.parametrize("num_sms", [40, 108, 132])
def test_decode_partitions_bounds(num_sms: int) -> None:
    for heads, kv_heads in ((32, 8), (28, 4), (8, 8), (64, 8)):
        for context in (1, 127, 128, 129, 1000, 4096, 32768, 131072):
            cap = -(-context // cuda_ops.MIN_PARTITION)
            previous = None
            for seqs in (256, 64, 16, 4, 1):  # shrinking batches
                p = cuda_ops.decode_partitions(seqs, heads, kv_heads, context, num_sms)
                assert 1 <= p <= max(1, cap), (seqs, heads, kv_heads, context, p)
                if previous is not None:
                    assert p >= previous, "a smaller batch got fewer partitions"
                previous = p
    # Small batch, long context: split; the same context in a full batch: not split.
    assert cuda_ops.decode_partitions(1, 32, 8, 32768, H200_SMS) > 1
    assert cuda_ops.decode_partitions(256, 32, 8, 32768, H200_SMS) == 1  # 1024 blocks >= 528
    assert cuda_ops.decode_partitions(1, 32, 8, 100, H200_SMS) == 1  # one partition's worth
    assert cuda_ops.decode_partitions(0, 32, 8, 0, H200_SMS) == 1


def test_decode_partitions_rule() -> None:
    # GQA 4: four query heads per block, so 8 seqs x 8 = 64 thread blocks; 4 x 132 / 64 -> 9.
    assert cuda_ops.decode_partitions(8, 32, 8, 8192, H100_SMS) == 9
    assert cuda_ops.decode_partitions(8, 32, 8, 1000, H100_SMS) == 8  # capped: ceil(1000 / 128)
    # GQA 7: one query head per block, so 28 blocks per sequence.
    assert cuda_ops.decode_partitions(2, 28, 4, 8192, H100_SMS) == 10


def _ranges(seq_len: int, partitions: int) -> list[range]:
    """The token ranges of the partitions a sequence uses, as paged_decode.cu computes them."""
    length = cuda_ops.decode_partition_len(seq_len, partitions)
    used = -(-seq_len // length)
    return [range(p * length, min((p + 1) * length, seq_len)) for p in range(used)]


@pytest.mark.parametrize("partitions", [*range(1, 41), 64, 100, 1000, cuda_ops.MAX_PARTITIONS])
def test_partition_layout_covers_every_token_once(partitions: int) -> None:
    lengths = [*range(1, 1100), *range(1100, 20000, 37), 65536, 131072, 131073]
    for seq_len in lengths:
        length = cuda_ops.decode_partition_len(seq_len, partitions)
        assert length >= cuda_ops.MIN_PARTITION and length % cuda_ops.PARTITION_ALIGN == 0
        ranges = _ranges(seq_len, partitions)
        assert 1 <= len(ranges) <= partitions, (seq_len, partitions)
        assert all(len(r) > 0 for r in ranges), (seq_len, partitions)  # no empty partition
        tokens = [t for r in ranges for t in r]
        assert tokens == list(range(seq_len)), (seq_len, partitions)


def test_partition_layout_examples() -> None:
    # The examples drawn at the top of paged_decode.cu.
    assert cuda_ops.decode_partition_len(1000, 4) == 256 and len(_ranges(1000, 4)) == 4
    assert cuda_ops.decode_partition_len(300, 4) == 128 and len(_ranges(300, 4)) == 3
    assert len(_ranges(10**6, 7)) == 7  # long contexts use every partition


def test_workspace_refuses_a_launch_that_does_not_fit() -> None:
    ws = cuda_ops.DecodeWorkspace(4, 8, 64, 16, "cpu")
    assert ws.part_out.numel() == 4 * 8 * 16 * 64 and ws.part_max.numel() == 4 * 8 * 16
    assert ws.part_out.dtype == torch.float32
    ws.buffers(4, 8, 64, 16)
    ws.buffers(1, 8, 64, 1)
    ws.buffers(2, 8, 64, 32)  # fewer sequences, more partitions: the same number of rows
    for shape in ((5, 8, 64, 16), (4, 8, 64, 17), (4, 8, 128, 16), (4, 16, 64, 16)):
        with pytest.raises(ValueError, match="too small for a decode launch"):
            ws.buffers(*shape)


# --------------------------------------------------------------------------------------------
# Launch logic, with fakes for compile and launch


@dataclasses.dataclass(frozen=True)
class Launch:
    kernel: str
    grid: tuple[int, ...]
    block: tuple[int, ...]
    args: tuple[Any, ...]
    shared_mem: int


def _clear_handle_caches() -> None:
    for cached in (
        cuda_ops._decode_fns,
        cuda_ops._prefill_fn,
        cuda_ops._norm_fns,
        cuda_ops._silu_fn,
        cuda_ops._kv_cache_fn,
    ):
        cached.cache_clear()


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Launch]]:
    """CPU tensors stand in for CUDA ones; ``cuda.function`` returns the entry point's name and
    ``cuda.launch`` records the call instead of launching."""
    recorded: list[Launch] = []

    def function(source: str, name: str, defines: tuple[tuple[str, int], ...] = ()) -> str:
        error = variants.variant_error(source, defines)
        assert error is None, error
        return name

    def launch(
        kernel: str, grid: tuple[int, ...], block: tuple[int, ...], args: Any, shared_mem: int = 0
    ) -> None:
        recorded.append(Launch(kernel, grid, block, tuple(args), shared_mem))

    monkeypatch.setattr(cuda_ops, "_on", lambda *a, **k: None)
    monkeypatch.setattr(cuda, "function", function)
    monkeypatch.setattr(cuda, "launch", launch)
    monkeypatch.setattr(cuda_ops, "num_sms", lambda device: H100_SMS)
    _clear_handle_caches()
    yield recorded
    _clear_handle_caches()


class _NoHostLengths(list[int]):
    """Host-side lengths the decode path must not read when given ``partitions``."""

    def __getitem__(self, index: Any) -> Any:
        raise AssertionError("seq_lens_cpu read")

    def __iter__(self) -> Iterator[int]:
        raise AssertionError("seq_lens_cpu read")


@pytest.mark.parametrize("partitions", [1, 2, 5])
def test_decode_with_partitions_reads_no_host_lengths(
    launches: list[Launch], partitions: int
) -> None:
    case = make_case([1] * 3, [700, 5, 300], 8, 2, 64, torch.bfloat16, device="cpu",
                     index_dtype=torch.int32)  # fmt: skip
    meta = dataclasses.replace(case.meta, seq_lens_cpu=_NoHostLengths(), max_decode_seq_len=0)
    ws = cuda_ops.DecodeWorkspace(4, 8, 64, 8, "cpu")
    out = cuda_ops.paged_attention(
        case.query, case.key_cache, case.value_cache, meta, case.scale,
        partitions=partitions, workspace=ws,
    )  # fmt: skip
    assert out.shape == case.query.shape
    decode = launches[0]
    assert decode.kernel == "paged_decode_bf16_q4"  # GQA 4: four query heads per block
    assert decode.grid == (2, 3, partitions) and decode.block == (cuda_ops.DECODE_THREADS,)
    assert int(decode.args[7]) == meta.block_tables.data_ptr()  # int32 tables, used as they are
    assert int(decode.args[8]) == meta.seq_lens.data_ptr()
    assert int(decode.args[15]) == partitions
    if partitions == 1:
        assert len(launches) == 1 and int(decode.args[1]) == 0  # direct write, no partials
        return
    assert int(decode.args[1]) == ws.part_out.data_ptr()
    assert int(decode.args[2]) == ws.part_max.data_ptr()
    (reduce,) = launches[1:]
    assert reduce.kernel == "paged_decode_reduce_bf16"
    assert reduce.grid == (8, 3) and reduce.shared_mem == 4 * partitions
    assert int(reduce.args[6]) == partitions


def test_tiled_decode_launches_its_entry_with_the_same_grid_and_args(
    launches: list[Launch],
) -> None:
    case = make_case([1] * 3, [700, 5, 300], 16, 8, 128, torch.bfloat16, device="cpu",
                     index_dtype=torch.int32)  # fmt: skip
    ws = cuda_ops.DecodeWorkspace(4, 16, 128, 8, "cpu")
    args = (case.query, case.key_cache, case.value_cache, case.meta, case.scale)
    cuda_ops.paged_attention(*args, partitions=3, workspace=ws)
    cuda_ops.paged_attention(*args, partitions=3, workspace=ws, tiled_decode=True)
    (plain, plain_reduce), (tiled, tiled_reduce) = launches[:2], launches[2:]
    assert plain.kernel == "paged_decode_bf16_q2" and tiled.kernel == "paged_decode_tiled_bf16_q2"
    assert tiled.grid == plain.grid and tiled.block == plain.block
    assert [int(a) for a in tiled.args[4:]] == [int(a) for a in plain.args[4:]]
    assert tiled_reduce.kernel == plain_reduce.kernel == "paged_decode_reduce_bf16"


def test_queries_per_block_picks_the_entry_and_the_grid(launches: list[Launch]) -> None:
    """GQA 4 (32/8): the widest width by default, another on request (the sweep's knob), and a
    width that is not built or does not divide the group refused before any launch."""
    case = make_case([1] * 3, [700, 5, 300], 32, 8, 128, torch.bfloat16, device="cpu",
                     index_dtype=torch.int32)  # fmt: skip
    ws = cuda_ops.DecodeWorkspace(4, 32, 128, 8, "cpu")
    args = (case.query, case.key_cache, case.value_cache, case.meta, case.scale)
    for qpb in (None, 1, 2, 4):
        launches.clear()
        cuda_ops.paged_attention(*args, partitions=1, workspace=ws, queries_per_block=qpb)
        width = qpb or 4
        assert [(x.kernel, x.grid) for x in launches] == [
            (f"paged_decode_bf16_q{width}", (32 // width, 3, 1))
        ]
    launches.clear()
    for bad in (3, 8, 0):
        with pytest.raises(ValueError, match="queries_per_block must be"):
            cuda_ops.paged_attention(*args, partitions=1, workspace=ws, queries_per_block=bad)
    assert launches == []


def test_decode_without_partitions_uses_the_policy(launches: list[Launch]) -> None:
    case = make_case([1, 1], [3000, 20], 32, 8, 128, torch.float16, device="cpu")  # int64
    cuda_ops.paged_attention(case.query, case.key_cache, case.value_cache, case.meta, 1.0)
    want = cuda_ops.decode_partitions(2, 32, 8, 3000, H100_SMS)
    assert launches[0].grid == (8, 2, want) and want > 1
    tables = launches[0].args[7]
    assert int(tables) != case.meta.block_tables.data_ptr()  # int64 converted to int32
    assert launches[1].kernel == "paged_decode_reduce_f16"


def test_preload_resolves_every_kernel_a_model_launches(launches: list[Launch]) -> None:
    cuda_ops.preload(torch.bfloat16, 128)
    names = set(cuda_ops._decode_fns(torch.bfloat16, 128).by_qpb.values())
    names |= set(cuda_ops._decode_fns(torch.bfloat16, 128).tiled_by_qpb.values())
    names.add(cuda_ops._decode_fns(torch.bfloat16, 128).reduce)
    names.add(cuda_ops._prefill_fn(torch.bfloat16, 128))
    names |= {cuda_ops._kv_cache_fn(u) for u in (16, 4, 2)}
    norm = cuda_ops._norm_fns(torch.bfloat16)
    names |= {norm.rms_norm, norm.rotary, norm.qk_norm_rope_kv, cuda_ops._silu_fn(torch.bfloat16)}
    assert names == {
        *(f"paged_decode_bf16_q{q}" for q in (1, 2, 4, 8)),
        *(f"paged_decode_tiled_bf16_q{q}" for q in (1, 2, 4, 8)),
        "paged_decode_reduce_bf16",
        "paged_prefill_bf16",
        "write_kv_cache_b16",
        "write_kv_cache_b4",
        "write_kv_cache_b2",
        "rms_norm_bf16",
        "rotary_neox_bf16",
        "qk_norm_rope_kv_bf16",
        "silu_and_mul_bf16",
    }
    with pytest.raises(ValueError, match="prefill attention .* at most 128"):
        cuda_ops.preload(torch.float32, 256)
    assert not launches


def test_silu_and_mul_picks_16_byte_units_when_rows_allow(launches: list[Launch]) -> None:
    gate_up = torch.randn(3, 2 * 64, dtype=torch.float16)
    out = cuda_ops.silu_and_mul(gate_up)
    assert out.shape == (3, 64) and out.is_contiguous()
    (vec,) = launches
    assert vec.kernel == "silu_and_mul_f16" and vec.grid == (3, 1) and int(vec.args[4]) == 1
    wide = torch.randn(3, 2 * 64 + 1, dtype=torch.float16)
    cuda_ops.silu_and_mul(wide[:, 1:])  # rows start 2 bytes in: one element at a time
    assert int(launches[1].args[4]) == 0 and int(launches[1].args[3]) == 2 * 64 + 1
    cuda_ops.silu_and_mul(torch.randn(5, 2 * 30000, dtype=torch.float32))
    assert launches[2].grid == (5, -(-(30000 // 4) // cuda_ops.ACT_THREADS))


def test_qk_norm_rope_kv_launch_and_view(launches: list[Launch]) -> None:
    t, h, hkv, d = 5, 28, 4, 128
    qkv = torch.randn(t, (h + 2 * hkv) * d, dtype=torch.bfloat16)
    cos, sin = torch.ones(64, 64), torch.zeros(64, 64)
    kc = torch.zeros(4, 16, hkv, d, dtype=torch.bfloat16)
    positions = torch.arange(t)
    q = cuda_ops.qk_norm_rope_kv(qkv, positions, cos, sin, None, None, 1e-6, kc, kc.clone(),
                                 positions.clone(), h, hkv)  # fmt: skip
    assert q.shape == (t, h, d) and q.data_ptr() == qkv.data_ptr()
    (launch,) = launches
    assert launch.kernel == "qk_norm_rope_kv_bf16"
    assert launch.grid == (t, 9) and launch.block == (cuda_ops.QKV_WARPS * 32,)  # 36 rows / 4
    assert int(launch.args[7]) == 0 and int(launch.args[8]) == 0  # no q/k norm weights
    assert int(launch.args[13]) == 64  # rot_dim


# --------------------------------------------------------------------------------------------
# The references against the model's unfused layers


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    ("norms", "partial"), [(True, 1.0), (False, 1.0), (True, 0.5), (False, 0.25)]
)
@torch.no_grad()  # as the engine runs the model
def test_qk_norm_rope_kv_reference_equals_the_unfused_layers(
    dtype: torch.dtype, norms: bool, partial: float
) -> None:
    torch.manual_seed(0)
    t, h, hkv, d, eps = 9, 4, 2, 32, 1e-6
    rope = RotaryEmbedding(d, 512, {"rope_theta": 10000.0, "partial_rotary_factor": partial})
    qkv = torch.randn(t, (h + 2 * hkv) * d + 3, dtype=dtype)[:, : (h + 2 * hkv) * d]
    positions = torch.randint(0, 512, (t,))
    slots = torch.randperm(8 * 4)[:t]
    slots[3] = -1  # a padding token
    kc = torch.full((8, 4, hkv, d), float("nan"), dtype=dtype)
    vc = kc.clone()
    q_norm = k_norm = None
    if norms:
        q_norm, k_norm = RMSNorm(d, eps).to(dtype), RMSNorm(d, eps).to(dtype)
        q_norm.weight.add_(torch.randn(d, dtype=dtype) * 0.1)
        k_norm.weight.add_(torch.randn(d, dtype=dtype) * 0.1)

    # The model's unfused path (engine_svc.models.llama.Attention with the torch kernels).
    q, k, v = qkv.split([h * d, hkv * d, hkv * d], dim=-1)
    q, k, v = q.view(t, h, d), k.view(t, hkv, d), v.view(t, hkv, d)
    if q_norm is not None and k_norm is not None:
        q, k = q_norm.norm(q), k_norm.norm(k)
    want_q, want_k = rope.rotate(q, k, rope.lookup(positions, dtype))
    want_kc, want_vc = kc.clone(), vc.clone()
    reference.write_kv_cache(want_k, v, want_kc, want_vc, slots)

    fused = qkv.clone()
    v_before = fused[:, (h + hkv) * d :].clone()
    got_q = ref.qk_norm_rope_kv(
        fused, positions, rope.cos, rope.sin,
        None if q_norm is None else q_norm.weight,
        None if k_norm is None else k_norm.weight,
        eps, kc, vc, slots, h, hkv,
    )  # fmt: skip
    assert got_q.data_ptr() == fused.data_ptr() and got_q.shape == (t, h, d)
    assert torch.equal(got_q, want_q)
    assert torch.equal(fused[:, h * d : (h + hkv) * d].view(t, hkv, d), want_k)
    assert torch.equal(fused[:, (h + hkv) * d :], v_before)
    torch.testing.assert_close(kc, want_kc, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(vc, want_vc, atol=0, rtol=0, equal_nan=True)
    # The padding token's K/V are nowhere; every other slot no token maps to is untouched.
    written = int((~kc.isnan()).all(-1).all(-1).sum())
    assert written == t - 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_silu_and_mul_reference_out(dtype: torch.dtype) -> None:
    gate_up = torch.randn(2, 5, 2 * 24, dtype=dtype) * 3
    before = gate_up.clone()
    out = torch.full((2, 5, 24), float("nan"), dtype=dtype)
    assert reference.silu_and_mul(gate_up, out=out) is out
    assert torch.equal(gate_up, before), "gate_up was written"
    in_place = reference.silu_and_mul(gate_up.clone())
    assert torch.equal(out, in_place)
