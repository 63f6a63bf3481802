"""Every CUDA C source builds for Hopper (sm_90) with nvcc, with the options CuPy uses at run
time, exports the entry points the wrappers launch, and neither spills nor warns. Runs on CPU;
prints each kernel's registers and shared memory (``pytest -s`` to see them)."""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kernels import cuda


def _nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    candidates = sorted(glob.glob("/usr/local/cuda*/bin/nvcc"))
    return candidates[-1] if candidates else None


NVCC = _nvcc()
pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc not found (PATH, /usr/local/cuda*)")

_DTYPES = ("f16", "bf16", "f32")


def _expected(source: str, defines: Mapping[str, int]) -> set[str]:
    if source == "cache_ops.cu":
        return {f"write_kv_cache_b{u}" for u in (16, 4, 2)}
    if source == "norm_rope.cu":
        return {f"{k}_{s}" for k in ("rms_norm", "rotary_neox") for s in _DTYPES}
    if source == "paged_decode.cu":
        return {f"paged_decode_{s}_q{q}" for s in _DTYPES for q in (1, 2, 4, 8)} | {
            f"paged_decode_reduce_{s}" for s in _DTYPES
        }
    if source == "paged_prefill.cu":
        fp32 = {"paged_prefill_f32"} if defines["HEAD_DIM"] * 4 <= 512 else set()
        return {"paged_prefill_f16", "paged_prefill_bf16"} | fp32
    raise AssertionError(f"no expectations for {source}")


def _compile(source: str, defines: Mapping[str, int], out: Path) -> subprocess.CompletedProcess:
    assert NVCC is not None
    cmd = [
        NVCC, "-arch=sm_90", "-cubin", "--resource-usage", *cuda.compile_options(defines),
        "-o", str(out), str(cuda.KERNEL_DIR / source),
    ]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


_ENTRY = re.compile(
    r"Function properties for (\w+)\s*\n\s*(\d+) bytes stack frame, (\d+) bytes spill stores, "
    r"(\d+) bytes spill loads\s*\n.*?Used (\d+) registers(?:, used \d+ barriers)?"
    r"(?:, \d+ bytes cumulative stack size)?(?:, (\d+) bytes smem)?"
)


def test_every_source_is_covered() -> None:
    sources = {p.name for p in cuda.KERNEL_DIR.glob("*.cu")}
    assert sources == {s for s, _ in cuda.CI_VARIANTS}


def test_nvcc_sm90_compiles_without_spills(tmp_path: Path) -> None:
    variants = cuda.CI_VARIANTS
    outs = [tmp_path / f"v{i}.cubin" for i in range(len(variants))]
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        jobs = [pool.submit(_compile, s, d, o) for (s, d), o in zip(variants, outs, strict=True)]
        results = [j.result() for j in jobs]
    failures = []
    print()
    for (source, defines), res, out in zip(variants, results, outs, strict=True):
        label = source + "".join(f" {k}={v}" for k, v in defines.items())
        if res.returncode != 0:
            failures.append(f"{label}: nvcc failed\n{res.stderr}")
            continue
        if "warning" in res.stderr.lower():
            failures.append(f"{label}: warnings\n{res.stderr}")
        assert out.stat().st_size > 0
        entries = {m.group(1): m for m in _ENTRY.finditer(res.stderr)}
        missing = _expected(source, defines) - entries.keys()
        if missing:
            failures.append(f"{label}: missing entry points {sorted(missing)}")
        for name, m in sorted(entries.items()):
            stack, spill_st, spill_ld, regs = (int(m.group(i)) for i in range(2, 6))
            smem = int(m.group(6) or 0)
            print(f"{label:32s} {name:30s} regs={regs:3d} smem={smem:6d}B stack={stack}B")
            if spill_st or spill_ld or stack:
                failures.append(f"{label} {name}: stack {stack}B, spills {spill_st}/{spill_ld}B")
            if smem > 48 * 1024:
                failures.append(f"{label} {name}: {smem}B static shared memory > 48 KiB")
    assert not failures, "\n".join(failures)
