"""The CPU attention backend against the torch reference on random paged batches: the C decode
kernel (kernels/paged_decode_cpu.c) for every head size, GQA group and dtype the models use,
block-boundary lengths, unused cache slots poisoned with NaN; the whole backend on mixed batches;
and the fallback when there is no C compiler."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kernels import cpu, cpu_ops, reference
from kernels.attention_backends import CpuAttention, TorchAttention, select_kernels
from tests.gpu.helpers import ATTN_TOL, AttentionCase, make_case

pytestmark = pytest.mark.skipif(cpu.compiler() is None, reason="no C compiler")
LENGTHS = [1, 2, 15, 16, 17, 31, 32, 33, 100, 257]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cpu_kernels")


def _decode(lib: object, case: AttentionCase) -> torch.Tensor:
    """The C kernel on every request of ``case`` (all decodes)."""
    return cpu_ops.paged_decode(
        lib,  # type: ignore[arg-type]
        case.query,
        case.key_cache,
        case.value_cache,
        case.meta.block_tables.to(torch.int32).contiguous(),
        case.meta.seq_lens.to(torch.int32),
        case.scale,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"),
    [(4, 2, 24), (8, 4, 64), (14, 2, 64), (16, 8, 128), (8, 8, 128)],
)
def test_decode_kernel_matches_the_reference(
    cache_dir: Path, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int
) -> None:
    case = make_case([1] * len(LENGTHS), LENGTHS, heads, kv_heads, head_dim, dtype, device="cpu")
    meta = case.meta
    want = reference.paged_attention(case.query, case.key_cache, case.value_cache, meta, case.scale)
    case.poison_unused_slots()  # a read of any slot outside a context would give NaN
    got = _decode(cpu_ops.load(head_dim, 16, cache_dir), case)
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, **ATTN_TOL[dtype])


def _has_avx512() -> bool:
    try:
        return " avx512f" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


@pytest.mark.parametrize("build", ["native", "portable"])
@pytest.mark.parametrize("num_reqs", [2, 40], ids=["task-per-kv-head", "task-per-request"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_both_builds_and_both_task_splits(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, build: str, num_reqs: int, dtype: torch.dtype
) -> None:
    """The AVX-512 block step (where the CPU has it) and the portable loops, with a task per
    request's KV head (few requests) and a task per request (enough to fill every thread)."""
    if build == "portable":
        if not _has_avx512():
            pytest.skip("the native build is already the portable one on this CPU")
        monkeypatch.setattr(cpu, "FLAGS", (*cpu.FLAGS, "-mno-avx512f"))
    cpu.library.cache_clear()
    lengths = [(7 * i + 1) % 70 + 1 for i in range(num_reqs)]
    case = make_case([1] * num_reqs, lengths, 8, 2, 64, dtype, device="cpu")
    meta = case.meta
    want = reference.paged_attention(case.query, case.key_cache, case.value_cache, meta, case.scale)
    case.poison_unused_slots()
    try:
        lib = cpu_ops.load(64, 16, tmp_path)
        for threads in (1, 2):  # the split depends on the thread count
            with torch_threads(threads):
                got = _decode(lib, case)
            assert not got.isnan().any()
            torch.testing.assert_close(got, want, **ATTN_TOL[dtype])
    finally:
        cpu.library.cache_clear()


class torch_threads:  # noqa: N801 - used like a function
    def __init__(self, n: int) -> None:
        self.n, self.before = n, torch.get_num_threads()

    def __enter__(self) -> None:
        torch.set_num_threads(self.n)

    def __exit__(self, *exc: object) -> None:
        torch.set_num_threads(self.before)


@pytest.mark.parametrize("block_size", [8, 32])
def test_other_block_sizes(cache_dir: Path, block_size: int) -> None:
    lengths = [1, block_size - 1, block_size, block_size + 1, 5 * block_size + 3]
    case = make_case(
        [1] * len(lengths), lengths, 8, 2, 64, torch.float32, block_size=block_size, device="cpu"
    )
    want = TorchAttention().forward(
        case.query, case.key_cache, case.value_cache, case.meta, case.scale
    )
    case.poison_unused_slots()
    backend = select_kernels("cpu", torch.device("cpu"), torch.float32, 64, block_size, cache_dir)
    got = backend.attention.forward(
        case.query, case.key_cache, case.value_cache, case.meta, case.scale
    )
    torch.testing.assert_close(got, want, **ATTN_TOL[torch.float32])


