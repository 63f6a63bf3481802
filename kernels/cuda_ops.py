"""The CUDA kernels as torch functions: check shape, stride, dtype and device, then launch on
torch's current stream. Each has the signature of its torch reference (``kernels.reference``,
``kernels.reference_norm_rope``), which the GPU tests compare it against.

Used by the ``cuda`` attention backend (``kernels.attention_backends``), which the engine picks
with ``--attention-backend cuda``. Importing this module needs no CuPy; the first launch does.

The launch path is built to be cheap and capturable in a CUDA graph: kernel handles are looked
up once per (dtype, head_dim) in cached tables (no names built per call), a launch is one CuPy
call on torch's current stream (``kernels.cuda.launch``), and the decode launch with explicit
``partitions`` and a :class:`DecodeWorkspace` reads nothing from the host and allocates
nothing. :func:`preload` compiles and loads everything a model uses before any capture.
Messages are formatted only when a check fails.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kernels import cuda, variants
from kernels.attention_metadata import AttentionMetadata

_SUFFIX = {torch.float16: "f16", torch.bfloat16: "bf16", torch.float32: "f32"}
DECODE_THREADS = 128
PREFILL_THREADS = 128
PREFILL_BLOCK_M = 32  # query rows per thread block; equals BLOCK_M in paged_prefill.cu
QKV_WARPS = 4  # head rows per thread block; equals QKV_WARPS in norm_rope.cu
QKV_MAX_HEAD_DIM = 256  # equals QKV_MAX_HEAD_DIM in norm_rope.cu
ACT_THREADS = 256  # equals ACT_THREADS in activation.cu
_MAX_GRID_Y = 65535
_LOG2E = 1.4426950408889634


def _suffix(dtype: torch.dtype) -> str:
    if dtype not in _SUFFIX:
        raise TypeError(f"CUDA kernels support float16, bfloat16 and float32, got {dtype}")
    return _SUFFIX[dtype]


def _on(device: torch.device, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if not t.is_cuda:
            raise ValueError(f"{name} must be a CUDA tensor, got device {t.device}")
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, expected {device}")


def _threads(work: int, cap: int = 256) -> int:
    """Threads for a block that loops over `work` items: a multiple of 32, at most `cap`."""
    return min(cap, max(32, -(-work // 32) * 32))


def _int32(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a contiguous int32 tensor: itself when it already is (what the engine passes)."""
    if t.dtype == torch.int32 and t.is_contiguous():
        return t
    return t.to(torch.int32).contiguous()


def check_head_dim(head_dim: int, dtype: torch.dtype, prefill: bool) -> None:
    """A ValueError naming the limit unless the decode (or prefill) attention kernel is built for
    ``head_dim`` in ``dtype`` (``kernels.variants.HEAD_DIMS``). Raised before anything compiles,
    so a model with an unsupported head size fails with this message, not an NVRTC error."""
    source = variants.PREFILL if prefill else variants.DECODE
    error = variants.head_dim_error(source, _suffix(dtype), head_dim)
    if error is not None:
        raise ValueError(error)


# --------------------------------------------------------------------------------------------
# Kernel handles: resolved once per (dtype, head_dim), then looked up per call


_QPB = (8, 4, 2, 1)  # query heads per decode thread block, widest first
_KV_CACHE_ENTRY: Mapping[int, str] = {u: f"write_kv_cache_b{u}" for u in (16, 4, 2)}


def _queries_per_block(group: int) -> int:
    """Query heads one decode thread block serves: the widest of :data:`_QPB` dividing the GQA
    group (the heads sharing one KV head)."""
    return next(n for n in _QPB if group % n == 0)


@dataclass(frozen=True)
class _DecodeFns:
    by_qpb: Mapping[int, Any]  # queries per block -> paged_decode_<dtype>_q<n>
    tiled_by_qpb: Mapping[int, Any]  # -> paged_decode_tiled_<dtype>_q<n>
    reduce: Any


@dataclass(frozen=True)
class _NormFns:
    rms_norm: Any
    rotary: Any
    qk_norm_rope_kv: Any


