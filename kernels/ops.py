"""The kernel entry points the model calls. By default every op is the torch reference; the CUDA
versions (kernels/*.cu through ``kernels.cuda_ops``) run only on CUDA tensors and only with
TANDEM_CUDA_KERNELS=1 (see the opt-in dispatch at the bottom)."""

from __future__ import annotations

from types import ModuleType

import torch

from kernels import reference, reference_norm_rope
from kernels.attention_metadata import AttentionMetadata


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter this step's K/V into their cache slots (``kernels.reference.write_kv_cache``)."""
    if _use_cuda(key_cache):
        _cuda_ops().write_kv_cache(key, value, key_cache, value_cache, slot_mapping)
        return
    reference.write_kv_cache(key, value, key_cache, value_cache, slot_mapping)


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal attention over the paged cache (``kernels.reference.paged_attention``)."""
    if _use_cuda(query):
        return _cuda_ops().paged_attention(query, key_cache, value_cache, meta, scale)
    return reference.paged_attention(query, key_cache, value_cache, meta, scale)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in float32, cast back to the input dtype before the weight (as transformers does)."""
    if _use_cuda(x):
        return _cuda_ops().rms_norm(x, weight, eps)
    return reference_norm_rope.rms_norm(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)``."""
    if _use_cuda(x):
        return _cuda_ops().fused_add_rms_norm(x, residual, weight, eps)
    return reference_norm_rope.fused_add_rms_norm(x, residual, weight, eps)


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> None:
    """Neox rotary embedding of q and k, in place."""
    if _use_cuda(query):
        _cuda_ops().rotary_embedding(positions, query, key, cos, sin)
        return
    reference_norm_rope.rotary_embedding(positions, query, key, cos, sin)


# --------------------------------------------------------------------------------------------
# Opt-in CUDA dispatch. CPU tensors never look at the environment, and nothing here imports
# CuPy: kernels.cuda_ops imports it at its first launch. engine_svc.envs is imported lazily
# because engine_svc itself imports this module.


def _use_cuda(t: torch.Tensor) -> bool:
    if not t.is_cuda:
        return False
    from engine_svc import envs

    return envs.cuda_kernels_enabled()


def _cuda_ops() -> ModuleType:
    from kernels import cuda_ops

    return cuda_ops


__all__ = [
    "fused_add_rms_norm",
    "paged_attention",
    "rms_norm",
    "rotary_embedding",
    "write_kv_cache",
]
