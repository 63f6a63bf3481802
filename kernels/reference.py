"""Pure-torch reference kernels: the CPU path, and the ground truth for the CUDA kernels.

Paged KV cache layout, one pair of tensors per layer::

    key_cache[num_blocks, block_size, num_kv_heads, head_dim]     (value_cache the same)

    token at position p of a request with block table bt lives in
        slot = bt[p // block_size] * block_size + p % block_size
        key_cache.view(-1, num_kv_heads, head_dim)[slot]
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.attention_metadata import AttentionMetadata


def write_kv_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64/int32; a negative slot skips the token
) -> None:
    """Scatter this step's K/V into their slots (padding rows carry slot -1 and are skipped)."""
    kc = key_cache.view(-1, *key_cache.shape[2:])
    vc = value_cache.view(-1, *value_cache.shape[2:])
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        slot_mapping, key, value = slot_mapping[keep], key[keep], value[keep]
    kc.index_copy_(0, slot_mapping, key.to(kc.dtype))
    vc.index_copy_(0, slot_mapping, value.to(vc.dtype))


def silu_and_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(gate) * up`` of each ``[gate | up]`` row (last dim), rounded to the dtype after the
    silu and after the product. Without ``out`` computed in place on the gate half (the CPU
    path): the result is a view of ``gate_up``, no [tokens, intermediate] temporaries. With
    ``out`` ([..., I], like the CUDA wrapper's result) written there, ``gate_up`` untouched."""
    gate, up = gate_up.chunk(2, dim=-1)
    if out is None:
        return F.silu(gate, inplace=True).mul_(up)
    return torch.mul(F.silu(gate), up, out=out)


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Causal attention of every scheduled query token over its request's cached context.

    Requests with one query token (decodes) are done together as one batched gather; requests
    with several (prefill chunks, possibly after a cached prefix) one at a time. ``new_kv``: see
    :func:`prefill_rows`. Returns [num_tokens, num_heads, head_dim].
    """
    out = torch.empty_like(query)
    if meta.num_decodes:
        out[: meta.num_decodes] = _decode_attention(
            query[: meta.num_decodes], key_cache, value_cache, meta, scale
        )
    prefill_rows(out, query, key_cache, value_cache, meta, scale, new_kv)
    return out


def prefill_rows(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Attention of the multi-token requests (rows after the decodes) into ``out``, one request
    at a time through torch's scaled_dot_product_attention.

    ``new_kv``: this step's K and V ([num_tokens, num_kv_heads, head_dim], already written to
    the cache). A request whose chunk is its whole context so far (no cached prefix) attends over
    them as they are instead of gathering the same values back from its blocks; they are used
    only when they have the cache's dtype, so the result is the same either way."""
    if new_kv is not None and new_kv[0].dtype != key_cache.dtype:
        new_kv = None
    for row in range(meta.num_decodes, meta.num_reqs):
        q_start, q_end = meta.query_start_loc_cpu[row], meta.query_start_loc_cpu[row + 1]
        seq_len = meta.seq_lens_cpu[row]
        if new_kv is not None and q_end - q_start == seq_len:
            k, v = new_kv[0][q_start:q_end], new_kv[1][q_start:q_end]
        else:
            nb = -(-seq_len // key_cache.shape[1])
            table = meta.block_tables[row, :nb]
            k = _gather(key_cache, table)[:seq_len]  # [S, Hkv, D]
            v = _gather(value_cache, table)[:seq_len]
        out[q_start:q_end] = _prefill_attention(query[q_start:q_end], k, v, scale)


def _gather(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """[..., nb] block ids -> [..., nb * block_size, num_kv_heads, head_dim]."""
    g = cache[block_ids]
    return g.view(*block_ids.shape[:-1], -1, *cache.shape[2:])


def _decode_attention(
    query: torch.Tensor,  # [B, H, D]
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    b, h, d = query.shape
    block_size = key_cache.shape[1]
    nb = -(-meta.max_decode_seq_len // block_size)
    tables = meta.block_tables[:b, :nb]
    k = _gather(key_cache, tables)  # [B, L, Hkv, D]
    v = _gather(value_cache, tables)
    hkv = k.shape[2]
    q = query.view(b, hkv, h // hkv, d)  # heads grouped by the KV head they share
    scores = torch.einsum("bkgd,blkd->bkgl", q.float(), k.float()) * scale
    length = torch.arange(k.shape[1], device=query.device)
    invalid = length[None, :] >= meta.seq_lens[:b, None]  # [B, L]
    scores.masked_fill_(invalid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bkgl,blkd->bkgd", probs, v.float())
    return out.reshape(b, h, d).to(query.dtype)


def _prefill_attention(
    query: torch.Tensor,  # [q_len, H, D]: the last q_len positions of the context
    k: torch.Tensor,  # [seq_len, Hkv, D]: the whole context
    v: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    q_len, h, _ = query.shape
    seq_len = k.shape[0]
    q = query.transpose(0, 1).unsqueeze(0)  # [1, H, q_len, D]
    k = k.transpose(0, 1).unsqueeze(0)  # [1, Hkv, S, D]
    v = v.transpose(0, 1).unsqueeze(0)
    if q_len == seq_len:
        mask = None
        causal = True
    else:
        # Query i sits at absolute position seq_len - q_len + i and sees keys 0..that position.
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
        k_pos = torch.arange(seq_len, device=query.device)
        mask = k_pos[None, :] <= q_pos[:, None]
        causal = False
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=h != k.shape[1]
    )
    return out.squeeze(0).transpose(0, 1)