@functools.cache
def _decode_fns(dtype: torch.dtype, head_dim: int) -> _DecodeFns:
    suffix = _suffix(dtype)
    defines = variants.attention_defines(suffix, head_dim)
    return _DecodeFns(
        by_qpb={
            q: cuda.function(variants.DECODE, f"paged_decode_{suffix}_q{q}", defines) for q in _QPB
        },
        tiled_by_qpb={
            q: cuda.function(variants.DECODE, f"paged_decode_tiled_{suffix}_q{q}", defines)
            for q in _QPB
        },
        reduce=cuda.function(variants.DECODE, f"paged_decode_reduce_{suffix}", defines),
    )


@functools.cache
def _prefill_fn(dtype: torch.dtype, head_dim: int) -> Any:
    suffix = _suffix(dtype)
    defines = variants.attention_defines(suffix, head_dim)
    return cuda.function(variants.PREFILL, f"paged_prefill_{suffix}", defines)


@functools.cache
def _norm_fns(dtype: torch.dtype) -> _NormFns:
    suffix = _suffix(dtype)
    return _NormFns(
        cuda.function("norm_rope.cu", f"rms_norm_{suffix}"),
        cuda.function("norm_rope.cu", f"rotary_neox_{suffix}"),
        cuda.function("norm_rope.cu", f"qk_norm_rope_kv_{suffix}"),
    )


@functools.cache
def _silu_fn(dtype: torch.dtype) -> Any:
    return cuda.function("activation.cu", f"silu_and_mul_{_suffix(dtype)}")


@functools.cache
def _kv_cache_fn(unit: int) -> Any:
    return cuda.function("cache_ops.cu", _KV_CACHE_ENTRY[unit])


def preload(dtype: torch.dtype, head_dim: int) -> None:
    """Compile and load, on the current device, every kernel a model with this dtype and head
    size launches: decode (every queries-per-block variant and the reduce), prefill, the KV
    cache write at every access width, RMSNorm, rotary, the fused q/k norm + rotary + cache
    write, SiLU-and-multiply. Call it before capturing a CUDA graph, so nothing compiles or
    loads during capture. A ValueError if the attention kernels are not built for the size."""
    check_head_dim(head_dim, dtype, prefill=False)
    check_head_dim(head_dim, dtype, prefill=True)
    _decode_fns(dtype, head_dim)
    _prefill_fn(dtype, head_dim)
    for unit in _KV_CACHE_ENTRY:
        _kv_cache_fn(unit)
    _norm_fns(dtype)
    _silu_fn(dtype)


