"""Pure-torch references for RMSNorm (plain and fused with the residual add), the neox rotary
embedding, and the two fused into one layer's attention prologue with the KV cache write: the
ground truth for the kernels in ``norm_rope.cu``, with the same signatures as the wrappers in
``kernels.cuda_ops``. They round exactly where the model's layers round."""

from __future__ import annotations

import torch

from kernels.reference import write_kv_cache


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in float32, cast back to the input dtype before the weight (as transformers does)."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)``, the sum rounded to the input dtype first."""
    summed = x + residual
    return rms_norm(summed, weight, eps), summed


def rotary_embedding(
    positions: torch.Tensor,  # [num_tokens] int64
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim], rotated in place
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], rotated in place
    cos: torch.Tensor,  # [max_positions, rot_dim] float32, first half repeated
    sin: torch.Tensor,
) -> None:
    """Neox-style rotary embedding on the first ``rot_dim`` dims of every head, in place
    (``rotate_neox`` at the tables' rows for ``positions``)."""
    half = cos.shape[-1] // 2
    c = cos[positions, :half].to(query.dtype).unsqueeze(1)
    s = sin[positions, :half].to(query.dtype).unsqueeze(1)
    for x in (query, key):
        x.copy_(rotate_neox(x, c, s))


def rotate_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox rotation of the first 2h dims of every head (h = cos.shape[-1]), as a new tensor::

        out[:h]   = x[:h] cos - x[h:2h] sin
        out[h:2h] = x[h:2h] cos + x[:h] sin       out[2h:] = x[2h:]

    ``cos``/``sin``: [num_tokens, 1, h] in x's dtype. Written into one output with ``out=`` and
    ``addcmul_``: no cat, no negated copy (10x faster than x * cos + rotate_half(x) * sin at 2048
    tokens on the CPU). The model's layers use this same function.
    """
    h = cos.shape[-1]
    x1, x2 = x[..., :h], x[..., h : 2 * h]
    out = torch.empty_like(x)
    o1, o2 = out[..., :h], out[..., h : 2 * h]
    torch.mul(x1, cos, out=o1)
    o1.addcmul_(x2, sin, value=-1)
    torch.mul(x2, cos, out=o2)
    o2.addcmul_(x1, sin)
    if 2 * h < x.shape[-1]:
        out[..., 2 * h :] = x[..., 2 * h :]
    return out


def qk_norm_rope_kv(
    qkv: torch.Tensor,  # [T, (H + 2 Hkv) * D], unit stride in a row
    positions: torch.Tensor,  # [T] int64
    cos: torch.Tensor,  # [max_positions, rot_dim] float32, first half repeated
    sin: torch.Tensor,
    q_weight: torch.Tensor | None,  # [D], or None with k_weight (no q/k norm)
    k_weight: torch.Tensor | None,
    eps: float,
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64; slot < 0: a padding token, written nowhere
    num_heads: int,
    num_kv_heads: int,
) -> torch.Tensor:
    """One layer's attention prologue, as the model's unfused layers compute it: q and k
    RMSNorm-ed (when weights are given), rotated with ``rotate_neox`` at cos/sin looked up as
    ``RotaryEmbedding.lookup`` does, k and v written to the caches at ``slot_mapping``; the
    rotated q and k copied back into ``qkv``. Returns the q part of ``qkv`` as a view
    [T, H, D]."""
    t, d = qkv.shape[0], key_cache.shape[-1]
    q_size, kv_size = num_heads * d, num_kv_heads * d
    q = qkv[:, :q_size].view(t, num_heads, d)
    k = qkv[:, q_size : q_size + kv_size].view(t, num_kv_heads, d)
    v = qkv[:, q_size + kv_size : q_size + 2 * kv_size].view(t, num_kv_heads, d)
    qn, kn = q, k
    if q_weight is not None and k_weight is not None:
        qn, kn = rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps)
    half = cos.shape[-1] // 2
    c = cos[positions, :half].to(qkv.dtype).unsqueeze(1)
    s = sin[positions, :half].to(qkv.dtype).unsqueeze(1)
    qr, kr = rotate_neox(qn, c, s), rotate_neox(kn, c, s)
    write_kv_cache(kr, v, key_cache, value_cache, slot_mapping)
    q.copy_(qr)
    k.copy_(kr)
    return q
