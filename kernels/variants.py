"""Which kernel variants are built: the one list the wrappers check before compiling anything and
the CI compile test (tests/kernels/test_nvcc_compile.py) builds, so the two cannot drift apart.

cache_ops.cu, norm_rope.cu and activation.cu are one module each, with every dtype and no size
limit. The attention sources are compiled at run time once per (dtype, head_dim) a model needs,
and only for the head sizes in :data:`HEAD_DIMS`; the compile test builds the boundaries of each
range for sm_75, sm_80 and sm_90 and checks the next size up is refused by the sources themselves.

No torch here: dtypes are the entry-point suffixes (``f16``, ``bf16``, ``f32``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

DECODE = "paged_decode.cu"
PREFILL = "paged_prefill.cu"

DTYPES = ("f16", "bf16", "f32")  # the suffix of every per-dtype entry point
DTYPE_NAMES: Mapping[str, str] = {"f16": "float16", "bf16": "bfloat16", "f32": "float32"}

Defines = tuple[tuple[str, int], ...]


@dataclass(frozen=True)
class HeadDims:
    """The head sizes one attention kernel is built for with one dtype: the multiples of
    ``multiple`` (a head row in whole 16-byte chunks) from ``multiple`` up to ``max``."""

    multiple: int
    max: int

    def __contains__(self, head_dim: object) -> bool:
        return (
            isinstance(head_dim, int) and 0 < head_dim <= self.max and head_dim % self.multiple == 0
        )


# Decode: each lane holds up to 8 elements of q and of the accumulator per query head (a whole
# 16-byte chunk, or two fp32 half-chunks), so the 8-head variant fits 255 registers without
# spilling up to head_dim 256 in every dtype; at 264 it spills (static_assert in the source).
# Prefill: the shared-memory tiles hold at most 512 bytes per head row (48 KiB of static shared
# memory per block): 256 halves, 128 floats.
HEAD_DIMS: Mapping[tuple[str, str], HeadDims] = {
    (DECODE, "f16"): HeadDims(multiple=8, max=256),
    (DECODE, "bf16"): HeadDims(multiple=8, max=256),
    (DECODE, "f32"): HeadDims(multiple=4, max=256),
    (PREFILL, "f16"): HeadDims(multiple=8, max=256),
    (PREFILL, "bf16"): HeadDims(multiple=8, max=256),
    (PREFILL, "f32"): HeadDims(multiple=4, max=128),
}


def head_dim_error(source: str, dtype: str, head_dim: int) -> str | None:
    """Why ``source`` is not built for (``dtype``, ``head_dim``), or None when it is."""
    dims = HEAD_DIMS[(source, dtype)]
    if head_dim in dims:
        return None
    kind = "decode" if source == DECODE else "prefill"
    return (
        f"CUDA {kind} attention is built for {DTYPE_NAMES[dtype]} head_dim a multiple of "
        f"{dims.multiple} and at most {dims.max}, got {head_dim}; use the torch reference "
        "(--attention-backend torch)"
    )


def variant_error(source: str, defines: Defines) -> str | None:
    """Why ``source`` with ``defines`` is not a built variant, or None when it is: the last
    check before a run-time compile, so nothing outside this list ever reaches NVRTC."""
    if source not in (DECODE, PREFILL):
        return None if not defines else f"{source} takes no defines, got {dict(defines)}"
    given = dict(defines)
    dtypes = [t for t in DTYPES if given.get(f"WITH_{t.upper()}")]
    if "HEAD_DIM" not in given or len(dtypes) != 1 or len(given) != 2:
        return f"{source} needs HEAD_DIM and one WITH_<dtype> define, got {given}"
    return head_dim_error(source, dtypes[0], given["HEAD_DIM"])


def attention_defines(dtype: str, head_dim: int) -> Defines:
    """The ``-D`` defines of the attention module for one (dtype, head_dim)."""
    return (("HEAD_DIM", head_dim), (f"WITH_{dtype.upper()}", 1))


def _ci_head_dims(dims: HeadDims) -> list[int]:
    # Both ends of the range, the tiny test models' 24 (padding lanes) and the common sizes.
    return sorted(d for d in {dims.multiple, 24, 64, 128, dims.max} if d in dims)


# The variants the CI compile test builds, as (file, defines).
CI_VARIANTS: tuple[tuple[str, Defines], ...] = (
    ("cache_ops.cu", ()),
    ("norm_rope.cu", ()),
    ("activation.cu", ()),
    *(
        (source, attention_defines(dtype, d))
        for (source, dtype), dims in HEAD_DIMS.items()
        for d in _ci_head_dims(dims)
    ),
)
