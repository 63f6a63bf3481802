"""The kernels one engine runs, chosen once at start: an attention backend and the norm it uses.

Every backend keeps the KV cache in one layout, ``[num_blocks, block_size, num_kv_heads,
head_dim]`` per layer for K and for V (see ``kernels.reference``), so they are interchangeable
and testable against each other. They differ in how attention reads it:

    torch   the reference: decode gathers each request's blocks, padded to the longest context,
            in float32 (every device; the ground truth).
    cpu     decode reads the paged cache in place with a C kernel built for this CPU
            (kernels/paged_decode_cpu.c: no gather, no padding, the cache's dtype); prefill
            chunks through torch's scaled_dot_product_attention per request. RMSNorm (with
            the residual add) and SiLU-and-multiply in one pass each (norm_act_cpu.c).
    cuda    the CUDA C kernels (paged_decode.cu split-K decode; prefill through torch's
            FlashAttention-2 where it runs and passes its start-up check, kernels.flash_prefill,
            else paged_prefill.cu), RMSNorm (plain and fused with the residual add), q/k norm +
            rotary + KV-cache write in one kernel (norm_rope.cu), SiLU-and-multiply
            (activation.cu). Given the engine's shape
            (``DecodeShape``) its decode is graph-safe: the split-K partition count depends on
            the batch size and max_model_len only, its partials live in a preallocated
            workspace.

``select_kernels("auto", ...)`` takes ``cpu`` on the CPU when a C compiler is there (else
``torch``) and ``cuda`` on CUDA: every kernel is compiled and loaded at once, then checked
against its torch reference on a small random case; if CuPy is missing or anything fails, it
logs why and takes ``torch``. Asked for by name, a backend that cannot run is an error. Nothing
here reads the environment: the engine's config decides.

``graph_safe``: the backend's decode reads sequence lengths and block tables from the device
only, so a CUDA graph captured with the metadata's host-side fields at their bounds replays
correctly for any batch (``engine_svc.worker.cuda_graphs``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from kernels import reference, reference_norm_rope
from kernels.attention_metadata import AttentionMetadata

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "torch", "cpu", "cuda")


class AttentionBackend(Protocol):
    """Writes a step's K/V into the paged cache and attends over it."""

    name: str
    graph_safe: bool  # decode reads lengths and block tables from the device only

    def write_kv_cache(
        self,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,
        key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # [num_tokens]; a negative slot skips the token
    ) -> None: ...

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """``new_kv``: this step's key and value, already written to the cache; a backend may
        read a request's context from them when the step holds all of it (no cached prefix)."""
        ...


RmsNorm = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
# (x, residual, weight, eps) -> (rms_norm(x + residual), x + residual); may write over x and
# residual, which the caller then uses only through the results.
FusedAddRmsNorm = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]
]
# [..., 2 * I] rows of [gate | up] -> silu(gate) * up, [..., I]; may be computed over the input.
SiluAndMul = Callable[[torch.Tensor], torch.Tensor]
# (qkv, positions, cos, sin, q_weight, k_weight, eps, key_cache, value_cache, slot_mapping,
#  num_heads, num_kv_heads) -> q [T, H, D]: q/k RMSNorm (weights None: none), neox rotary, K/V
# written to the cache; q and k rotated in place in qkv (kernels.reference_norm_rope).
QkNormRopeKv = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class Kernels:
    attention: AttentionBackend
    rms_norm: RmsNorm
    fused_add_rms_norm: FusedAddRmsNorm = reference_norm_rope.fused_add_rms_norm
    silu_and_mul: SiluAndMul = reference.silu_and_mul
    # One kernel for the attention's prologue; None: the model's composite of torch ops (it
    # looks the rotary tables up once per forward, which the CPU paths prefer).
    qk_norm_rope_kv: QkNormRopeKv | None = None


@dataclass(frozen=True)
class DecodeShape:
    """What the CUDA decode needs to know at start to be graph-safe: the partition count of
    every batch size and the workspace of the largest."""

    num_heads: int
    num_kv_heads: int
    max_model_len: int
    max_num_seqs: int


