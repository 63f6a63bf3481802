"""The persistent batch and decode padding change nothing a request sees: decode steps padded to
size buckets in static buffers (what CUDA graphs need) give the same tokens as unpadded ones,
and both equal transformers' greedy generation, through preemption, chunked prefill and the
prefix cache; seeded sampling with penalties, top-k/top-p and logprobs is identical too."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from engine_svc import LLM, SamplingParams
from engine_svc.worker.step_inputs import decode_buckets
from tests.parity.hf_reference import hf_greedy, load_hf


def _prompts(lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 384) for _ in range(n)] for n in lengths]


def test_decode_buckets() -> None:
    assert decode_buckets(1) == [1]
    assert decode_buckets(6) == [1, 2, 4, 6]
    assert decode_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert decode_buckets(64)[-3:] == [48, 56, 64]


@pytest.mark.parametrize("pad", [False, True])
def test_greedy_parity_with_preemption_and_prefix_cache(
    tiny_models: dict[str, Path], pad: bool
) -> None:
    model_dir = tiny_models["llama"]
    hf = load_hf(model_dir)
    shared = _prompts([40], 7)[0]
    prompts = [shared + p for p in _prompts([3, 17, 1, 30, 9], 8)] + _prompts([5, 33, 2], 9)
    # 14 blocks x 16 slots for 8 requests of up to ~90 tokens: preemption; a small token budget
    # splits prefills into chunks; the shared 40-token prefix hits the prefix cache.
    llm = LLM(
        model_dir,
        dtype="float32",
        num_kv_blocks=14,
        max_num_batched_tokens=24,
        max_num_seqs=6,
        pad_decode_batches=pad,
    )
    assert llm.engine.runner.pad_decodes is pad
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    assert got == [hf_greedy(hf, p, 20, stop_at_eos=False) for p in prompts]
    assert llm.engine.kv.num_free_blocks == 14
    # Rows of requests that finished in the last step go at the next step; none is running.
    batch = llm.engine.runner.input_batch
    assert all(r is not None and r.is_finished for r in batch.requests[: batch.num_rows])


def test_padding_changes_no_sampled_token(tiny_models: dict[str, Path]) -> None:
    prompts = [{"prompt_token_ids": p} for p in _prompts([4, 19, 33, 7, 12, 50, 2], 3)]
    params = [
        SamplingParams(max_tokens=24, temperature=0.8, seed=11, top_k=20, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=1.0, seed=12, top_p=0.9, logprobs=3),
        SamplingParams(max_tokens=24, temperature=0.7, seed=13, repetition_penalty=1.3),
        SamplingParams(
            max_tokens=24,
            temperature=0.9,
            seed=14,
            presence_penalty=0.5,
            frequency_penalty=0.4,
            ignore_eos=True,
        ),  # fmt: skip
        SamplingParams(max_tokens=24, temperature=0.0, min_tokens=10, logprobs=2),
        SamplingParams(max_tokens=24, temperature=1.0, seed=15, min_p=0.05, top_k=50),
        SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
    ]
    results = []
    for pad in (False, True):
        llm = LLM(tiny_models["qwen3"], dtype="float32", num_kv_blocks=64, pad_decode_batches=pad)
        outs = llm.generate(prompts, params, use_tqdm=False)
        results.append(
            [
                (
                    o.outputs[0].token_ids,
                    [(lp.token_id, round(lp.logprob, 5)) for lp in o.outputs[0].logprobs or []],
                )
                for o in outs
            ]
        )
    assert results[0] == results[1]