def test_backend_on_a_mixed_batch(cache_dir: Path) -> None:
    """Decodes through the kernel, prefill chunks (one after a cached prefix) through SDPA."""
    q_lens, seq_lens = [1, 1, 1, 7, 40, 3], [5, 64, 129, 7, 40, 35]
    case = make_case(q_lens, seq_lens, 8, 4, 64, torch.float32, device="cpu")
    kernels = select_kernels("cpu", torch.device("cpu"), torch.float32, 64, 16, cache_dir)
    assert isinstance(kernels.attention, CpuAttention)
    got = kernels.attention.forward(
        case.query, case.key_cache, case.value_cache, case.meta, case.scale
    )
    want = TorchAttention().forward(
        case.query, case.key_cache, case.value_cache, case.meta, case.scale
    )
    torch.testing.assert_close(got, want, **ATTN_TOL[torch.float32])


def test_wrapper_rejects_what_the_kernel_cannot_take(cache_dir: Path) -> None:
    lib = cpu_ops.load(64, 16, cache_dir)
    case = make_case([1, 1], [3, 20], 8, 4, 64, torch.float32, device="cpu")
    tables, lens = case.meta.block_tables.to(torch.int32), case.meta.seq_lens.to(torch.int32)
    args = (case.key_cache, case.value_cache)
    with pytest.raises(ValueError, match="float32 and bfloat16"):
        cpu_ops.paged_decode(lib, case.query.half(), *args, tables, lens, 1.0)
    with pytest.raises(ValueError, match="int32"):
        cpu_ops.paged_decode(lib, case.query, *args, case.meta.block_tables, lens, 1.0)
    with pytest.raises(ValueError, match="multiple"):
        cpu_ops.paged_decode(lib, case.query[:, :6].contiguous(), *args, tables, lens, 1.0)
    with pytest.raises(ValueError, match="key_cache must be"):
        cpu_ops.paged_decode(lib, case.query, case.key_cache.double(), *args[1:], tables, lens, 1.0)


def test_without_a_compiler_auto_falls_back_to_torch(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(cpu, "compiler", lambda: None)
    cpu.library.cache_clear()
    try:
        kernels = select_kernels("auto", torch.device("cpu"), torch.float32, 64, 16, tmp_path)
        assert kernels.attention.name == "torch"
        with pytest.raises(cpu.CpuKernelUnavailable, match="no C compiler"):
            select_kernels("cpu", torch.device("cpu"), torch.float32, 64, 16, tmp_path)
    finally:
        cpu.library.cache_clear()


def test_the_build_is_cached_on_disk(tmp_path: Path) -> None:
    cpu.library.cache_clear()
    cpu_ops.load(64, 16, tmp_path)
    built = sorted(p.name for p in tmp_path.iterdir())
    assert len(built) == 1 and built[0].startswith("paged_decode_cpu-") and built[0].endswith(".so")
    cpu.library.cache_clear()
    mtime = (tmp_path / built[0]).stat().st_mtime_ns
    cpu_ops.load(64, 16, tmp_path)  # found on disk: not built again
    assert (tmp_path / built[0]).stat().st_mtime_ns == mtime


def test_loading_the_kernel_leaves_the_floating_point_mode_alone(tmp_path: Path) -> None:
    """A -ffast-math shared library carries a constructor that sets flush-to-zero and
    denormals-are-zero for the process; the kernel is linked without it."""
    import subprocess
    import sys

    code = (
        "import sys, torch\n"
        "from pathlib import Path\n"
        "from kernels import cpu_ops\n"
        f"cpu_ops.load(64, 16, Path({str(tmp_path)!r}))\n"
        "tiny = float.fromhex('0x1p-1070')\n"  # a float64 denormal
        "assert tiny * 0.5 > 0.0, 'denormals flushed to zero'\n"
        "assert torch.tensor([1e-40]).mul(1.0).item() > 0.0, 'float32 denormal flushed'\n"
    )
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)
