"""Every CUDA C source builds with nvcc, with the options CuPy uses at run time, for Turing (sm_75,
T4: the oldest target; nvcc 13 dropped sm_70), Ampere (sm_80) and Hopper (sm_90); exports the
entry points the wrappers launch; neither spills nor warns; and keeps to the 48 KiB of static
shared memory a block gets on each of them. The variants are ``kernels.variants.CI_VARIANTS``,
which include the largest head size the wrappers accept per (kernel, dtype); the next size up
must not build. Runs on CPU; prints each kernel's registers, shared memory and resident blocks
per SM (``pytest -s``)."""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from kernels import cuda, variants


def _nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    candidates = sorted(glob.glob("/usr/local/cuda*/bin/nvcc"))
    return candidates[-1] if candidates else None


NVCC = _nvcc()
pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc not found (PATH, /usr/local/cuda*)")

KIB = 1024
# Static shared memory is capped at 48 KiB per block on every architecture; more is only
# reachable as dynamic shared memory with an opt-in attribute (up to 64 KiB on sm_75, 163 KiB on
# sm_80, 227 KiB on sm_90), which the wrappers never set.
STATIC_SMEM_PER_BLOCK = 48 * KIB
MAX_REGISTERS = 255  # per thread, every architecture; 64K 32-bit registers per SM


@dataclass(frozen=True)
class Arch:
    sm: int
    smem_per_sm: int  # shared memory one SM hands out to its resident blocks


# Turing's 64 KiB per SM holds one block of the 8-head decode variant (~33 KiB), not the two its
# launch bounds ask for; printed, not enforced (a tuning matter, not a correctness one).
ARCHS = (Arch(75, smem_per_sm=64 * KIB), Arch(80, smem_per_sm=164 * KIB), Arch(90, 228 * KIB))


def _expected(source: str, defines: variants.Defines) -> set[str]:
    if source == "cache_ops.cu":
        return {f"write_kv_cache_b{u}" for u in (16, 4, 2)}
    if source == "norm_rope.cu":
        kinds = ("rms_norm", "rotary_neox", "qk_norm_rope_kv")
        return {f"{k}_{s}" for k in kinds for s in variants.DTYPES}
    if source == "activation.cu":
        return {f"silu_and_mul_{s}" for s in variants.DTYPES}
    (dtype,) = (t for t in variants.DTYPES if dict(defines).get(f"WITH_{t.upper()}"))
    if source == variants.DECODE:
        return {
            f"paged_decode_{tiled}{dtype}_q{q}" for q in (1, 2, 4, 8) for tiled in ("", "tiled_")
        } | {f"paged_decode_reduce_{dtype}"}
    if source == variants.PREFILL:
        return {f"paged_prefill_{dtype}"}
    raise AssertionError(f"no expectations for {source}")


def _compile(
    sm: int, source: str, defines: variants.Defines, out: Path
) -> subprocess.CompletedProcess[str]:
    assert NVCC is not None
    cmd = [
        NVCC, f"-arch=sm_{sm}", "-cubin", "--resource-usage", *cuda.compile_options(dict(defines)),
        "-o", str(out), str(cuda.KERNEL_DIR / source),
    ]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def _label(sm: int, source: str, defines: variants.Defines) -> str:
    return f"sm_{sm} {source}" + "".join(f" {k}={v}" for k, v in defines)


def _next_size_up() -> list[tuple[str, variants.Defines]]:
    return [
        (source, variants.attention_defines(dtype, dims.max + dims.multiple))
        for (source, dtype), dims in variants.HEAD_DIMS.items()
    ]


Job = tuple[int, str, variants.Defines]  # (sm, source, defines)


@dataclass(frozen=True)
class Build:
    returncode: int
    stderr: str
    out: Path


