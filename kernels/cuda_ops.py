"""The CUDA kernels as torch functions: check shape, stride, dtype and device, then launch on
torch's current stream. Each has the signature of its torch reference (``kernels.reference``,
``kernels.reference_norm_rope``), which the GPU tests compare it against.

Used by the ``cuda`` attention backend (``kernels.attention_backends``), which the engine picks
with ``--attention-backend cuda`` or TANDEM_CUDA_KERNELS=1. Importing this module needs no CuPy;
the first launch does.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from kernels import cuda, variants
from kernels.attention_metadata import AttentionMetadata

_SUFFIX = {torch.float16: "f16", torch.bfloat16: "bf16", torch.float32: "f32"}
PARTITION_SIZE = 512  # tokens per split-K partition; equals PARTITION_SIZE in paged_decode.cu
DECODE_THREADS = 128
PREFILL_THREADS = 128
PREFILL_BLOCK_M = 32  # query rows per thread block; equals BLOCK_M in paged_prefill.cu
_LOG2E = 1.4426950408889634


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _suffix(dtype: torch.dtype) -> str:
    if dtype not in _SUFFIX:
        raise TypeError(f"CUDA kernels support float16, bfloat16 and float32, got {dtype}")
    return _SUFFIX[dtype]


def _on(device: torch.device, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        _check(t.is_cuda, f"{name} must be a CUDA tensor, got device {t.device}")
        _check(t.device == device, f"{name} is on {t.device}, expected {device}")


def _threads(work: int, cap: int = 256) -> int:
    """Threads for a block that loops over `work` items: a multiple of 32, at most `cap`."""
    return min(cap, max(32, -(-work // 32) * 32))


def check_head_dim(head_dim: int, dtype: torch.dtype, prefill: bool) -> None:
    """A ValueError naming the limit unless the decode (or prefill) attention kernel is built for
    ``head_dim`` in ``dtype`` (``kernels.variants.HEAD_DIMS``). Raised before anything compiles,
    so a model with an unsupported head size fails with this message, not an NVRTC error."""
    source = variants.PREFILL if prefill else variants.DECODE
    error = variants.head_dim_error(source, _suffix(dtype), head_dim)
    if error is not None:
        raise ValueError(error)


# --------------------------------------------------------------------------------------------
# KV cache


def write_kv_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64; slot < 0 skips the token
) -> None:
    """Scatter this step's K/V into their slots (``write_kv_cache_b{16,4,2}`` in cache_ops.cu)."""
    dev = key_cache.device
    _on(dev, key=key, value=value, key_cache=key_cache, value_cache=value_cache,
        slot_mapping=slot_mapping)  # fmt: skip
    _check(key_cache.dim() == 4, f"key_cache must be 4-D, got shape {tuple(key_cache.shape)}")
    _check(
        value_cache.shape == key_cache.shape and value_cache.dtype == key_cache.dtype,
        "value_cache must match key_cache in shape and dtype",
    )
    _check(
        key_cache.is_contiguous() and value_cache.is_contiguous(), "KV caches must be contiguous"
    )
    _suffix(key_cache.dtype)
    _, _, hkv, d = key_cache.shape
    _check(
        key.dim() == 3 and tuple(key.shape[1:]) == (hkv, d),
        f"key must be [num_tokens, {hkv}, {d}], got {tuple(key.shape)}",
    )
    _check(value.shape == key.shape, f"value shape {tuple(value.shape)} != key {tuple(key.shape)}")
    _check(
        slot_mapping.dim() == 1 and slot_mapping.shape[0] == key.shape[0],
        f"slot_mapping must be [{key.shape[0]}], got {tuple(slot_mapping.shape)}",
    )
    _check(
        slot_mapping.dtype == torch.int64, f"slot_mapping must be int64, got {slot_mapping.dtype}"
    )
    key, value = key.to(key_cache.dtype), value.to(key_cache.dtype)  # as the reference does
    _check(key.stride(-1) == 1 and value.stride(-1) == 1, "key/value need unit stride in head_dim")
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    slot_mapping = slot_mapping.contiguous()
    esize = key_cache.element_size()
    strides = [key.stride(0), key.stride(1), value.stride(0), value.stride(1), d]
    ptrs = [t.data_ptr() for t in (key, value, key_cache, value_cache)]
    unit = next(
        u
        for u in (16, 4, 2)
        if u >= esize and all(s * esize % u == 0 for s in strides) and all(p % u == 0 for p in ptrs)
    )
    per = unit // esize  # elements per unit
    fn = cuda.function("cache_ops.cu", f"write_kv_cache_b{unit}")
    args = (
        cuda.ptr(key), cuda.ptr(value), cuda.ptr(key_cache), cuda.ptr(value_cache),
        cuda.ptr(slot_mapping), np.int32(hkv), np.int32(d // per),
        np.int64(key.stride(0) // per), np.int64(key.stride(1) // per),
        np.int64(value.stride(0) // per), np.int64(value.stride(1) // per),
    )  # fmt: skip
    cuda.launch(fn, (num_tokens,), (_threads(hkv * d // per),), args, dev)


# --------------------------------------------------------------------------------------------
# Attention


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of every scheduled query token over its request's cached context: decodes
    through paged_decode.cu (split-K), multi-token requests through paged_prefill.cu. Returns
    ``out`` (a new contiguous [num_tokens, num_heads, head_dim] tensor unless given; tests pass a
    NaN-filled one to catch unwritten elements)."""
    dev = key_cache.device
    _on(dev, query=query, key_cache=key_cache, value_cache=value_cache,
        block_tables=meta.block_tables, seq_lens=meta.seq_lens,
        query_start_loc=meta.query_start_loc)  # fmt: skip
    _check(key_cache.dim() == 4 and value_cache.shape == key_cache.shape, "bad KV cache shapes")
    _check(
        key_cache.is_contiguous() and value_cache.is_contiguous(), "KV caches must be contiguous"
    )
    _, block_size, hkv, d = key_cache.shape
    _check(
        query.dim() == 3 and query.shape[0] == meta.num_tokens and query.shape[2] == d,
        f"query must be [{meta.num_tokens}, num_heads, {d}], got {tuple(query.shape)}",
    )
    h = query.shape[1]
    _check(h % hkv == 0, f"num_heads {h} is not a multiple of num_kv_heads {hkv}")
    _check(
        query.dtype == key_cache.dtype == value_cache.dtype,
        f"query {query.dtype} and KV caches {key_cache.dtype}/{value_cache.dtype} must match",
    )
    _check(query.stride(-1) == 1, "query needs unit stride in head_dim")
    _suffix(query.dtype)
    tables = meta.block_tables
    _check(tables.dim() == 2 and tables.shape[0] >= meta.num_reqs, "block_tables must be 2-D")
    if tables.dtype != torch.int64 or tables.stride(1) != 1:
        tables = tables.to(torch.int64).contiguous()
    longest = max(meta.seq_lens_cpu[: meta.num_reqs], default=0)
    _check(
        tables.shape[1] * block_size >= longest,
        f"block_tables has {tables.shape[1]} columns, too few for a context of {longest}",
    )
    seq_lens = meta.seq_lens.to(torch.int32)
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=dev)
    _on(dev, out=out)
    _check(
        out.shape == query.shape and out.dtype == query.dtype and out.is_contiguous(),
        f"out must be a contiguous {query.dtype} tensor of shape {tuple(query.shape)}",
    )
    # Both kernels' head sizes are checked before either launches (or compiles).
    if meta.num_decodes:
        check_head_dim(d, query.dtype, prefill=False)
    if meta.num_reqs > meta.num_decodes:
        check_head_dim(d, query.dtype, prefill=True)
    if meta.num_decodes:
        _decode(out, query, key_cache, value_cache, tables, seq_lens, meta, scale)
    if meta.num_reqs > meta.num_decodes:
        _prefill(out, query, key_cache, value_cache, tables, seq_lens, meta, scale)
    return out


def _decode(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    tables: torch.Tensor,
    seq_lens: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> None:
    b, (h, d), dev = meta.num_decodes, query.shape[1:], query.device
    block_size, hkv = key_cache.shape[1], key_cache.shape[2]
    group = h // hkv
    qpb = next(n for n in (8, 4, 2, 1) if group % n == 0)  # query heads per thread block
    parts = max(1, math.ceil(max(meta.seq_lens_cpu[:b]) / PARTITION_SIZE))
    part_out = part_max = part_sum = None
    if parts > 1:
        part_out = torch.empty(b, h, parts, d, dtype=torch.float32, device=dev)
        part_max = torch.empty(b, h, parts, dtype=torch.float32, device=dev)
        part_sum = torch.empty(b, h, parts, dtype=torch.float32, device=dev)
    suffix = _suffix(query.dtype)
    defines = variants.attention_defines(suffix, d)
    fn = cuda.function(variants.DECODE, f"paged_decode_{suffix}_q{qpb}", defines)
    args = (
        cuda.ptr(out), cuda.ptr(part_out), cuda.ptr(part_max), cuda.ptr(part_sum),
        cuda.ptr(query), cuda.ptr(key_cache), cuda.ptr(value_cache), cuda.ptr(tables),
        cuda.ptr(seq_lens), np.int32(h), np.int32(hkv), np.int32(block_size),
        np.int32(tables.stride(0)), np.int64(query.stride(0)), np.int32(query.stride(1)),
        np.int32(parts), np.float32(scale * _LOG2E),
    )  # fmt: skip
    cuda.launch(fn, (h // qpb, b, parts), (DECODE_THREADS,), args, dev)
    if parts > 1:
        reduce = cuda.function(variants.DECODE, f"paged_decode_reduce_{suffix}", defines)
        reduce_args = (
            cuda.ptr(out), cuda.ptr(part_out), cuda.ptr(part_max), cuda.ptr(part_sum),
            cuda.ptr(seq_lens), np.int32(h), np.int32(parts),
        )  # fmt: skip
        cuda.launch(reduce, (h, b), (DECODE_THREADS,), reduce_args, dev, shared_mem=4 * parts)


def _prefill(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    tables: torch.Tensor,
    seq_lens: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> None:
    (h, d), dev = query.shape[1:], query.device
    block_size, hkv = key_cache.shape[1], key_cache.shape[2]
    starts = meta.query_start_loc_cpu
    first = meta.num_decodes
    max_q = max(starts[r + 1] - starts[r] for r in range(first, meta.num_reqs))
    query_start_loc = meta.query_start_loc.to(torch.int32)
    suffix = _suffix(query.dtype)
    fn = cuda.function(
        variants.PREFILL, f"paged_prefill_{suffix}", variants.attention_defines(suffix, d)
    )
    args = (
        cuda.ptr(out), cuda.ptr(query), cuda.ptr(key_cache), cuda.ptr(value_cache),
        cuda.ptr(tables), cuda.ptr(seq_lens), cuda.ptr(query_start_loc), np.int32(first),
        np.int32(h), np.int32(hkv), np.int32(block_size), np.int32(tables.stride(0)),
        np.int64(query.stride(0)), np.int32(query.stride(1)), np.float32(scale * _LOG2E),
    )  # fmt: skip
    grid = (-(-max_q // PREFILL_BLOCK_M), meta.num_reqs - first, h)
    cuda.launch(fn, grid, (PREFILL_THREADS,), args, dev)


# --------------------------------------------------------------------------------------------
# RMSNorm and rotary embedding


def _norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    dev = x.device
    _on(dev, x=x, weight=weight)
    hidden = x.shape[-1]
    _check(weight.shape == (hidden,), f"weight must be [{hidden}], got {tuple(weight.shape)}")
    if weight.dtype != x.dtype:
        raise TypeError(f"weight dtype {weight.dtype} must equal x dtype {x.dtype}")
    suffix = _suffix(x.dtype)
    rows = x.reshape(-1, hidden)
    _check(rows.stride(-1) == 1, "x needs unit stride in its last dim")
    weight = weight.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=dev)
    res_rows = res_out = None
    if residual is not None:
        _on(dev, residual=residual)
        _check(
            residual.shape == x.shape and residual.dtype == x.dtype,
            f"residual {tuple(residual.shape)} {residual.dtype} must match x "
            f"{tuple(x.shape)} {x.dtype}",
        )
        res_rows = residual.reshape(-1, hidden)
        _check(res_rows.stride(-1) == 1, "residual needs unit stride in its last dim")
        res_out = torch.empty(x.shape, dtype=x.dtype, device=dev)
    if rows.shape[0] == 0:
        return out, res_out
    fn = cuda.function("norm_rope.cu", f"rms_norm_{suffix}")
    args = (
        cuda.ptr(out), cuda.ptr(res_out), cuda.ptr(rows), cuda.ptr(res_rows), cuda.ptr(weight),
        np.int32(hidden), np.int64(rows.stride(0)),
        np.int64(res_rows.stride(0) if res_rows is not None else 0), np.float32(eps),
    )  # fmt: skip
    cuda.launch(fn, (rows.shape[0],), (_threads(hidden),), args, dev)
    return out, res_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim (``rms_norm_<dtype>`` in norm_rope.cu, no residual)."""
    return _norm(x, None, weight, eps)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)`` in one pass; both are new tensors."""
    out, summed = _norm(x, residual, weight, eps)
    assert summed is not None
    return out, summed


def rotary_embedding(
    positions: torch.Tensor,  # [num_tokens] int64
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim], rotated in place
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], rotated in place
    cos: torch.Tensor,  # [max_positions, rot_dim] float32
    sin: torch.Tensor,
) -> None:
    """Neox rotary embedding of the first ``rot_dim`` dims of q and k, in place
    (``rotary_neox_<dtype>`` in norm_rope.cu)."""
    dev = query.device
    _on(dev, positions=positions, query=query, key=key, cos=cos, sin=sin)
    _check(query.dim() == 3 and key.dim() == 3, "query and key must be [num_tokens, heads, dim]")
    t, h, d = query.shape
    _check(
        key.shape[0] == t and key.shape[2] == d,
        f"key {tuple(key.shape)} does not match query {tuple(query.shape)}",
    )
    if key.dtype != query.dtype:
        raise TypeError(f"query {query.dtype} and key {key.dtype} must share a dtype")
    suffix = _suffix(query.dtype)
    _check(query.stride(-1) == 1 and key.stride(-1) == 1, "q/k need unit stride in head_dim")
    _check(
        positions.shape == (t,) and positions.dtype == torch.int64,
        f"positions must be int64 [{t}], got {positions.dtype} {tuple(positions.shape)}",
    )
    _check(
        cos.dim() == 2 and cos.shape == sin.shape, "cos and sin must be [max_positions, rot_dim]"
    )
    if cos.dtype != torch.float32 or sin.dtype != torch.float32:
        raise TypeError("cos and sin tables must be float32")
    rot = cos.shape[1]
    _check(rot % 2 == 0 and 0 < rot <= d, f"rot_dim {rot} must be even and at most {d}")
    cos, sin, positions = cos.contiguous(), sin.contiguous(), positions.contiguous()
    if t == 0:
        return
    fn = cuda.function("norm_rope.cu", f"rotary_neox_{suffix}")
    hkv = key.shape[1]
    args = (
        cuda.ptr(query), cuda.ptr(key), cuda.ptr(positions), cuda.ptr(cos), cuda.ptr(sin),
        np.int32(rot), np.int32(cos.stride(0)), np.int32(h), np.int32(hkv),
        np.int64(query.stride(0)), np.int32(query.stride(1)),
        np.int64(key.stride(0)), np.int32(key.stride(1)),
    )  # fmt: skip
    cuda.launch(fn, (t,), (_threads((h + hkv) * rot // 2),), args, dev)
