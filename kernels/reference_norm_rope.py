"""Pure-torch references for RMSNorm (plain and fused with the residual add) and the neox rotary
embedding: the ground truth for the kernels in ``norm_rope.cu``, with the same signatures as the
wrappers in ``kernels.cuda_ops``. They round exactly where the model's layers round."""

from __future__ import annotations

import torch


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
    """Neox-style rotary embedding on the first ``rot_dim`` dims of every head, in place::

    x[:h], x[h:2h]  <-  x[:h] cos - x[h:2h] sin,  x[h:2h] cos + x[:h] sin      (h = rot_dim / 2)
    """
    rot = cos.shape[-1]
    c = cos[positions].to(query.dtype).unsqueeze(1)
    s = sin[positions].to(query.dtype).unsqueeze(1)
    for x in (query, key):
        part = x[..., :rot]
        half = rot // 2
        rotated = torch.cat((-part[..., half:], part[..., :half]), dim=-1)
        part.copy_(part * c + rotated * s)