@pytest.fixture(scope="module")
def builds(tmp_path_factory: pytest.TempPathFactory) -> dict[Job, Build]:
    """Every CI variant for every arch, plus the next head size up (sm_90 only: the sources
    reject it in the front end, before any arch-specific step), in one pool of compiles."""
    jobs: list[Job] = [(a.sm, s, d) for a in ARCHS for s, d in variants.CI_VARIANTS]
    jobs += [(90, s, d) for s, d in _next_size_up()]
    tmp = tmp_path_factory.mktemp("cubin")
    outs = [tmp / f"v{i}.cubin" for i in range(len(jobs))]
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        futures = [pool.submit(_compile, *job, out) for job, out in zip(jobs, outs, strict=True)]
        done = [f.result() for f in futures]
    return {
        job: Build(res.returncode, res.stderr, out)
        for job, res, out in zip(jobs, done, outs, strict=True)
    }


_ENTRY = re.compile(
    r"Function properties for (\w+)\s*\n\s*(\d+) bytes stack frame, (\d+) bytes spill stores, "
    r"(\d+) bytes spill loads\s*\n.*?Used (\d+) registers(?:, used \d+ barriers)?"
    r"(?:, \d+ bytes cumulative stack size)?(?:, (\d+) bytes smem)?"
)


def test_every_source_is_covered() -> None:
    sources = {p.name for p in cuda.KERNEL_DIR.glob("*.cu")}
    assert sources == {s for s, _ in variants.CI_VARIANTS}


def test_largest_accepted_head_dims_are_compile_tested() -> None:
    built = set(variants.CI_VARIANTS)
    for (source, dtype), dims in variants.HEAD_DIMS.items():
        for d in (dims.multiple, dims.max):
            assert (source, variants.attention_defines(dtype, d)) in built, (source, dtype, d)


@pytest.mark.parametrize("arch", ARCHS, ids=lambda a: f"sm_{a.sm}")
def test_nvcc_compiles_without_spills(arch: Arch, builds: dict[Job, Build]) -> None:
    failures = []
    print()
    for source, defines in variants.CI_VARIANTS:
        label = _label(arch.sm, source, defines)
        build = builds[(arch.sm, source, defines)]
        if build.returncode != 0:
            failures.append(f"{label}: nvcc failed\n{build.stderr}")
            continue
        if "warning" in build.stderr.lower():
            failures.append(f"{label}: warnings\n{build.stderr}")
        assert build.out.stat().st_size > 0
        entries = {m.group(1): m for m in _ENTRY.finditer(build.stderr)}
        missing = _expected(source, defines) - entries.keys()
        if missing:
            failures.append(f"{label}: missing entry points {sorted(missing)}")
        for name, m in sorted(entries.items()):
            stack, spill_st, spill_ld, regs = (int(m.group(i)) for i in range(2, 6))
            smem = int(m.group(6) or 0)
            resident = arch.smem_per_sm // smem if smem else None
            print(
                f"{label:44s} {name:28s} regs={regs:3d} smem={smem:6d}B "
                f"blocks/SM by smem={resident or '-'}"
            )
            if spill_st or spill_ld or stack:
                failures.append(f"{label} {name}: stack {stack}B, spills {spill_st}/{spill_ld}B")
            if smem > STATIC_SMEM_PER_BLOCK:
                failures.append(f"{label} {name}: {smem}B static shared memory > 48 KiB")
            if regs > MAX_REGISTERS:
                failures.append(f"{label} {name}: {regs} registers > {MAX_REGISTERS}")
    assert not failures, "\n".join(failures)


_NEXT_UP = _next_size_up()


@pytest.mark.parametrize(
    ("source", "defines"), _NEXT_UP, ids=[f"{s}-{d[1][0]}-{d[0][1]}" for s, d in _NEXT_UP]
)
def test_next_head_dim_up_does_not_build(
    source: str, defines: variants.Defines, builds: dict[Job, Build]
) -> None:
    """The wrappers' limits are exact: one head size past each, the source refuses to build."""
    build = builds[(90, source, defines)]
    label = _label(90, source, defines)
    assert build.returncode != 0, f"{label} builds: raise its limit in kernels/variants.py"
    assert "static assertion failed" in build.stderr, build.stderr
