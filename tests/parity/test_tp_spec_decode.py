"""Speculative decoding over 2 tensor-parallel ranks on the CPU (gloo), and through the executor
at one rank: rank 0 proposes (n-gram, or its draft model), the step message takes each row's
proposals to the worker, every rank verifies the same ``1 + k`` tokens, and rank 0's
verification is the step's (the worker's batch takes rank 0's tokens, count and all).

- Greedy output equals one rank's without speculation token for token, through chunked
  prefill, preemption and prefix-cache hits, with proposals accepted and rejected (each asserted
  to happen); with n-gram proposals and with a draft model.
- Seeded sampled requests (beside greedy ones, penalties included) equal one rank's with the
  same speculation: the same seeds and the same proposals give the same draws. With a draft
  model the worker's own verification of a sampled row differs from rank 0's (it has neither
  the draft's q nor the generator state the draft's draws left on rank 0): its batch must take
  rank 0's tokens for the outputs to stay equal.
- Logprobs of the emitted tokens equal one rank's without speculation.
- ``-tp 1 --distributed-executor-backend mp`` with speculation is the in-process engine.
- Every KV block is back in the pool at the end.

One process joins one group at a time: one executor engine alive at a time, shut down at the
end of its test.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from engine_svc.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine_svc.core.request import Logprobs
from engine_svc.core.sampling_params import SamplingParams
from engine_svc.engine_core import EngineCore
from engine_svc.executor import MultiprocExecutor
from engine_svc.spec_decode.config import DraftModelConfig, NgramConfig, SpeculativeConfig
from engine_svc.spec_decode.draft_model import DraftModel
from tests.conftest import build_tiny_checkpoint
from tests.parity.draft_checkpoint import layer_prefix_draft
from tests.parity.test_spec_decode import _prompts as repeating_prompts
from tests.parity.test_spec_decode import run_counted
from tests.parity.test_spec_decode_draft import _prompts as random_prompts

NGRAM = NgramConfig(num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)
K = 4


@pytest.fixture(scope="module")
def target_and_draft(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A 4-layer tiny Llama and its first layer as a draft."""
    root = tmp_path_factory.mktemp("tp_draft_models")
    target = build_tiny_checkpoint(root / "llama4", "LlamaForCausalLM", num_hidden_layers=4)
    return target, layer_prefix_draft(target, root / "llama4_draft", 1)


def _config(
    model: Path,
    tp: int,
    spec: SpeculativeConfig | None,
    blocks: int = 64,
    budget: int = 64,
    mp: bool = False,
) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(str(model), dtype="float32"),
        cache=CacheConfig(num_kv_blocks=blocks),
        scheduler=SchedulerConfig(max_num_batched_tokens=budget),
        tensor_parallel_size=tp,
        distributed_executor_backend="mp" if mp else None,
        speculative=spec,
    )


@contextmanager
def _executor_engine(config: EngineConfig) -> Iterator[EngineCore]:
    threads = torch.get_num_threads()  # the executor gives each rank its share of the CPUs
    engine = EngineCore(config)
    runner = engine.runner
    assert isinstance(runner, MultiprocExecutor)
    try:
        yield engine
    finally:
        runner.shutdown()
        torch.set_num_threads(threads)
    assert not any(p.is_alive() for p in runner._procs)


Run = tuple[list[list[int]], list[list[Logprobs]], dict[str, int]]


def _run(engine: EngineCore, prompts: list[list[int]], params: list[SamplingParams]) -> Run:
    """Each request's tokens and logprobs, and the run's step, speculation, preemption and
    prefix-hit totals."""
    run = run_counted(engine, prompts, params)
    return run.tokens, run.logprobs, run.totals  # type: ignore[return-value]


def _same_logprobs(got: list[list[Logprobs]], want: list[list[Logprobs]], abs_: float) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert len(g) == len(w) > 0
        for a, b in zip(g, w, strict=True):
            assert (a.token_id, a.rank, list(a.top)) == (b.token_id, b.rank, list(b.top))
            assert a.logprob == pytest.approx(b.logprob, abs=abs_)
            assert list(a.top.values()) == pytest.approx(list(b.top.values()), abs=abs_)


def _sampled_params() -> list[SamplingParams]:
    """Seeded sampled rows (one with a penalty) beside greedy ones."""
    return [
        SamplingParams(max_tokens=18, temperature=0.7, top_k=20, seed=11, ignore_eos=True),
        SamplingParams(max_tokens=9, temperature=1.0, top_p=0.9, seed=12, ignore_eos=True),
        SamplingParams(
            max_tokens=13, temperature=0.8, repetition_penalty=1.2, seed=13, ignore_eos=True
        ),
        SamplingParams(max_tokens=15, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.0, frequency_penalty=0.5, ignore_eos=True),
    ]


def test_ngram_greedy_at_two_ranks_equals_one_rank_without_speculation(
    tiny_models: dict[str, Path],
) -> None:
    model = tiny_models["llama"]
    shared = repeating_prompts(1, 1)[0] * 2  # a shared prefix of several blocks: prefix hits
    prompts = repeating_prompts(2, 5) + repeating_prompts(3, 3, shared)
    greedy = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)] * len(prompts)
    # A small cache and token budget: chunked prefill and preemption.
    base = EngineCore(_config(model, 1, None, blocks=10, budget=32))
    want, _, base_totals = _run(base, prompts, greedy)
    with _executor_engine(_config(model, 2, NGRAM, blocks=10, budget=32)) as engine:
        got, _, totals = _run(engine, prompts, greedy)
        assert engine.kv.num_free_blocks == 10
    assert got == want
    assert max(len(p) for p in prompts) > 32  # chunked prefill
    assert totals["preemptions"] > 0 and totals["hits"] > 0, totals
    assert 0 < totals["accepted"] < totals["proposed"], totals  # accepted and rejected both
    assert totals["steps"] < base_totals["steps"]


