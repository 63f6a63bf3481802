"""Loading the CUDA C sources in ``kernels/*.cu`` through CuPy.

One ``cupy.RawModule`` per (source file, defines), compiled by NVRTC on first use and cached for
the process (CuPy also keeps the binary on disk under ``~/.cupy/kernel_cache``). CuPy picks the
architecture of the current device (``sm_90`` on H100/H200, ``sm_75`` on T4: sm_75 is the oldest
the sources build for); the CI compile test builds the same sources with nvcc for sm_75, sm_80
and sm_90 and the options from :func:`compile_options`.

Kernels are launched on torch's current stream, with tensor data pointers passed as 64-bit
integers: no copies, and no per-call DLPack capsule (which costs microseconds per tensor on the
hot path). CuPy is imported only here and only when a kernel is first needed, so ``import
kernels`` and every CPU path work without it.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kernels import variants

KERNEL_DIR = Path(__file__).resolve().parent

# Options shared by NVRTC (CuPy, at run time) and nvcc (the CI compile test). No -arch here:
# CuPy adds the current device's, the compile test adds sm_75, sm_80 and sm_90 in turn. The
# variants it builds are kernels.variants.CI_VARIANTS.
BASE_OPTIONS: tuple[str, ...] = ("-std=c++17", f"-I{KERNEL_DIR}")


def compile_options(defines: Mapping[str, int] | None = None) -> tuple[str, ...]:
    """The compiler options for one variant: the shared ones plus ``-DNAME=VALUE`` defines."""
    extra = tuple(f"-D{k}={v}" for k, v in sorted((defines or {}).items()))
    return BASE_OPTIONS + extra


def import_cupy() -> Any:
    """CuPy, or an ImportError that says how to get it."""
    try:
        import cupy
    except ImportError as e:
        raise ImportError(
            "Tandem's CUDA kernels need CuPy: pip install 'tandem[gpu]' (cupy-cuda12x). "
            "Without it, leave TANDEM_CUDA_KERNELS unset to use the torch reference kernels."
        ) from e
    return cupy


@functools.cache
def _module(source: str, defines: tuple[tuple[str, int], ...]) -> Any:
    cupy = import_cupy()
    code = (KERNEL_DIR / source).read_text()
    return cupy.RawModule(code=code, options=compile_options(dict(defines)), backend="nvrtc")


@functools.cache
def function(source: str, name: str, defines: tuple[tuple[str, int], ...] = ()) -> Any:
    """The kernel ``name`` from ``source`` compiled with ``defines`` (cached). A ValueError,
    before any compile, for a variant ``kernels.variants`` does not list."""
    error = variants.variant_error(source, defines)
    if error is not None:
        raise ValueError(error)
    return _module(source, defines).get_function(name)


def ptr(t: torch.Tensor | None) -> np.uint64:
    """A tensor's device address as a kernel argument (0, a null pointer, for None)."""
    return np.uint64(0 if t is None else t.data_ptr())


def launch(
    kernel: Any,
    grid: Sequence[int],
    block: Sequence[int],
    args: Sequence[Any],
    device: torch.device,
    shared_mem: int = 0,
) -> None:
    """Launch on ``device`` in torch's current stream there (asynchronous, like a torch op)."""
    cupy = import_cupy()
    stream = torch.cuda.current_stream(device).cuda_stream
    with cupy.cuda.Device(device.index), cupy.cuda.ExternalStream(stream, device.index):
        kernel(tuple(grid), tuple(block), tuple(args), shared_mem=shared_mem)
