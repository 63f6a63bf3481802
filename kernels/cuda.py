"""Loading the CUDA C sources in ``kernels/*.cu`` through CuPy.

One ``cupy.RawModule`` per (source file, defines), compiled by NVRTC on first use and cached for
the process (CuPy also keeps the binary on disk under ``~/.cupy/kernel_cache``). CuPy picks the
architecture of the current device (``sm_90`` on H100/H200, ``sm_75`` on T4: sm_75 is the oldest
the sources build for); the CI compile test builds the same sources with nvcc for sm_75, sm_80
and sm_90 and the options from :func:`compile_options`.

Kernels run on the current CUDA device (the engine calls ``torch.cuda.set_device`` once at
start): :func:`function` loads a kernel there on first use, and :func:`launch` puts it on
torch's current stream of that device, with tensor data pointers passed as 64-bit integers. No
copies, no per-call DLPack capsule, no CuPy device or stream objects: a launch is one CuPy call
that reads the raw stream handle, so it is cheap and can be captured in a CUDA graph (anything
compiled or loaded for the first time must be, before capture: ``cuda_ops.preload``). CuPy is
imported only here and only when a kernel is first needed, so ``import kernels`` and every CPU
path work without it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
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
            "Without it, use the torch reference kernels: --attention-backend torch."
        ) from e
    return cupy


@functools.cache
def _module(source: str, defines: tuple[tuple[str, int], ...]) -> Any:
    cupy = import_cupy()
    code = (KERNEL_DIR / source).read_text()
    return cupy.RawModule(code=code, options=compile_options(dict(defines)), backend="nvrtc")


@functools.cache
def function(source: str, name: str, defines: tuple[tuple[str, int], ...] = ()) -> Any:
    """The kernel ``name`` from ``source`` compiled with ``defines``, loaded on the current
    device (cached: compiled and loaded once per process). A ValueError, before any compile,
    for a variant ``kernels.variants`` does not list."""
    error = variants.variant_error(source, defines)
    if error is not None:
        raise ValueError(error)
    # RawModule.get_function compiles the module and loads it on the current device; .kernel
    # is the loaded cupy.cuda.Function, launched directly (no per-call device lookup).
    return _module(source, defines).get_function(name).kernel


def ptr(t: torch.Tensor | None) -> np.uint64:
    """A tensor's device address as a kernel argument (0, a null pointer, for None)."""
    return np.uint64(0 if t is None else t.data_ptr())


class _TorchStream:
    """What CuPy's ``Function.__call__`` takes as ``stream``: it reads only ``.ptr``, here
    torch's current raw stream on the current device (a capturing stream during graph capture).
    """

    __slots__ = ()

    @property
    def ptr(self) -> int:
        return _current_stream()


def _raw_stream_getter() -> Callable[[], int]:
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:  # no Stream object built per call
        return lambda: int(raw(torch.cuda.current_device()))
    return lambda: int(torch.cuda.current_stream().cuda_stream)


_current_stream = _raw_stream_getter()
_STREAM = _TorchStream()


def launch(
    kernel: Any,
    grid: tuple[int, ...],
    block: tuple[int, ...],
    args: Sequence[Any],
    shared_mem: int = 0,
) -> None:
    """Launch ``kernel`` (from :func:`function`) on torch's current stream of the current
    device: asynchronous like a torch op, and capturable in a CUDA graph."""
    kernel(grid, block, args, shared_mem, _STREAM)