def test_ngram_seeded_sampling_and_logprobs_at_two_ranks(tiny_models: dict[str, Path]) -> None:
    """Seeded sampled rows equal one rank's with the same speculation; logprobs (and prompt
    logprobs) of greedy rows equal one rank's without speculation."""
    model = tiny_models["llama"]
    prompts = repeating_prompts(6, 5)
    sampled = _sampled_params()
    logprobs = [
        SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True, logprobs=3)
    ] * 3 + [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2,
                            prompt_logprobs=2)]  # fmt: skip
    lp_prompts = repeating_prompts(8, 4)
    want_sampled, _, _ = _run(EngineCore(_config(model, 1, NGRAM)), prompts, sampled)
    want_tokens, want_lps, _ = _run(EngineCore(_config(model, 1, None)), lp_prompts, logprobs)
    with _executor_engine(_config(model, 2, NGRAM)) as engine:
        got_sampled, _, totals = _run(engine, prompts, sampled)
        got_tokens, got_lps, lp_totals = _run(engine, lp_prompts, logprobs)
        assert engine.kv.num_free_blocks == 64
    assert got_sampled == want_sampled
    assert [len(t) for t in got_sampled] == [18, 9, 13, 15, 12]
    assert totals["drafts"] > 0 and totals["accepted"] > 0, totals
    assert got_tokens == want_tokens and lp_totals["accepted"] > 0, lp_totals
    _same_logprobs(got_lps, want_lps, 1e-4)


def test_draft_model_at_two_ranks(target_and_draft: tuple[Path, Path]) -> None:
    """Greedy output equals one rank's without speculation (chunks, preemption, prefix hits);
    seeded sampled rows equal one rank's with the same draft; after a sleep and a wake up the
    output is the same. Rank 0 holds the draft."""
    target, draft_dir = target_and_draft
    draft = DraftModelConfig(str(draft_dir), K)
    shared = random_prompts(1, 1)[0][:36]  # a shared prefix of several blocks: prefix hits
    prompts = random_prompts(2, 5) + random_prompts(3, 3, shared)
    greedy = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)] * len(prompts)
    sampled_prompts = random_prompts(6, 5)
    sampled = _sampled_params()
    want, _, _ = _run(EngineCore(_config(target, 1, None, blocks=12, budget=32)), prompts, greedy)
    want_sampled, _, _ = _run(EngineCore(_config(target, 1, draft)), sampled_prompts, sampled)
    with _executor_engine(_config(target, 2, draft, blocks=12, budget=32)) as engine:
        runner = engine.runner
        assert isinstance(runner, MultiprocExecutor)
        assert isinstance(engine.proposer, DraftModel) and engine.proposer is runner.rank0.draft
        got, _, totals = _run(engine, prompts, greedy)
        assert engine.kv.num_free_blocks == 12
        got_sampled, _, sampled_totals = _run(engine, sampled_prompts, sampled)
        assert engine.kv.num_free_blocks == 12
        assert not engine.proposer.probs  # every q verified or dropped
        # Sleep frees every rank's cache, rank 0's draft's too; the output after waking is the
        # output before.
        engine.sleep(1)
        assert runner.kv_cache_nbytes() == 0
        engine.wake_up()
        assert runner.kv_cache_nbytes() == 12 * runner.layout.bytes_per_block
        again, _, _ = _run(engine, prompts[:3], greedy[:3])
        assert again == got[:3]
    assert got == want
    assert max(len(p) for p in prompts) > 32  # chunked prefill
    assert totals["preemptions"] > 0 and totals["hits"] > 0, totals
    assert 0 < totals["accepted"] < totals["proposed"], totals
    assert got_sampled == want_sampled
    assert sampled_totals["accepted"] > 0, sampled_totals


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_one_rank_through_the_executor_with_speculation_equals_the_in_process_engine(
    target_and_draft: tuple[Path, Path], proposer: str
) -> None:
    target, draft_dir = target_and_draft
    spec: SpeculativeConfig = NGRAM if proposer == "ngram" else DraftModelConfig(str(draft_dir), K)
    prompts = repeating_prompts(9, 5)
    params = [
        SamplingParams(
            max_tokens=p.max_tokens, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
            seed=p.seed, repetition_penalty=p.repetition_penalty,
            frequency_penalty=p.frequency_penalty, ignore_eos=True, logprobs=2,
        )
        for p in _sampled_params()
    ]  # fmt: skip
    plain = EngineCore(_config(target, 1, spec, blocks=6, budget=32))
    want_tokens, want_lps, want_totals = _run(plain, prompts, params)
    with _executor_engine(_config(target, 1, spec, blocks=6, budget=32, mp=True)) as engine:
        runner = engine.runner
        assert isinstance(runner, MultiprocExecutor) and runner.worker_pids == []
        got_tokens, got_lps, got_totals = _run(engine, prompts, params)
        assert engine.kv.num_free_blocks == 6
    assert want_totals["accepted"] > 0 and want_totals["preemptions"] > 0, want_totals
    assert (got_tokens, got_totals) == (want_tokens, want_totals)
    _same_logprobs(got_lps, want_lps, 1e-6)
