"""Random paged-attention batches for the GPU kernel tests (no CuPy import here)."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from kernels.attention_metadata import AttentionMetadata

# Tolerances, kernel vs torch reference: both accumulate in fp32 and round once at the end, so
# the difference is reduction order plus about one rounding step of the output dtype.
ATTN_TOL = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.float16: dict(atol=2e-3, rtol=1e-2),
    torch.bfloat16: dict(atol=1e-2, rtol=1.6e-2),
}
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
# Elementwise kernels vs their references: one rounding step of the dtype.
ONE_STEP = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
}


@dataclass
class AttentionCase:
    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    meta: AttentionMetadata
    scale: float

    def poison_unused_slots(self) -> None:
        """NaN into every cache slot outside the requests' contexts (block 0, free blocks, the
        tail of each last block): a kernel that reads one, even with weight 0, outputs NaN."""
        bs = self.key_cache.shape[1]
        used = torch.zeros(self.key_cache.shape[0] * bs, dtype=torch.bool)
        tables = self.meta.block_tables.cpu()
        for r, seq_len in enumerate(self.meta.seq_lens_cpu):
            pos = torch.arange(seq_len)
            used[tables[r, pos // bs] * bs + pos % bs] = True
        unused = (~used).to(self.key_cache.device)
        for cache in (self.key_cache, self.value_cache):
            cache.view(-1, *cache.shape[2:])[unused] = float("nan")


def make_case(
    q_lens: list[int],
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    block_size: int = 16,
    seed: int = 0,
    device: str = "cuda",
    index_dtype: torch.dtype = torch.int64,
) -> AttentionCase:
    """Requests with ``q_lens`` query tokens each over contexts of ``seq_lens`` (including the
    queries). Leading single-token requests count as decodes. Blocks are scattered at random and
    block 0 is never used, as in the engine's pool. ``index_dtype``: of the block tables,
    ``seq_lens`` and ``query_start_loc`` (the engine's are int32; the slot mapping is int64)."""
    assert all(0 < q <= s for q, s in zip(q_lens, seq_lens, strict=True))
    rng = random.Random(seed)
    need = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(need) + 1 + 3
    ids = list(range(1, num_blocks))
    rng.shuffle(ids)
    max_blocks = max(need)
    tables = torch.zeros(len(q_lens), max_blocks, dtype=torch.int64)
    at = 0
    for r, n in enumerate(need):
        tables[r, :n] = torch.tensor(ids[at : at + n])
        at += n
    num_decodes = 0
    while num_decodes < len(q_lens) and q_lens[num_decodes] == 1:
        num_decodes += 1
    starts = [0]
    for q in q_lens:
        starts.append(starts[-1] + q)
    slots = []
    for r, (q, s) in enumerate(zip(q_lens, seq_lens, strict=True)):
        pos = torch.arange(s - q, s)
        slots.append(tables[r, pos // block_size] * block_size + pos % block_size)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    gen = torch.Generator(device=device).manual_seed(seed)  # random numbers made on the device
    key_cache = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    value_cache = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    query = torch.randn(starts[-1], num_heads, head_dim, generator=gen, device=device, dtype=dtype)
    meta = AttentionMetadata(
        num_reqs=len(q_lens),
        num_decodes=num_decodes,
        num_tokens=starts[-1],
        slot_mapping=torch.cat(slots).to(device),
        block_tables=tables.to(device, index_dtype),
        seq_lens=torch.tensor(seq_lens, dtype=index_dtype, device=device),
        query_start_loc=torch.tensor(starts, dtype=index_dtype, device=device),
        seq_lens_cpu=list(seq_lens),
        query_start_loc_cpu=starts,
        max_decode_seq_len=max(seq_lens[:num_decodes], default=0),
        max_seq_len=max(seq_lens),
    )
    return AttentionCase(query, key_cache, value_cache, meta, head_dim**-0.5)


def poison_allocator(device: str = "cuda") -> None:
    """Leave NaN-filled blocks in both pools of torch's caching allocator (small: <= 1 MiB,
    large), so that a kernel's internal ``torch.empty`` buffers (split-K partials) start as NaN
    rather than as stale numbers that might happen to look right."""
    nan = float("nan")
    junk = [torch.full((1 << 26,), nan, device=device)]  # 256 MiB, large pool
    junk += [torch.full((1 << 17,), nan, device=device) for _ in range(64)]  # 512 KiB each
    del junk
