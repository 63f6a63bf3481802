"""The CUDA kernels checked against their torch references at engine start, on one small random
case: a kernel that is wrong on this GPU (a driver, an architecture or a compiler the GPU tests
never ran on) becomes a log line and the torch references under ``--attention-backend auto``,
rather than wrong tokens. Takes milliseconds; the GPU tests (tests/gpu) are the thorough check.

The case runs what a layer runs: RMSNorm fused with the residual add, the fused q/k norm +
rotary + KV-cache write, paged attention over one decode (crossing split-K partitions) and one
prefill chunk after a cached prefix, SiLU-and-multiply; the same on the references, compared.
``check_flash_prefill`` does the same for FlashAttention-2's prefill on its own, so that it can
be left out (the scalar prefill kernel taken) without losing the rest.
"""

from __future__ import annotations

import torch

from kernels import flash_prefill, reference, reference_norm_rope
from kernels.attention_backends import Kernels
from kernels.attention_metadata import AttentionMetadata
from kernels.flash_prefill import VarlenAttention

# Kernel vs reference (rtol, atol): reduction order plus about one rounding of the dtype.
_TOLERANCE = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (1e-2, 2e-3),
    torch.bfloat16: (1.6e-2, 1e-2),
}
_Q_LENS, _SEQ_LENS = (1, 6), (700, 40)  # a decode over 700 tokens, a 6-token chunk after 34


class KernelCheckFailed(RuntimeError):
    """A CUDA kernel's result differs from its torch reference beyond the tolerance."""


def check(
    kernels: Kernels,
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int,
    block_size: int,
    heads: tuple[int, int] = (4, 2),
) -> None:
    """Raise KernelCheckFailed naming the first kernel that disagrees with its reference.
    ``heads``: (query heads, KV heads) of the case; the model's, so that its decode runs the
    query-heads-per-block variant and the workspace the engine will use."""
    num_heads, num_kv_heads = heads
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device=device, dtype=dtype)

    hidden = num_heads * head_dim
    x, res, weight = rand(3, hidden), rand(3, hidden), rand(hidden)
    _compare(
        "fused_add_rms_norm",
        kernels.fused_add_rms_norm(x.clone(), res.clone(), weight, 1e-6),
        reference_norm_rope.fused_add_rms_norm(x, res, weight, 1e-6),
    )
    _compare(
        "rms_norm", kernels.rms_norm(x, weight, 1e-6), reference_norm_rope.rms_norm(x, weight, 1e-6)
    )
    gate_up = rand(3, 2 * hidden)
    _compare(
        "silu_and_mul",
        kernels.silu_and_mul(gate_up.clone()),
        reference.silu_and_mul(gate_up.clone()),
    )

    meta, slots = _metadata(device, block_size)
    num_blocks = int(meta.block_tables.max()) + 2
    cache = (
        rand(num_blocks, block_size, num_kv_heads, head_dim),
        rand(num_blocks, block_size, num_kv_heads, head_dim),
    )
    tokens = meta.num_tokens
    qkv = rand(tokens, (num_heads + 2 * num_kv_heads) * head_dim)
    positions = torch.tensor(
        [s - q + i for q, s in zip(_Q_LENS, _SEQ_LENS, strict=True) for i in range(q)],
        device=device,
    )
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, device=device) / head_dim))
    freqs = torch.outer(torch.arange(max(_SEQ_LENS), device=device, dtype=torch.float32), inv_freq)
    cos, sin = torch.cat((freqs, freqs), -1).cos(), torch.cat((freqs, freqs), -1).sin()
    qw, kw = rand(head_dim), rand(head_dim)
    results = []
    for fused, (kc, vc), q_in in (
        (kernels.qk_norm_rope_kv, (cache[0].clone(), cache[1].clone()), qkv.clone()),
        (reference_norm_rope.qk_norm_rope_kv, (cache[0].clone(), cache[1].clone()), qkv.clone()),
    ):
        assert fused is not None
        q = fused(q_in, positions, cos, sin, qw, kw, 1e-6, kc, vc, slots, num_heads, num_kv_heads)
        results.append((q.clone(), kc, vc))
    (q, kc, vc), (ref_q, ref_kc, ref_vc) = results
    _compare("qk_norm_rope_kv (q)", q, ref_q)
    _compare("qk_norm_rope_kv (key cache)", kc, ref_kc)
    _compare("qk_norm_rope_kv (value cache)", vc, ref_vc)
    scale = head_dim**-0.5
    _compare(
        "paged_attention",
        kernels.attention.forward(ref_q, ref_kc, ref_vc, meta, scale),
        reference.paged_attention(ref_q, ref_kc, ref_vc, meta, scale),
    )


