"""transformers as the peer of Tandem's LLM in benchmarks/throughput.py: generate() with static
batching, and transformers' own continuous batching. Each takes the same requests (prompt token
ids, output length: greedy, EOS off, every request its own output length), runs ``warm`` first
untimed, and returns the seconds of the timed run."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

Request = tuple[list[int], int]  # prompt token ids, output length


def blocks_to_hold(reqs: list[Request], block_size: int) -> int:
    """Cache blocks that hold every request's whole sequence at once (no preemption)."""
    return sum(-(-(len(p) + o) // block_size) for p, o in reqs)


def _load(model_dir: Path, dtype: torch.dtype, device: str) -> Any:
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
    return model.to(device).eval()


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


@torch.inference_mode()
def run_static(
    model_dir: Path,
    reqs: list[Request],
    warm: list[Request],
    *,
    dtype: torch.dtype,
    device: str,
    batch_size: int,
) -> float:
    """Static batching: fixed batches in arrival order, left-padded, each generating its longest
    output (min_new_tokens = max_new_tokens); only the requested tokens count."""
    model = _load(model_dir, dtype, device)
    pad = 0

    def run_batch(batch: list[Request]) -> None:
        longest = max(len(p) for p, _ in batch)
        ids = torch.full((len(batch), longest), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, (p, _) in enumerate(batch):
            ids[i, longest - len(p) :] = torch.tensor(p)
            mask[i, longest - len(p) :] = 1
        new = max(o for _, o in batch)
        model.generate(
            ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=pad,
            eos_token_id=None,
        )

    run_batch(warm)
    _sync(device)
    start = time.perf_counter()
    for i in range(0, len(reqs), batch_size):
        run_batch(reqs[i : i + batch_size])
    _sync(device)
    return time.perf_counter() - start


def run_continuous(
    model_dir: Path,
    reqs: list[Request],
    warm: list[Request],
    *,
    dtype: torch.dtype,
    device: str,
    max_num_seqs: int,
    max_batch_tokens: int,
) -> float:
    """transformers' continuous batching (``init_continuous_batching``: a paged cache and a
    scheduler stepping in a background thread), configured like Tandem: at most
    ``max_num_seqs`` requests and ``max_batch_tokens`` tokens per step, and a cache that holds
    every request (its default page size; the block count given, since sizing from free memory
    needs psutil on the CPU). The model keeps its default attention (sdpa); compile, CUDA graphs
    and async batching stay at their defaults (off on the CPU). ``add_request`` gives each
    request its max_new_tokens and EOS id -1 (none). Timed from the first add_request to the
    last finished result; the manager's warmup() and the ``warm`` requests come before."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    model = _load(model_dir, dtype, device)
    longest_out = max(o for _, o in reqs + warm)
    gen_config = GenerationConfig(
        do_sample=False, max_new_tokens=longest_out, eos_token_id=-1, pad_token_id=0
    )
    cb_config = ContinuousBatchingConfig(
        max_batch_tokens=max_batch_tokens, max_requests_per_batch=max_num_seqs
    )
    cb_config.num_blocks = blocks_to_hold(reqs + warm, cb_config.page_size) + 2 * max_num_seqs
    hints = WorkloadHints(
        max_prompt_length=max(len(p) for p, _ in reqs + warm),
        max_generated_length=longest_out,
        num_requests=len(reqs),
    )
    manager = model.init_continuous_batching(gen_config, cb_config, hints)

    def generate(batch: list[Request]) -> None:
        ids = [manager.add_request(p, max_new_tokens=o, eos_token_id=-1) for p, o in batch]
        done: dict[str, Any] = {}
        while len(done) < len(ids):
            out = manager.get_result(timeout=1)
            if out is None and not manager.is_running():
                raise RuntimeError("transformers' continuous batching loop stopped")
            if out is not None and out.is_finished():
                if out.error is not None:
                    raise RuntimeError(f"transformers request failed: {out.error}")
                done[out.request_id] = out
        lens = [len(done[i].generated_tokens) for i in ids]
        assert lens == [o for _, o in batch], "each request must produce its max_new_tokens"

    try:
        manager.warmup()
        manager.start()
        generate(warm)
        _sync(device)
        start = time.perf_counter()
        generate(reqs)
        _sync(device)
        return time.perf_counter() - start
    finally:
        manager.stop(block=True, timeout=30)
        manager.destroy()
