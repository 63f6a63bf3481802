"""Greedy generation straight through the model (no engine), and the entry point of the ranks
that run it sharded: what the tensor-parallel parity tests compare with transformers.

Every prompt of a case runs as one batch: one prefill step over all prompts, then one decode
step per new token, over a small paged KV cache of this rank's KV heads. Each request owns a
contiguous run of blocks (block 0 is never used, as in the engine's pool)::

    request r      blocks 1 + r * B ... (r + 1) * B       (B = blocks per request)
    position p     slot = block_table[r, p // block_size] * block_size + p % block_size
"""

from __future__ import annotations

from pathlib import Path

import torch

from engine_svc.distributed import (
    SINGLE,
    TPGroup,
    destroy_tensor_parallel,
    init_tensor_parallel,
)
from engine_svc.models.llama import LlamaForCausalLM
from engine_svc.models.loader import load_model
from kernels.attention_backends import Kernels, select_kernels
from kernels.attention_metadata import AttentionMetadata

BLOCK_SIZE = 16


def cpu_kernels(head_dim: int) -> Kernels:
    """What the CPU engine runs: the C decode kernel and fused norms (``auto`` on the CPU)."""
    from engine_svc import envs

    cache = envs.cache_dir() / "kernels"
    return select_kernels("cpu", torch.device("cpu"), torch.float32, head_dim, BLOCK_SIZE, cache)


def load(model_dir: Path, tp: TPGroup = SINGLE) -> LlamaForCausalLM:
    from engine_svc.models.loader import read_hf_config

    cfg = read_hf_config(model_dir)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kernels = cpu_kernels(head_dim)
    return load_model(model_dir, torch.float32, torch.device("cpu"), 256, kernels, tp)


def _meta(
    q_lens: list[int], seq_lens: list[int], tables: torch.Tensor, decode: bool
) -> AttentionMetadata:
    slots, starts = [], [0]
    for r, (q, s) in enumerate(zip(q_lens, seq_lens, strict=True)):
        pos = torch.arange(s - q, s)
        slots.append(tables[r, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE)
        starts.append(starts[-1] + q)
    return AttentionMetadata(
        num_reqs=len(q_lens),
        num_decodes=len(q_lens) if decode else 0,
        num_tokens=starts[-1],
        slot_mapping=torch.cat(slots),
        block_tables=tables,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens_cpu=list(seq_lens),
        query_start_loc_cpu=starts,
        max_decode_seq_len=max(seq_lens) if decode else 0,
        max_seq_len=max(seq_lens),
    )


@torch.inference_mode()
def greedy(
    model: LlamaForCausalLM, prompts: list[list[int]], max_new: int
) -> tuple[list[list[int]], torch.Tensor]:
    """``max_new`` greedy tokens for each prompt (at least 2 tokens long), EOS ignored, and the
    logits the prefill step computed for each prompt's last token, [prompts, vocab]."""
    assert all(len(p) >= 2 for p in prompts), "a one-token prompt would be a decode row"
    plan, spec = model.plan, model.spec
    per_req = -(-(max(map(len, prompts)) + max_new) // BLOCK_SIZE)
    num_blocks = 1 + per_req * len(prompts)
    shape = (num_blocks, BLOCK_SIZE, plan.num_kv_heads, spec.head_dim)
    kv = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(spec.num_layers)]
    tables = torch.arange(1, num_blocks, dtype=torch.int32).view(len(prompts), per_req)
    lens = [len(p) for p in prompts]
    ids = torch.tensor([t for p in prompts for t in p])
    positions = torch.cat([torch.arange(n) for n in lens])
    meta = _meta(lens, lens, tables, decode=False)
    out: list[list[int]] = [[] for _ in prompts]
    first_logits = torch.empty(0)
    for step in range(max_new):
        hidden = model(ids, positions, kv, meta)
        last = torch.tensor(meta.query_start_loc_cpu[1:]) - 1
        logits = model.compute_logits(hidden[last])
        if step == 0:
            first_logits = logits.clone()
        tokens = logits.argmax(dim=-1)
        for row, t in zip(out, tokens.tolist(), strict=True):
            row.append(t)
        ids, positions = tokens, torch.tensor(lens)
        lens = [n + 1 for n in lens]
        meta = _meta([1] * len(lens), lens, tables, decode=True)
    return out, first_logits


def run_rank(rank: int, size: int, store: str, cases: list[dict[str, object]], out: str) -> None:
    """One rank of a ``size``-way group (``torch.multiprocessing.spawn``'s entry point): greedy
    tokens of every case (``model``: checkpoint directory, ``prompts``, ``max_new``) and their
    prefill logits; rank 0 saves them to ``out`` (``torch.save``), one pair per case."""
    torch.set_num_threads(1)  # the ranks share the machine's cores
    tp = init_tensor_parallel(rank, size, store, torch.device("cpu"), timeout_s=60)
    try:
        results = []
        for case in cases:
            model = load(Path(str(case["model"])), tp)
            prompts: list[list[int]] = case["prompts"]  # type: ignore[assignment]
            results.append(greedy(model, prompts, int(case["max_new"])))  # type: ignore[call-overload]
        if tp.is_first:
            torch.save(results, out)
    finally:
        destroy_tensor_parallel(tp)