class TorchAttention:
    name = "torch"
    # Decode gathers up to meta.max_decode_seq_len: captured at the bound, a graph would gather
    # max_model_len tokens for every row.
    graph_safe = False

    def write_kv_cache(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        reference.write_kv_cache(key, value, key_cache, value_cache, slot_mapping)

    def forward(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        return reference.paged_attention(query, key_cache, value_cache, meta, scale, new_kv)


class CpuAttention(TorchAttention):
    name = "cpu"
    graph_safe = True  # the C decode reads lengths and block tables from the tensors

    def __init__(self, library: object) -> None:
        self._lib = library

    def forward(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        from kernels import cpu_ops

        out = torch.empty_like(query)
        b = meta.num_decodes
        if b:
            cpu_ops.paged_decode(
                self._lib,  # type: ignore[arg-type]
                query[:b],
                key_cache,
                value_cache,
                _int32(meta.block_tables[:b]),
                _int32(meta.seq_lens[:b]),
                scale,
                out=out[:b],
            )
        reference.prefill_rows(out, query, key_cache, value_cache, meta, scale, new_kv)
        return out


class _DecodePlan:
    """Partition counts by batch size (from the context bound, never from a step's lengths)
    and the split-K workspace, allocated once for the largest batch."""

    def __init__(self, shape: DecodeShape, head_dim: int, device: torch.device) -> None:
        from kernels import cuda_ops

        self._shape = shape
        self._num_sms = cuda_ops.num_sms(device)
        self._partitions: dict[int, int] = {}
        # Sized for the launch with the most (sequence, partition) pairs, laid out flat.
        rows = max(b * self.partitions(b) for b in range(1, shape.max_num_seqs + 1))
        self.workspace = cuda_ops.DecodeWorkspace(rows, shape.num_heads, head_dim, 1, device)

    def partitions(self, num_seqs: int) -> int:
        p = self._partitions.get(num_seqs)
        if p is None:
            from kernels import cuda_ops

            s = self._shape
            p = cuda_ops.decode_partitions(
                num_seqs, s.num_heads, s.num_kv_heads, s.max_model_len, self._num_sms
            )
            self._partitions[num_seqs] = p
        return p


class CudaAttention:
    name = "cuda"

    def __init__(
        self,
        plan: _DecodePlan | None = None,
        flash_prefill: bool = False,
        tiled_decode: bool = False,
    ) -> None:
        """``plan`` None: partitions from each step's lengths, partials allocated per call
        (tests); not graph-safe. ``flash_prefill``: multi-token rows through FlashAttention-2
        (``kernels.flash_prefill``) instead of paged_prefill.cu. ``tiled_decode``: the decode
        kernel's tiled variant (``cuda_ops.paged_attention``; off until measured on a GPU)."""
        self._plan = plan
        self.graph_safe = plan is not None
        self.flash_prefill = flash_prefill
        self.tiled_decode = tiled_decode

    def write_kv_cache(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        from kernels import cuda_ops

        cuda_ops.write_kv_cache(key, value, key_cache, value_cache, slot_mapping)

    def forward(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        from kernels import cuda_ops

        plan, partitions, workspace = self._plan, None, None
        if plan is not None and meta.num_decodes:
            partitions, workspace = plan.partitions(meta.num_decodes), plan.workspace
        out = cuda_ops.paged_attention(
            query,
            key_cache,
            value_cache,
            meta,
            scale,
            partitions=partitions,
            workspace=workspace,
            prefill=not self.flash_prefill,
            tiled_decode=self.tiled_decode,
        )
        if self.flash_prefill:
            from kernels import flash_prefill

            flash_prefill.prefill(out, query, key_cache, value_cache, meta, scale, new_kv)
        return out


def _int32(t: torch.Tensor) -> torch.Tensor:
    """int32 with contiguous rows (a view into a wider table is kept as it is)."""
    if t.dtype == torch.int32 and t.stride(-1) == 1:
        return t
    return t.to(torch.int32).contiguous()


def select_kernels(
    choice: str,
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int,
    block_size: int,
    cache_dir: Path,
    shape: DecodeShape | None = None,
) -> Kernels:
    """The kernels for this engine. ``choice`` is one of :data:`BACKENDS`; a backend asked for
    by name that cannot run here is a ValueError naming why (auto falls back instead).
    ``shape``: the engine's, which makes the cuda backend's decode graph-safe."""
    if choice not in BACKENDS:
        raise ValueError(f"attention backend must be one of {', '.join(BACKENDS)}, got {choice!r}")
    if choice == "auto":
        if device.type == "cuda":
            try:
                return cuda_kernels(device, dtype, head_dim, block_size, shape)
            except Exception as e:  # noqa: BLE001 -- no CuPy, a compile error, a wrong result
                logger.warning("CUDA kernels unavailable (%s): using the torch references", e)
                return Kernels(TorchAttention(), reference_norm_rope.rms_norm)
        try:
            return _cpu(dtype, head_dim, block_size, cache_dir)
        except (ValueError, RuntimeError) as e:
            logger.warning("CPU attention kernel unavailable (%s): using torch", e)
            choice = "torch"
    if choice == "torch":
        return Kernels(TorchAttention(), reference_norm_rope.rms_norm)
    if choice == "cpu":
        if device.type != "cpu":
            raise ValueError(f"the cpu attention backend runs on the CPU, not {device}")
        return _cpu(dtype, head_dim, block_size, cache_dir)
    if device.type != "cuda":
        raise ValueError(f"the cuda attention backend needs a CUDA device, not {device}")
    return cuda_kernels(device, dtype, head_dim, block_size, shape)


def cuda_kernels(
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int,
    block_size: int,
    shape: DecodeShape | None,
) -> Kernels:
    """The cuda backend: head size checked, every kernel compiled and loaded now (nothing may
    compile during a CUDA graph capture), then each checked against its torch reference
    (``kernels.self_check``); raises whatever fails."""
    from kernels import cuda_ops, self_check

    for prefill in (False, True):  # a head size the kernels are not built for fails now
        cuda_ops.check_head_dim(head_dim, dtype, prefill)
    cuda_ops.preload(dtype, head_dim)
    plan = None if shape is None else _DecodePlan(shape, head_dim, device)
    heads = (4, 2) if shape is None else (shape.num_heads, shape.num_kv_heads)
    kernels = Kernels(
        CudaAttention(plan, _flash_prefill(device, dtype, head_dim, block_size, heads)),
        cuda_ops.rms_norm,
        cuda_ops.fused_add_rms_norm,
        cuda_ops.silu_and_mul,
        cuda_ops.qk_norm_rope_kv,
    )
    self_check.check(kernels, device, dtype, head_dim, block_size, heads)
    return kernels


def _flash_prefill(
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int,
    block_size: int,
    heads: tuple[int, int],
) -> bool:
    """Whether prefill rows go through FlashAttention-2: where it runs and passes its check
    against the torch reference on this GPU (else paged_prefill.cu, with the reason logged)."""
    from kernels import flash_prefill, self_check

    reason = flash_prefill.unsupported(device, dtype, head_dim)
    if reason is None:
        try:
            self_check.check_flash_prefill(device, dtype, head_dim, block_size, heads)
        except Exception as e:  # noqa: BLE001 -- a wrong result or the kernel's own error
            reason = f"it failed its check: {e}"
    if reason is not None:
        logger.warning("prefill attention: paged_prefill.cu (FlashAttention-2 unused: %s)", reason)
        return False
    logger.info("prefill attention: FlashAttention-2 (torch's variable-length kernel)")
    return True


def _cpu(dtype: torch.dtype, head_dim: int, block_size: int, cache_dir: Path) -> Kernels:
    from kernels import cpu_ops

    if not cpu_ops.supports(dtype):
        raise ValueError(f"the CPU decode kernel supports float32 and bfloat16, not {dtype}")
    lib = cpu_ops.load(head_dim, block_size, cache_dir)  # raises CpuKernelUnavailable
    norm_act = cpu_ops.NormAct(cache_dir)
    return Kernels(
        CpuAttention(lib), norm_act.rms_norm, norm_act.fused_add_rms_norm, norm_act.silu_and_mul
    )