@functools.cache
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (cached: asked once per device)."""
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


# --------------------------------------------------------------------------------------------
# Split-K decode: how many partitions, and where their partials go

MIN_PARTITION = 128  # equals MIN_PARTITION in paged_decode.cu (they must match)
PARTITION_ALIGN = 16  # equals PARTITION_ALIGN in paged_decode.cu (they must match)
# The reduce kernel holds one float per partition in dynamic shared memory, beside its 132
# bytes of static scratch, within the 48 KiB a block gets by default.
MAX_PARTITIONS = (48 * 1024 - 256) // 4


def decode_partition_len(seq_len: int, partitions: int) -> int:
    """Tokens per partition of a context of ``seq_len`` > 0 tokens in a decode launch with
    ``partitions`` (its grid's z): the device-side rule of paged_decode.cu's ``partition_len``,
    mirrored here for the CPU test. The sequence uses ``ceil(seq_len / len) <= partitions``
    partitions; partition p holds tokens [p * len, min((p + 1) * len, seq_len))."""
    even = -(-seq_len // partitions)
    return max(MIN_PARTITION, -(-even // PARTITION_ALIGN) * PARTITION_ALIGN)


def decode_partitions(
    num_seqs: int, num_heads: int, num_kv_heads: int, max_context: int, num_sms: int
) -> int:
    """The partition count ``P`` of a decode launch, from the batch's shape and a bound on its
    contexts only (never from the contexts themselves, so a CUDA graph captured with it serves
    every context up to the bound).

    Without a split a launch has ``num_seqs * num_heads / qpb`` thread blocks (qpb: query heads
    per block). The rule aims for at least ``4 * num_sms`` thread blocks, ``P = ceil(4 *
    num_sms / blocks)``, capped at ``ceil(max_context / MIN_PARTITION)`` (more partitions than
    that could never be used) and at :data:`MAX_PARTITIONS`, and at least 1: a batch that
    already fills the GPU is not split. A tuning choice, not a correctness one: every P gives
    the same result up to the reduction order."""
    blocks = num_seqs * (num_heads // _queries_per_block(num_heads // num_kv_heads))
    want = -(-4 * num_sms // max(1, blocks))
    cap = -(-max_context // MIN_PARTITION)
    return max(1, min(want, cap, MAX_PARTITIONS))


class DecodeWorkspace:
    """Preallocated float32 scratch for the split-K partials of decode launches, so a launch
    allocates nothing (and a CUDA graph captured over it reads and writes the same memory on
    every replay). Flat buffers sized for::

        part_out[max_seqs, num_heads, max_partitions, head_dim]
        part_max[max_seqs, num_heads, max_partitions]      part_sum: the same

    A launch with ``num_seqs`` sequences and ``P`` partitions uses the prefix laid out as
    ``[num_seqs, num_heads, P, ...]``, so any launch with at most as many (seq, head, partition)
    rows fits; :meth:`buffers` raises a ValueError for one that does not."""

    def __init__(
        self,
        max_seqs: int,
        num_heads: int,
        head_dim: int,
        max_partitions: int,
        device: torch.device | str,
    ) -> None:
        self.max_seqs, self.num_heads = max_seqs, num_heads
        self.head_dim, self.max_partitions = head_dim, max_partitions
        rows = max_seqs * num_heads * max_partitions
        self.part_out = torch.empty(rows * head_dim, dtype=torch.float32, device=device)
        self.part_max = torch.empty(rows, dtype=torch.float32, device=device)
        self.part_sum = torch.empty(rows, dtype=torch.float32, device=device)

    def buffers(
        self, num_seqs: int, num_heads: int, head_dim: int, partitions: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(part_out, part_max, part_sum)`` for one launch, or a ValueError if it does not fit."""
        rows = num_seqs * num_heads * partitions
        if rows > self.part_max.numel() or rows * head_dim > self.part_out.numel():
            raise ValueError(
                f"DecodeWorkspace(max_seqs={self.max_seqs}, num_heads={self.num_heads}, "
                f"head_dim={self.head_dim}, max_partitions={self.max_partitions}) is too small "
                f"for a decode launch of {num_seqs} sequences x {num_heads} heads x "
                f"{partitions} partitions x head_dim {head_dim}"
            )
        return self.part_out, self.part_max, self.part_sum


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
    _on(key_cache.device, key=key, value=value, key_cache=key_cache, value_cache=value_cache,
        slot_mapping=slot_mapping)  # fmt: skip
    if key_cache.dim() != 4:
        raise ValueError(f"key_cache must be 4-D, got shape {tuple(key_cache.shape)}")
    if value_cache.shape != key_cache.shape or value_cache.dtype != key_cache.dtype:
        raise ValueError("value_cache must match key_cache in shape and dtype")
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError("KV caches must be contiguous")
    _suffix(key_cache.dtype)
    _, _, hkv, d = key_cache.shape
    if key.dim() != 3 or key.shape[1] != hkv or key.shape[2] != d:
        raise ValueError(f"key must be [num_tokens, {hkv}, {d}], got {tuple(key.shape)}")
    if value.shape != key.shape:
        raise ValueError(f"value shape {tuple(value.shape)} != key {tuple(key.shape)}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(f"slot_mapping must be [{key.shape[0]}], got {tuple(slot_mapping.shape)}")
    if slot_mapping.dtype != torch.int64:
        raise ValueError(f"slot_mapping must be int64, got {slot_mapping.dtype}")
    key, value = key.to(key_cache.dtype), value.to(key_cache.dtype)  # as the reference does
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError("key/value need unit stride in head_dim")
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    slot_mapping = slot_mapping.contiguous()
    esize = key_cache.element_size()
    strides = (key.stride(0), key.stride(1), value.stride(0), value.stride(1), d)
    ptrs = (key.data_ptr(), value.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr())
    unit = next(
        u
        for u in _KV_CACHE_ENTRY
        if u >= esize and all(s * esize % u == 0 for s in strides) and all(p % u == 0 for p in ptrs)
    )
    per = unit // esize  # elements per unit
    args = (
        cuda.ptr(key), cuda.ptr(value), cuda.ptr(key_cache), cuda.ptr(value_cache),
        cuda.ptr(slot_mapping), np.int32(hkv), np.int32(d // per),
        np.int64(key.stride(0) // per), np.int64(key.stride(1) // per),
        np.int64(value.stride(0) // per), np.int64(value.stride(1) // per),
    )  # fmt: skip
    cuda.launch(_kv_cache_fn(unit), (num_tokens,), (_threads(hkv * d // per),), args)


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
    partitions: int | None = None,
    workspace: DecodeWorkspace | None = None,
    prefill: bool = True,
    tiled_decode: bool = False,
    queries_per_block: int | None = None,
) -> torch.Tensor:
    """Causal attention of every scheduled query token over its request's cached context: decodes
    through paged_decode.cu (split-K), multi-token requests through paged_prefill.cu (``prefill``
    False: their rows are left to the caller, ``kernels.flash_prefill``). Returns
    ``out`` (a new contiguous [num_tokens, num_heads, head_dim] tensor unless given; tests pass a
    NaN-filled one to catch unwritten elements).

    ``partitions``: the decode launch's split-K partition count. None: chosen by
    :func:`decode_partitions` from this batch's longest context (``meta.seq_lens_cpu``). Given
    (the engine passes one computed from ``max_model_len``): used as is, and the decode path
    reads nothing from the host-side metadata, so it can be captured in a CUDA graph and
    replayed with other contexts. ``workspace``: where the split-K partials go (None: allocated
    per call). ``tiled_decode``: the tiled variant of the decode kernel (several tokens' K/V
    loaded per lane group before any is used, one softmax rescale per tile; same grid, same
    results up to rounding): correct, but slower in every case measured on an H200
    (benchmarks/results/attention_gpu.md), so the engine leaves it off.
    ``queries_per_block``: how many query heads of a GQA group one decode thread block serves
    (1, 2, 4 or 8, dividing the group); None: the widest that divides it. A tuning knob
    (benchmarks/kernels_decode.py --sweep): every choice gives the same result.

    Block tables and ``seq_lens`` are used as they are when int32 with unit stride (what the
    engine passes); int64 ones (some tests) are converted here, per call.
    """
    dev = key_cache.device
    _on(dev, query=query, key_cache=key_cache, value_cache=value_cache,
        block_tables=meta.block_tables, seq_lens=meta.seq_lens,
        query_start_loc=meta.query_start_loc)  # fmt: skip
    if key_cache.dim() != 4 or value_cache.shape != key_cache.shape:
        raise ValueError("bad KV cache shapes")
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError("KV caches must be contiguous")
    _, block_size, hkv, d = key_cache.shape
    if query.dim() != 3 or query.shape[0] != meta.num_tokens or query.shape[2] != d:
        raise ValueError(
            f"query must be [{meta.num_tokens}, num_heads, {d}], got {tuple(query.shape)}"
        )
    h = query.shape[1]
    if h % hkv:
        raise ValueError(f"num_heads {h} is not a multiple of num_kv_heads {hkv}")
    if not query.dtype == key_cache.dtype == value_cache.dtype:
        raise ValueError(
            f"query {query.dtype} and KV caches {key_cache.dtype}/{value_cache.dtype} must match"
        )
    if query.stride(-1) != 1:
        raise ValueError("query needs unit stride in head_dim")
    _suffix(query.dtype)
    tables = meta.block_tables
    if tables.dim() != 2 or tables.shape[0] < meta.num_reqs:
        raise ValueError("block_tables must be 2-D with a row per request")
    if tables.dtype != torch.int32 or tables.stride(1) != 1:
        tables = tables.to(torch.int32).contiguous()  # off the engine's path (int32 rows)
    if partitions is None:
        longest = max(meta.seq_lens_cpu[: meta.num_reqs], default=0)
        if tables.shape[1] * block_size < longest:
            raise ValueError(
                f"block_tables has {tables.shape[1]} columns, too few for a context of {longest}"
            )
    seq_lens = _int32(meta.seq_lens)
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=dev)
    _on(dev, out=out)
    if out.shape != query.shape or out.dtype != query.dtype or not out.is_contiguous():
        raise ValueError(
            f"out must be a contiguous {query.dtype} tensor of shape {tuple(query.shape)}"
        )
    # Both kernels' head sizes are checked before either launches (or compiles).
    b = meta.num_decodes
    if b:
        check_head_dim(d, query.dtype, prefill=False)
    prefill = prefill and meta.num_reqs > b
    if prefill:
        check_head_dim(d, query.dtype, prefill=True)
    if b:
        if partitions is None:
            longest_decode = max(meta.seq_lens_cpu[:b])
            partitions = decode_partitions(b, h, hkv, longest_decode, num_sms(dev))
        _decode(out, query, key_cache, value_cache, tables, seq_lens, b, scale, partitions,
                workspace, tiled_decode, queries_per_block)  # fmt: skip
    if prefill:
        _prefill(out, query, key_cache, value_cache, tables, seq_lens, meta, scale)
    return out


def _decode(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    tables: torch.Tensor,
    seq_lens: torch.Tensor,
    num_seqs: int,
    scale: float,
    partitions: int,
    workspace: DecodeWorkspace | None,
    tiled: bool = False,
    qpb: int | None = None,
) -> None:
    """The first ``num_seqs`` rows of ``query``: one launch of ``partitions`` partitions, then
    the reduce when there is more than one. Reads nothing from the host."""
    if not 1 <= partitions <= MAX_PARTITIONS:
        raise ValueError(f"partitions must be in [1, {MAX_PARTITIONS}], got {partitions}")
    b, (h, d), dev = num_seqs, query.shape[1:], query.device
    block_size, hkv = key_cache.shape[1], key_cache.shape[2]
    if qpb is None:
        qpb = _queries_per_block(h // hkv)
    elif qpb not in _QPB or (h // hkv) % qpb:
        raise ValueError(
            f"queries_per_block must be one of {_QPB} dividing the GQA group {h // hkv}, got {qpb}"
        )
    fns = _decode_fns(query.dtype, d)
    part_out = part_max = part_sum = None
    if partitions > 1:
        if workspace is None:
            rows = b * h * partitions
            part_out = torch.empty(rows * d, dtype=torch.float32, device=dev)
            part_max = torch.empty(rows, dtype=torch.float32, device=dev)
            part_sum = torch.empty(rows, dtype=torch.float32, device=dev)
        else:
            part_out, part_max, part_sum = workspace.buffers(b, h, d, partitions)
            _on(dev, workspace=part_out)
    args = (
        cuda.ptr(out), cuda.ptr(part_out), cuda.ptr(part_max), cuda.ptr(part_sum),
        cuda.ptr(query), cuda.ptr(key_cache), cuda.ptr(value_cache), cuda.ptr(tables),
        cuda.ptr(seq_lens), np.int32(h), np.int32(hkv), np.int32(block_size),
        np.int32(tables.stride(0)), np.int64(query.stride(0)), np.int32(query.stride(1)),
        np.int32(partitions), np.float32(scale * _LOG2E),
    )  # fmt: skip
    kernel = (fns.tiled_by_qpb if tiled else fns.by_qpb)[qpb]
    cuda.launch(kernel, (h // qpb, b, partitions), (DECODE_THREADS,), args)
    if partitions > 1:
        reduce_args = (
            cuda.ptr(out), cuda.ptr(part_out), cuda.ptr(part_max), cuda.ptr(part_sum),
            cuda.ptr(seq_lens), np.int32(h), np.int32(partitions),
        )  # fmt: skip
        cuda.launch(fns.reduce, (h, b), (DECODE_THREADS,), reduce_args, 4 * partitions)


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
    h, d = query.shape[1:]
    block_size, hkv = key_cache.shape[1], key_cache.shape[2]
    starts = meta.query_start_loc_cpu
    first = meta.num_decodes
    max_q = max(starts[r + 1] - starts[r] for r in range(first, meta.num_reqs))
    query_start_loc = _int32(meta.query_start_loc)
    args = (
        cuda.ptr(out), cuda.ptr(query), cuda.ptr(key_cache), cuda.ptr(value_cache),
        cuda.ptr(tables), cuda.ptr(seq_lens), cuda.ptr(query_start_loc), np.int32(first),
        np.int32(h), np.int32(hkv), np.int32(block_size), np.int32(tables.stride(0)),
        np.int64(query.stride(0)), np.int32(query.stride(1)), np.float32(scale * _LOG2E),
    )  # fmt: skip
    grid = (-(-max_q // PREFILL_BLOCK_M), meta.num_reqs - first, h)
    cuda.launch(_prefill_fn(query.dtype, d), grid, (PREFILL_THREADS,), args)


# --------------------------------------------------------------------------------------------
# RMSNorm, rotary embedding, and the fused attention prologue


def _norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    dev = x.device
    _on(dev, x=x, weight=weight)
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"weight must be [{hidden}], got {tuple(weight.shape)}")
    if weight.dtype != x.dtype:
        raise TypeError(f"weight dtype {weight.dtype} must equal x dtype {x.dtype}")
    _suffix(x.dtype)
    rows = x.reshape(-1, hidden)
    if rows.stride(-1) != 1:
        raise ValueError("x needs unit stride in its last dim")
    weight = weight.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=dev)
    res_rows = res_out = None
    if residual is not None:
        _on(dev, residual=residual)
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(
                f"residual {tuple(residual.shape)} {residual.dtype} must match x "
                f"{tuple(x.shape)} {x.dtype}"
            )
        res_rows = residual.reshape(-1, hidden)
        if res_rows.stride(-1) != 1:
            raise ValueError("residual needs unit stride in its last dim")
        res_out = torch.empty(x.shape, dtype=x.dtype, device=dev)
    if rows.shape[0] == 0:
        return out, res_out
    args = (
        cuda.ptr(out), cuda.ptr(res_out), cuda.ptr(rows), cuda.ptr(res_rows), cuda.ptr(weight),
        np.int32(hidden), np.int64(rows.stride(0)),
        np.int64(res_rows.stride(0) if res_rows is not None else 0), np.float32(eps),
    )  # fmt: skip
    cuda.launch(_norm_fns(x.dtype).rms_norm, (rows.shape[0],), (_threads(hidden),), args)
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


def _check_tables(cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> int:
    """The rotary dims of float32 cos/sin tables [max_positions, rot_dim] with unit stride in a
    row and one row stride; a ValueError (TypeError for the dtype) otherwise."""
    if cos.dim() != 2 or cos.shape != sin.shape:
        raise ValueError("cos and sin must be [max_positions, rot_dim]")
    if cos.dtype != torch.float32 or sin.dtype != torch.float32:
        raise TypeError("cos and sin tables must be float32")
    rot = cos.shape[1]
    if rot % 2 or not 0 < rot <= head_dim:
        raise ValueError(f"rot_dim {rot} must be even and at most {head_dim}")
    return rot


def rotary_embedding(
    positions: torch.Tensor,  # [num_tokens] int64
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim], rotated in place
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], rotated in place
    cos: torch.Tensor,  # [max_positions, rot_dim] float32
    sin: torch.Tensor,
) -> None:
    """Neox rotary embedding of the first ``rot_dim`` dims of q and k, in place
    (``rotary_neox_<dtype>`` in norm_rope.cu)."""
    _on(query.device, positions=positions, query=query, key=key, cos=cos, sin=sin)
    if query.dim() != 3 or key.dim() != 3:
        raise ValueError("query and key must be [num_tokens, heads, dim]")
    t, h, d = query.shape
    if key.shape[0] != t or key.shape[2] != d:
        raise ValueError(f"key {tuple(key.shape)} does not match query {tuple(query.shape)}")
    if key.dtype != query.dtype:
        raise TypeError(f"query {query.dtype} and key {key.dtype} must share a dtype")
    _suffix(query.dtype)
    if query.stride(-1) != 1 or key.stride(-1) != 1:
        raise ValueError("q/k need unit stride in head_dim")
    if positions.shape != (t,) or positions.dtype != torch.int64:
        raise ValueError(
            f"positions must be int64 [{t}], got {positions.dtype} {tuple(positions.shape)}"
        )
    rot = _check_tables(cos, sin, d)
    cos, sin, positions = cos.contiguous(), sin.contiguous(), positions.contiguous()
    if t == 0:
        return
    hkv = key.shape[1]
    args = (
        cuda.ptr(query), cuda.ptr(key), cuda.ptr(positions), cuda.ptr(cos), cuda.ptr(sin),
        np.int32(rot), np.int32(cos.stride(0)), np.int32(h), np.int32(hkv),
        np.int64(query.stride(0)), np.int32(query.stride(1)),
        np.int64(key.stride(0)), np.int32(key.stride(1)),
    )  # fmt: skip
    cuda.launch(_norm_fns(query.dtype).rotary, (t,), (_threads((h + hkv) * rot // 2),), args)


def qk_norm_rope_kv(
    qkv: torch.Tensor,  # [T, (H + 2 Hkv) * D], unit stride in a row
    positions: torch.Tensor,  # [T] int64
    cos: torch.Tensor,  # [max_positions, rot_dim] float32, first half repeated
    sin: torch.Tensor,
    q_weight: torch.Tensor | None,  # [D] in qkv's dtype, or None with k_weight (no q/k norm)
    k_weight: torch.Tensor | None,
    eps: float,
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64; slot < 0: a padding token, written nowhere
    num_heads: int,
    num_kv_heads: int,
) -> torch.Tensor:
    """One layer's attention prologue in one launch (``qk_norm_rope_kv_<dtype>`` in
    norm_rope.cu): q and k heads RMSNorm-ed (with weights) and rotated (neox, first ``rot_dim``
    dims) in place in ``qkv``; k and v written to the caches at ``slot_mapping``. Returns the
    q part as a view, ``qkv[:, :H * D].view(T, H, D)``. No allocation, no host sync."""
    dev = key_cache.device
    _on(dev, qkv=qkv, positions=positions, cos=cos, sin=sin, key_cache=key_cache,
        value_cache=value_cache, slot_mapping=slot_mapping)  # fmt: skip
    if key_cache.dim() != 4 or value_cache.shape != key_cache.shape:
        raise ValueError("KV caches must both be [num_blocks, block_size, num_kv_heads, head_dim]")
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError("KV caches must be contiguous")
    _, _, hkv, d = key_cache.shape
    if hkv != num_kv_heads:
        raise ValueError(f"the KV caches hold {hkv} KV heads, num_kv_heads is {num_kv_heads}")
    if not qkv.dtype == key_cache.dtype == value_cache.dtype:
        raise TypeError(
            f"qkv {qkv.dtype} and KV caches {key_cache.dtype}/{value_cache.dtype} must match"
        )
    _suffix(qkv.dtype)
    h = num_heads
    if qkv.dim() != 2 or qkv.shape[1] != (h + 2 * hkv) * d or qkv.stride(1) != 1:
        raise ValueError(
            f"qkv must be [num_tokens, {(h + 2 * hkv) * d}] with unit stride in a row, got "
            f"{tuple(qkv.shape)} with strides {qkv.stride()}"
        )
    if d % 2 or d > QKV_MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be even and at most {QKV_MAX_HEAD_DIM}, got {d}")
    t = qkv.shape[0]
    for name, index in (("positions", positions), ("slot_mapping", slot_mapping)):
        if index.shape != (t,) or index.dtype != torch.int64 or index.stride(0) != 1:
            raise ValueError(
                f"{name} must be a contiguous int64 [{t}], got {index.dtype} {tuple(index.shape)}"
            )
    rot = _check_tables(cos, sin, d)
    if cos.stride(1) != 1 or sin.stride(1) != 1 or cos.stride(0) != sin.stride(0):
        raise ValueError("cos and sin need unit stride in a row and one row stride")
    if (q_weight is None) != (k_weight is None):
        raise ValueError("q_weight and k_weight must both be given or both be None")
    if q_weight is not None and k_weight is not None:
        _on(dev, q_weight=q_weight, k_weight=k_weight)
        for w in (q_weight, k_weight):
            if w.shape != (d,) or w.dtype != qkv.dtype or w.stride(0) != 1:
                raise ValueError(
                    f"q_weight/k_weight must be contiguous {qkv.dtype} [{d}], got {w.dtype} "
                    f"{tuple(w.shape)}"
                )
    q = qkv[:, : h * d].view(t, h, d)
    if t == 0:
        return q
    args = (
        cuda.ptr(qkv), cuda.ptr(key_cache), cuda.ptr(value_cache), cuda.ptr(positions),
        cuda.ptr(slot_mapping), cuda.ptr(cos), cuda.ptr(sin), cuda.ptr(q_weight),
        cuda.ptr(k_weight), np.int64(qkv.stride(0)), np.int32(h), np.int32(hkv), np.int32(d),
        np.int32(rot), np.int32(cos.stride(0)), np.float32(eps),
    )  # fmt: skip
    grid = (t, -(-(h + 2 * hkv) // QKV_WARPS))
    cuda.launch(_norm_fns(qkv.dtype).qk_norm_rope_kv, grid, (QKV_WARPS * 32,), args)
    return q


# --------------------------------------------------------------------------------------------
# Activation


def silu_and_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(gate) * up`` of each ``[gate | up]`` row (last dim ``2 * I``) into a new
    contiguous ``[..., I]`` tensor, or into ``out`` (``silu_and_mul_<dtype>`` in activation.cu,
    one launch). ``gate_up`` is never written. Same values as ``reference.silu_and_mul``, which
    without ``out`` computes over the gate half of its input instead."""
    dev = gate_up.device
    _on(dev, gate_up=gate_up)
    _suffix(gate_up.dtype)
    if gate_up.dim() == 0 or gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up's last dim must be 2 * I, got shape {tuple(gate_up.shape)}")
    width = gate_up.shape[-1]
    inter = width // 2
    shape = (*gate_up.shape[:-1], inter)
    if out is None:
        out = torch.empty(shape, dtype=gate_up.dtype, device=dev)
    else:
        _on(dev, out=out)
        if out.shape != shape or out.dtype != gate_up.dtype or not out.is_contiguous():
            raise ValueError(
                f"out must be a contiguous {gate_up.dtype} tensor of shape {shape}, got "
                f"{out.dtype} {tuple(out.shape)}"
            )
    rows = gate_up.reshape(-1, width)  # a view unless the leading dims cannot be flattened
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    num_rows = rows.shape[0]
    if num_rows == 0 or inter == 0:
        return out
    per = 16 // gate_up.element_size()  # elements per 16-byte unit
    vec = (
        inter % per == 0
        and rows.stride(0) % per == 0
        and rows.data_ptr() % 16 == 0
        and out.data_ptr() % 16 == 0
    )
    units = inter // per if vec else inter
    args = (cuda.ptr(out), cuda.ptr(rows), np.int32(inter), np.int64(rows.stride(0)),
            np.int32(vec))  # fmt: skip
    grid = (num_rows, min(-(-units // ACT_THREADS), _MAX_GRID_Y))
    cuda.launch(_silu_fn(gate_up.dtype), grid, (ACT_THREADS,), args)
    return out
