"""The kernel entry points the model calls. Today every op is the torch reference; the CUDA
versions (issue 4) plug in here behind the same signatures."""

from __future__ import annotations

import torch

from kernels.reference import paged_attention, write_kv_cache


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in float32, cast back to the input dtype before the weight (as transformers does)."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


__all__ = ["paged_attention", "rms_norm", "write_kv_cache"]
