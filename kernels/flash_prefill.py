"""Prefill and chunked prefill on tensor cores: torch's FlashAttention-2 variable-length kernel.

The multi-token rows of a step (every row after the decodes) go through one call of
``torch.ops.aten._flash_attention_forward`` (FlashAttention-2, shipped inside torch's CUDA
builds: sm_80 and newer, float16 and bfloat16, head sizes up to 256), packed by cumulative
sequence lengths. Its paged mode needs pages of 256 tokens and the engine's blocks are 16, so
each row's keys and values are handed over contiguous:

    no row has a cached prefix   the step's own K/V (``new_kv``), as the rows lie in the query
    some row has one             every row's whole context gathered from the paged cache into
                                 a [sum(seq_lens), num_kv_heads, head_dim] workspace (one
                                 index_select per cache; a copy at memory speed, small next to
                                 the attention's FLOPs)

    rows r0, r1 (r1 after a cached prefix of 3 tokens):
        query  [a0 a1 a2 | b3 b4]        cu_seqlens_q [0, 3, 5]
        keys   [a0 a1 a2 | b0 b1 b2 b3 b4] cu_seqlens_k [0, 3, 8]

FlashAttention-2's causal mask is aligned to the bottom right when a row has fewer queries than
keys: query i of a row with q queries over s keys sees keys 0 .. s - q + i, which is exactly a
chunk after its cached prefix. (torch's scaled_dot_product_attention refuses ``is_causal`` with
q != s for this reason: its own convention is the top left.)

Chosen over writing our own tensor-core kernel because it is maintained, tuned for sm_80/sm_90
and already in every CUDA build of torch the engine runs on; ``benchmarks/kernels_prefill.py``
measures it against the scalar kernel (``paged_prefill.cu``, the fallback for float32, sm_75
and head sizes it lacks) and the GEMM rate of the same run.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kernels.attention_metadata import AttentionMetadata

MAX_HEAD_DIM = 256  # FlashAttention-2's largest head size
DTYPES = (torch.float16, torch.bfloat16)

# (q [Tq, H, D], k [Tk, Hkv, D], v, cu_seqlens_q [R+1] int32, cu_seqlens_k, max_q, max_k, scale)
# -> [Tq, H, D]: causal attention per row, the mask aligned to each row's last key.
VarlenAttention = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int, float],
    torch.Tensor,
]


def flash_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_q: int,
    max_k: int,
    scale: float,
) -> torch.Tensor:
    out, *_ = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k, 0.0, True, False, scale=scale
    )
    return out


def unsupported(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why the flash prefill cannot run here, or None when it can."""
    if device.type != "cuda":
        return f"it needs a CUDA device, not {device}"
    if dtype not in DTYPES:
        return f"FlashAttention-2 supports float16 and bfloat16, not {dtype}"
    if head_dim % 8 or head_dim > MAX_HEAD_DIM:
        return f"FlashAttention-2 supports head sizes of multiples of 8 to 256, not {head_dim}"
    major, _ = torch.cuda.get_device_capability(device)
    if major < 8:
        return f"FlashAttention-2 needs sm_80 or newer, this GPU is sm_{major}x"
    if not torch.backends.cuda.is_flash_attention_available():
        return "this torch build has no FlashAttention-2"
    return None


def prefill(
    out: torch.Tensor,
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    attend: VarlenAttention = flash_varlen,
) -> None:
    """Attention of the rows after the decodes into ``out`` (the decode rows are left as they
    are). ``new_kv``: this step's K and V, already written to the cache, used when no row has a
    cached prefix. ``attend``: the variable-length kernel (tests pass a reference)."""
    first, last = meta.num_decodes, meta.num_reqs
    if first == last:
        return
    starts = meta.query_start_loc_cpu
    q0, q1 = starts[first], starts[last]
    q_lens = [starts[r + 1] - starts[r] for r in range(first, last)]
    seq_lens = meta.seq_lens_cpu[first:last]
    device = query.device
    loc = meta.query_start_loc[first : last + 1]
    cu_q = (loc - loc[0]).to(torch.int32)
    if new_kv is not None and new_kv[0].dtype == key_cache.dtype and q_lens == seq_lens:
        k, v = new_kv[0][q0:q1], new_kv[1][q0:q1]
        cu_k, max_k = cu_q, max(q_lens)
    else:
        lens = meta.seq_lens[first:last].to(torch.int64)
        slots = context_slots(
            meta.block_tables[first:last], lens, sum(seq_lens), key_cache.shape[1]
        )
        k = key_cache.flatten(0, 1).index_select(0, slots)
        v = value_cache.flatten(0, 1).index_select(0, slots)
        cu_k = torch.zeros(last - first + 1, dtype=torch.int32, device=device)
        cu_k[1:] = torch.cumsum(lens, 0)
        max_k = max(seq_lens)
    out[q0:q1] = attend(query[q0:q1], k, v, cu_q, cu_k, max(q_lens), max_k, scale)


def context_slots(
    block_tables: torch.Tensor,  # [R, max_blocks]
    seq_lens: torch.Tensor,  # [R] int64, on the device
    total: int,  # sum(seq_lens), known on the host
    block_size: int,
) -> torch.Tensor:
    """The cache slot of every context token of every row, rows one after another: [total]
    int64. Made on the device with no host sync (``total`` is given)."""
    rows = torch.arange(seq_lens.shape[0], device=seq_lens.device)
    row_of = torch.repeat_interleave(rows, seq_lens, output_size=total)
    row_start = torch.cumsum(seq_lens, 0) - seq_lens
    pos = torch.arange(total, device=seq_lens.device) - row_start[row_of]
    blocks = block_tables[row_of, pos // block_size].to(torch.int64)
    return blocks * block_size + pos % block_size
