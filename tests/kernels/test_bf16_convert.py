"""The software float32 -> bfloat16 conversion that tandem_common.cuh uses below sm_80 (where
``cvt.rn.bf16.f32`` does not exist) rounds to nearest even and keeps NaN and infinities. Built
from the header as a host program with nvcc (needs a host C++ compiler, no GPU) and checked on
every float32 exponent/mantissa-high pattern against an exact float64 rounding."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from kernels import cuda
from tests.kernels.test_nvcc_compile import NVCC

pytestmark = pytest.mark.skipif(
    NVCC is None or shutil.which("g++") is None, reason="needs nvcc and a host C++ compiler"
)

_PROGRAM = r"""
#include "tandem_common.cuh"
#include <cstdio>

static_assert(bf16_bits_rn(0x3f800000u) == 0x3f80, "1.0");
static_assert(bf16_bits_rn(0x7f800000u) == 0x7f80 && bf16_bits_rn(0xff800000u) == 0xff80, "inf");
static_assert(bf16_bits_rn(0x7fc00000u) == 0x7fff && bf16_bits_rn(0xff800001u) == 0x7fff, "nan");

int main(int argc, char** argv) {
  FILE* in = fopen(argv[1], "rb");
  FILE* out = fopen(argv[2], "wb");
  unsigned int bits;
  while (fread(&bits, sizeof bits, 1, in) == 1) {
    const u16 h = bf16_bits_rn(bits);
    fwrite(&h, sizeof h, 1, out);
  }
  return fclose(out) != 0;
}
"""


def _inputs() -> np.ndarray:
    """Every upper half (sign, exponent, top 7 mantissa bits) with lower halves that hit exact
    ties, either side of a tie, truncation-exact values and random bits."""
    rng = np.random.default_rng(0)
    high = np.arange(1 << 16, dtype=np.uint32) << 16
    lows = [0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFF]
    parts = [high | low for low in lows]
    parts.append(high | rng.integers(0, 1 << 16, size=high.size, dtype=np.uint32))
    return np.concatenate(parts)


def _expected(bits: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even to bfloat16 from first principles: pick the nearer of the two
    bfloat16 neighbours in exact float64 arithmetic, the even one on a tie."""
    x = bits.view(np.float32).astype(np.float64)
    lo_bits = bits & np.uint32(0xFFFF0000)  # towards zero
    hi_bits = lo_bits + np.uint32(0x10000)  # away from zero (magnitude)
    lo = lo_bits.view(np.float32).astype(np.float64)
    with np.errstate(over="ignore"):
        hi = hi_bits.view(np.float32).astype(np.float64)
    # Past the largest finite bfloat16 the next step up is 2^128, which then overflows to inf.
    hi = np.where(np.isinf(hi), np.copysign(2.0**128, x), hi)
    d_lo, d_hi = np.abs(x - lo), np.abs(hi - x)
    lo_even = (lo_bits >> 16) & 1 == 0
    pick_lo = (d_lo < d_hi) | ((d_lo == d_hi) & lo_even)
    return np.where(pick_lo, lo_bits >> 16, hi_bits >> 16).astype(np.uint16)


def test_software_bf16_rounding_matches_round_to_nearest_even(tmp_path: Path) -> None:
    assert NVCC is not None
    src, exe = tmp_path / "bf16_host.cu", tmp_path / "bf16_host"
    src.write_text(_PROGRAM)
    subprocess.run(
        [NVCC, *cuda.compile_options(), "-o", str(exe), str(src)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    bits = _inputs()
    (tmp_path / "in.bin").write_bytes(bits.tobytes())
    subprocess.run([str(exe), str(tmp_path / "in.bin"), str(tmp_path / "out.bin")], check=True)
    got = np.frombuffer((tmp_path / "out.bin").read_bytes(), dtype=np.uint16)
    assert got.size == bits.size

    x = bits.view(np.float32)
    nan, inf = np.isnan(x), np.isinf(x)
    # Every NaN becomes the canonical quiet NaN 0x7fff, as cvt.rn.bf16.f32 returns on sm_80+.
    assert (got[nan] == 0x7FFF).all()
    assert (got[inf] == np.where(x[inf] > 0, 0x7F80, 0xFF80)).all()
    finite = ~(nan | inf)
    want = _expected(bits[finite])
    bad = np.flatnonzero(got[finite] != want)
    assert bad.size == 0, [
        (hex(b), hex(g), hex(w))
        for b, g, w in zip(bits[finite][bad[:5]], got[finite][bad[:5]], want[bad[:5]], strict=True)
    ]
    # Sanity of the reference itself: bfloat16's own round trip of a few values.
    assert _expected(np.array([0x3F808000, 0x3F818000, 0x7F7FFFFF], dtype=np.uint32)).tolist() == [
        0x3F80,
        0x3F82,
        0x7F80,
    ]
