"""Python wrappers of the CPU C kernels: check shapes, strides and dtypes, then call through
ctypes (which drops the GIL for the call). The torch reference of the same signature is
``kernels.reference.paged_decode``."""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from kernels import cpu

_DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}
_SIGNATURE = (
    [ctypes.c_void_p] * 4
    + [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    + [ctypes.c_int] * 3
    + [ctypes.c_float]
)


def supports(dtype: torch.dtype) -> bool:
    return dtype in _DTYPES


def load(head_dim: int, block_size: int, cache_dir: Path) -> ctypes.CDLL:
    """Build (once) and load the decode kernel for this head size and block size. Raises
    ``cpu.CpuKernelUnavailable`` when there is no compiler."""
    lib = cpu.library(
        "paged_decode_cpu.c",
        cpu.define_args({"HEAD_DIM": head_dim, "BLOCK_SIZE": block_size}),
        cache_dir,
    )
    for suffix in _DTYPES.values():
        getattr(lib, f"paged_decode_{suffix}").argtypes = _SIGNATURE
    return lib


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def paged_decode(
    lib: ctypes.CDLL,
    query: torch.Tensor,  # [num_reqs, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_reqs, max_blocks] int32, rows contiguous
    seq_lens: torch.Tensor,  # [num_reqs] int32, each >= 1
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one query token per request over its cached context (seq_lens tokens)."""
    n, h, d = query.shape
    _check(key_cache.dim() == 4, f"key_cache must be 4-D, got {tuple(key_cache.shape)}")
    hkv = key_cache.shape[2]
    _check(query.dtype in _DTYPES, f"CPU decode supports float32 and bfloat16, not {query.dtype}")
    for name, t in (("key_cache", key_cache), ("value_cache", value_cache)):
        _check(t.dtype == query.dtype, f"{name} must be {query.dtype}, got {t.dtype}")
        _check(t.is_contiguous(), f"{name} must be contiguous")
        _check(t.shape == key_cache.shape, f"{name} shape {tuple(t.shape)} != key_cache's")
    _check(key_cache.shape[3] == d, "query and cache head_dim differ")
    _check(h % hkv == 0, f"num_heads {h} is not a multiple of num_kv_heads {hkv}")
    _check(query.is_contiguous() and not query.is_cuda, "query must be a contiguous CPU tensor")
    _check(
        block_tables.dtype == torch.int32 and block_tables.stride(-1) == 1,
        "block_tables must be int32 with contiguous rows",
    )
    _check(block_tables.shape[0] >= n, "block_tables has fewer rows than query")
    _check(
        seq_lens.dtype == torch.int32 and seq_lens.is_contiguous() and seq_lens.shape[0] >= n,
        "seq_lens must be contiguous int32 with a row per request",
    )
    if out is None:
        out = torch.empty_like(query)
    _check(out.shape == query.shape and out.dtype == query.dtype and out.is_contiguous(), "out")
    if n:
        fn = getattr(lib, f"paged_decode_{_DTYPES[query.dtype]}")
        fn(
            query.data_ptr(),
            key_cache.data_ptr(),
            value_cache.data_ptr(),
            block_tables.data_ptr(),
            block_tables.stride(0),  # the row stride: a view of a wider table is fine
            seq_lens.data_ptr(),
            out.data_ptr(),
            n,
            h,
            hkv,
            scale,
        )
    return out