def check_flash_prefill(
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int,
    block_size: int,
    heads: tuple[int, int] = (4, 2),
    attend: VarlenAttention | None = None,
) -> None:
    """FlashAttention-2 prefill (``kernels.flash_prefill``) against the torch reference: a step
    of one decode, a chunk after a cached prefix and a whole prompt (its context gathered from
    the cache), then a step of whole prompts only (read from the step's own K/V). ``attend``:
    the variable-length kernel checked (None: FlashAttention-2)."""

    num_heads, num_kv_heads = heads
    gen = torch.Generator(device=device).manual_seed(1)
    for q_lens, seq_lens in (((1, 6, 19), (700, 40, 19)), ((19, 33), (19, 33))):
        meta, slots = _metadata(device, block_size, q_lens, seq_lens)
        shape = (int(meta.block_tables.max()) + 2, block_size, num_kv_heads, head_dim)
        kc = torch.randn(shape, generator=gen, device=device, dtype=dtype)
        vc = torch.randn(shape, generator=gen, device=device, dtype=dtype)
        query = torch.randn(
            meta.num_tokens, num_heads, head_dim, generator=gen, device=device, dtype=dtype
        )
        flat = (kc.flatten(0, 1), vc.flatten(0, 1))
        new_kv = (flat[0][slots], flat[1][slots])
        scale = head_dim**-0.5
        want = reference.paged_attention(query, kc, vc, meta, scale)
        got = torch.full_like(want, float("nan"))
        flash_prefill.prefill(
            got, query, kc, vc, meta, scale, new_kv, attend or flash_prefill.flash_varlen
        )
        rows = slice(meta.query_start_loc_cpu[meta.num_decodes], meta.num_tokens)
        _compare("flash prefill", got[rows], want[rows])


def _metadata(
    device: torch.device,
    block_size: int,
    q_lens: tuple[int, ...] = _Q_LENS,
    seq_lens: tuple[int, ...] = _SEQ_LENS,
) -> tuple[AttentionMetadata, torch.Tensor]:
    """Requests of ``q_lens`` query tokens over contexts of ``seq_lens`` (leading single tokens
    are decodes), their blocks in reverse order (a table is not a range)."""
    need = [-(-s // block_size) for s in seq_lens]
    ids = list(range(sum(need), 0, -1))
    width = max(need)
    tables = torch.zeros(len(need), width, dtype=torch.int32)
    slots: list[int] = []
    for r, n in enumerate(need):
        tables[r, :n] = torch.tensor(ids[:n])
        ids = ids[n:]
        for p in range(seq_lens[r] - q_lens[r], seq_lens[r]):
            slots.append(int(tables[r, p // block_size]) * block_size + p % block_size)
    starts = [0]
    for q in q_lens:
        starts.append(starts[-1] + q)
    num_decodes = next((r for r, q in enumerate(q_lens) if q > 1), len(q_lens))
    meta = AttentionMetadata(
        num_reqs=len(q_lens),
        num_decodes=num_decodes,
        num_tokens=starts[-1],
        slot_mapping=torch.tensor(slots, device=device),
        block_tables=tables.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens_cpu=list(seq_lens),
        query_start_loc_cpu=starts,
        max_decode_seq_len=max(seq_lens[:num_decodes], default=0),
        max_seq_len=max(seq_lens),
    )
    return meta, meta.slot_mapping


Result = torch.Tensor | tuple[torch.Tensor, ...]


def _compare(name: str, got: Result, want: Result) -> None:
    pairs = (
        list(zip(got, want, strict=True))
        if isinstance(got, tuple) and isinstance(want, tuple)
        else [(got, want)]
    )
    for g, w in pairs:
        assert isinstance(g, torch.Tensor) and isinstance(w, torch.Tensor)
        rtol, atol = _TOLERANCE.get(w.dtype, (2e-5, 2e-5))
        try:
            torch.testing.assert_close(g, w, rtol=rtol, atol=atol, equal_nan=False)
        except AssertionError as e:
            first = str(e).strip().splitlines()
            raise KernelCheckFailed(f"{name} disagrees with its reference: {first[:3]}") from None
