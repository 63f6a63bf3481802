"""Building and loading the C sources in ``kernels/*_cpu.c`` with the system C compiler.

One shared library per (source, defines), compiled on first use with ``-O3 -march=native
-fopenmp`` and cached on disk under a key of the source, the flags, the compiler and this CPU (a
``-march=native`` build must never run on another CPU model). It is loaded with ctypes *after*
torch: its OpenMP dependency (``libgomp.so.1``) then resolves to the copy torch already loaded,
so kernels and torch share one OpenMP thread pool (two pools on a small machine make every
barrier sleep; see engine_svc/loop/engine_loop.py).

No compiler (or a failed build) raises :class:`CpuKernelUnavailable`; callers fall back to the
torch reference.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Mapping
from pathlib import Path

import torch  # noqa: F401 - loaded first on purpose: its libgomp is the one the kernels bind to

KERNEL_DIR = Path(__file__).resolve().parent
FLAGS: tuple[str, ...] = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC")
# Linked in a second command without -ffast-math: gcc links crtfastmath.o into a shared library
# built with it, whose constructor turns on flush-to-zero / denormals-are-zero for the whole
# process when the library loads (it broke float64 denormals in an unrelated test).
LINK_FLAGS: tuple[str, ...] = ("-shared", "-fopenmp")


class CpuKernelUnavailable(RuntimeError):
    """No C compiler here, or the kernel did not build."""


def compiler() -> str | None:
    for name in ("cc", "gcc", "clang"):
        path = shutil.which(name)
        if path is not None:
            return path
    return None


@functools.cache
def _cpu_identity() -> str:
    """What makes a -march=native build this CPU's: the model and its feature flags."""
    ident = [platform.machine()]
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "flags", "Features")):
                    ident.append(line.strip())
                if len(ident) >= 3:
                    break
    except OSError:
        ident.append(platform.processor())
    return "\n".join(ident)


@functools.cache
def library(source: str, defines: tuple[tuple[str, int], ...], cache_dir: Path) -> ctypes.CDLL:
    """``source`` built with ``defines`` (compiled once per machine, cached in ``cache_dir``)."""
    cc = compiler()
    if cc is None:
        raise CpuKernelUnavailable("no C compiler (cc, gcc or clang) on PATH")
    src = KERNEL_DIR / source
    args = [*FLAGS, *(f"-D{k}={v}" for k, v in defines)]
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    headers = [h.read_text() for h in sorted(KERNEL_DIR.glob("*.h"))]  # what sources include
    key = hashlib.sha256(
        "\0".join([src.read_text(), *headers, *args, version, _cpu_identity()]).encode()
    ).hexdigest()[:24]
    out = cache_dir / f"{src.stem}-{key}.so"
    if not out.exists():
        cache_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache_dir) as work:
            obj, lib = Path(work) / "kernel.o", Path(work) / "kernel.so"
            for cmd in (
                [cc, *args, "-c", "-o", str(obj), str(src)],
                [cc, *LINK_FLAGS, "-o", str(lib), str(obj), "-lm"],
            ):
                result = subprocess.run(cmd, capture_output=True, text=True)
                if result.returncode != 0:
                    raise CpuKernelUnavailable(f"{' '.join(cmd)} failed:\n{result.stderr[-2000:]}")
            os.replace(lib, out)  # atomic: engines building at once each get a whole file
    return ctypes.CDLL(str(out))


def define_args(defines: Mapping[str, int]) -> tuple[tuple[str, int], ...]:
    return tuple(sorted(defines.items()))
