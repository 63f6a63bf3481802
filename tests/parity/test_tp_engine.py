"""The whole engine over 2 tensor-parallel ranks on the CPU (gloo): ``EngineCore`` scheduling
once and the multi-process executor running each step on rank 0 (here) and a worker process.

Greedy output equals transformers' through chunked prefill, prefix-cache hits and preemption;
logprobs and prompt logprobs equal the one-rank engine's (structured outputs:
``test_tp_structured_output``). ``EngineCore`` builds its runner with
``make_model_runner``, which EngineCore calls for ``tensor_parallel_size``.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine_svc.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine_svc.core.request import Logprobs
from engine_svc.core.sampling_params import SamplingParams
from engine_svc.engine_core import EngineCore
from engine_svc.executor import MultiprocExecutor
from tests.parity.hf_reference import hf_greedy, load_hf

MAX_NEW = 12


def _config(model_dir: Path, tp: int) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(str(model_dir), dtype="float32"),
        cache=CacheConfig(num_kv_blocks=12),  # ~6 x 50 tokens do not fit: preemption
        scheduler=SchedulerConfig(max_num_batched_tokens=20),  # prompts prefill in chunks
        tensor_parallel_size=tp,
    )


@pytest.fixture(scope="module")
def tp_engine(tiny_models: dict[str, Path]) -> Iterator[EngineCore]:
    threads = torch.get_num_threads()  # the executor gives each rank its share of the CPUs
    engine = EngineCore(_config(tiny_models["llama"], tp=2))
    assert isinstance(engine.runner, MultiprocExecutor)
    try:
        yield engine
    finally:
        engine.runner.shutdown()
        torch.set_num_threads(threads)
    assert not any(p.is_alive() for p in engine.runner._procs)


Run = tuple[list[list[int]], dict[str, int], list[list[Logprobs | None]]]


def _run(engine: EngineCore, prompts: list[list[int]], params: SamplingParams) -> Run:
    """Each request's tokens, the step totals, and each request's prompt logprobs (entries 1..)
    followed by its sampled tokens' logprobs."""
    ids = [f"r{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts, strict=True):
        engine.add_request(rid, p, params)
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    prompt_lps: dict[str, list[Logprobs | None]] = {rid: [] for rid in ids}
    lps: dict[str, list[Logprobs | None]] = {rid: [] for rid in ids}
    totals = {"preemptions": 0, "hits": 0}
    while engine.has_unfinished_requests():
        step = engine.step()
        for o in step.outputs:
            tokens[o.request_id].extend(o.new_token_ids)
            lps[o.request_id].extend(o.new_logprobs)
            if o.prompt_logprobs is not None:
                prompt_lps[o.request_id] = o.prompt_logprobs[1:]
        totals["preemptions"] += step.stats.num_preemptions
        totals["hits"] += step.stats.prefix_cache_hits
    return [tokens[r] for r in ids], totals, [prompt_lps[r] + lps[r] for r in ids]


def _prompts(lengths: list[int], seed: int, prefix: list[int] = []) -> list[list[int]]:  # noqa: B006
    rng = random.Random(seed)
    return [prefix + [rng.randrange(4, 384) for _ in range(n)] for n in lengths]


def test_greedy_matches_transformers_through_chunks_preemption_and_prefix_hits(
    tp_engine: EngineCore, tiny_models: dict[str, Path]
) -> None:
    hf = load_hf(tiny_models["llama"])
    shared = _prompts([36], seed=5)[0]  # two full blocks and more, shared by three prompts
    prompts = _prompts([30, 33, 40, 17, 50, 25], seed=3) + _prompts([3, 9, 14], 6, shared)
    greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    got, totals, _ = _run(tp_engine, prompts, greedy)
    assert totals["preemptions"] > 0 and totals["hits"] > 0
    assert got == [hf_greedy(hf, p, MAX_NEW, stop_at_eos=False) for p in prompts]
    assert tp_engine.kv.num_free_blocks == 12


def test_logprobs_equal_the_one_rank_engine(
    tp_engine: EngineCore, tiny_models: dict[str, Path]
) -> None:
    params = SamplingParams(
        max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=3, prompt_logprobs=2
    )
    prompts = _prompts([21, 7], seed=8)
    one = EngineCore(_config(tiny_models["llama"], tp=1))
    want_tokens, _, want = _run(one, prompts, params)
    got_tokens, _, got = _run(tp_engine, prompts, params)
    assert got_tokens == want_tokens
    for g, w, p in zip(got, want, prompts, strict=True):
        assert len(g) == len(w) == len(p) - 1 + 4
        for a, b in zip(g, w, strict=True):
            assert a is not None and b is not None
            assert a.token_id == b.token_id and list(a.top) == list(b.top)
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_and_wake_up_on_every_rank_keep_the_output(tp_engine: EngineCore, level: int) -> None:
    """Every rank sleeps and wakes (at level 2 each reads its own slices of the checkpoint
    again); the output after waking is the output before."""
    prompts = _prompts([19, 8], seed=21)
    greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    before, _, _ = _run(tp_engine, prompts, greedy)
    tp_engine.sleep(level)
    assert tp_engine.is_sleeping and tp_engine.runner.kv_cache_nbytes() == 0
    tp_engine.wake_up()
    assert not tp_engine.is_sleeping
    after, _, _ = _run(tp_engine, prompts, greedy)
    assert after == before
