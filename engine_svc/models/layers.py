"""Building blocks shared by the decoder models: RMSNorm, rotary embedding, paged attention."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from kernels import reference_norm_rope
from kernels.attention_backends import AttentionBackend, FusedAddRmsNorm, RmsNorm
from kernels.attention_metadata import AttentionMetadata
from kernels.reference_norm_rope import rotate_neox


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, optionally fused with the residual add.

    ``forward(x, residual)`` returns ``(normed(x + residual), x + residual)``, the vLLM idiom that
    lets each decoder layer carry the residual stream without an extra add. The fused kernel may
    write its results over ``x`` and ``residual`` (the layers own both and use only the results).
    """

    def __init__(
        self,
        size: int,
        eps: float,
        impl: RmsNorm = reference_norm_rope.rms_norm,
        fused: FusedAddRmsNorm = reference_norm_rope.fused_add_rms_norm,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        # the engine's kernel choice (kernels.attention_backends.Kernels)
        self._impl, self._fused = impl, fused

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self._impl(x, self.weight, self.eps), x
        return self._fused(x, residual, self.weight, self.eps)

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        return self._impl(x, self.weight, self.eps)


def _rope_dim(head_dim: int, rope: dict[str, Any]) -> int:
    return int(head_dim * float(rope.get("partial_rotary_factor", 1.0)))


def _rope_inv_freq(head_dim: int, rope: dict[str, Any]) -> torch.Tensor:
    base = float(rope.get("rope_theta", 10000.0))
    dim = _rope_dim(head_dim, rope)
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(rope["factor"])
    if kind == "llama3":
        factor = float(rope["factor"])
        low, high = float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
        old_len = float(rope["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(f"unsupported rope_type {kind!r}; supported: default, linear, llama3")


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding with a cos/sin table precomputed up to ``max_positions``.

    The tables are float32 buffers whatever the serving dtype. Built on the meta device they only
    have their shape (computing them there would import torch's meta decompositions, ~1 s): call
    ``init_tables(device)`` once the model is materialised.
    """

    def __init__(self, head_dim: int, max_positions: int, rope: dict[str, Any]) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.rope = dict(rope)
        if torch.get_default_device().type == "meta":
            width = 2 * len(range(0, _rope_dim(head_dim, rope), 2))  # cat(freqs, freqs)
            cos, sin = torch.empty(max_positions, width), torch.empty(max_positions, width)
        else:
            cos, sin = self._tables()
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def init_tables(self, device: torch.device) -> None:
        """(Re)compute the cos/sin tables in float32 on ``device``."""
        with torch.device(device):
            self.cos, self.sin = self._tables()

    def _tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        # On the ambient default device (``with torch.device(...)``), in float32.
        inv_freq = _rope_inv_freq(self.head_dim, self.rope)
        t = torch.arange(self.max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    def lookup(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin at ``positions`` for :meth:`rotate`: [T, 1, rot_dim / 2] in ``dtype``.

        The model looks them up once per forward and every layer uses them (the tables repeat
        their first half, so half is all the rotation needs)."""
        half = self.cos.shape[-1] // 2
        cos = self.cos[positions, :half].to(dtype).unsqueeze(1)
        sin = self.sin[positions, :half].to(dtype).unsqueeze(1)
        return cos, sin

    def rotate(
        self, q: torch.Tensor, k: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q [T, H, D] and k [T, Hkv, D] (new tensors; the inputs are left alone)."""
        cos, sin = cos_sin
        return rotate_neox(q, cos, sin), rotate_neox(k, cos, sin)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotate(q, k, self.lookup(positions, q.dtype))


class PagedAttention(nn.Module):
    """Writes this step's K/V into the paged cache, then attends over each request's context,
    through the attention backend the engine chose at start."""

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, backend: AttentionBackend
    ) -> None:
        super().__init__()
        self.backend = backend
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        key_cache, value_cache = kv_cache
        self.backend.write_kv_cache(k, v, key_cache, value_cache, meta.slot_mapping)
        return self.backend.forward(q, key_cache, value_cache, meta, self.scale, (k, v))

    def attend(
        self,
        q: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Attention only: this step's K/V (``new_kv``, when at hand) are already in the cache
        (a fused prologue wrote them)."""
        return self.backend.forward(q, kv_cache[0], kv_cache[1], meta, self.scale, new_kv)
