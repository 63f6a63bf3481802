"""Greedy generation through Tandem equals transformers' greedy generate() token for token."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from engine_svc import LLM, SamplingParams
from engine_svc.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine_svc.engine_core import EngineCore
from tests.parity.hf_reference import hf_greedy, load_hf

# Lengths on and around block boundaries (block_size 16), plus longer ones.
LENGTHS = [1, 2, 15, 16, 17, 31, 32, 33, 47, 48, 49, 100]
MAX_NEW = 24


def _prompts(lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab) for _ in range(n)] for n in lengths]


def _tandem(llm: LLM, prompts: list[list[int]], ignore_eos: bool) -> list[list[int]]:
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=ignore_eos)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize(
    ("name", "backend"),
    [("llama", "auto"), ("llama3_tied", "auto"), ("qwen2", "auto"), ("qwen3", "auto")]
    + [("qwen3", "torch")],  # the reference attention backend, which auto does not pick on CPU
)
def test_batched_greedy_matches_transformers(
    tiny_models: dict[str, Path], name: str, backend: str
) -> None:
    model_dir = tiny_models[name]
    hf = load_hf(model_dir)
    prompts = _prompts(LENGTHS, hf.config.vocab_size)
    llm = LLM(model_dir, dtype="float32", num_kv_blocks=256, attention_backend=backend)
    assert llm.engine.runner.kernels.attention.name == ("torch" if backend == "torch" else "cpu")
    # Stopping at EOS (the default), and running past it.
    for ignore_eos in (False, True):
        got = _tandem(llm, prompts, ignore_eos)
        want = [hf_greedy(hf, p, MAX_NEW, stop_at_eos=not ignore_eos) for p in prompts]
        assert got == want, f"{name} ignore_eos={ignore_eos}"
    # Every block was given back.
    assert llm.engine.kv.num_free_blocks == 256


def _run_engine(
    engine: EngineCore, prompts: list[list[int]], params: SamplingParams
) -> tuple[list[list[int]], dict[str, int]]:
    ids = [str(i) for i in range(len(prompts))]
    for rid, p in zip(ids, prompts, strict=True):
        engine.add_request(rid, p, params)
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    totals = {"preemptions": 0, "hits": 0, "queries": 0, "max_batched": 0}
    while engine.has_unfinished_requests():
        step = engine.step()
        for o in step.outputs:
            tokens[o.request_id].extend(o.new_token_ids)
        totals["preemptions"] += step.stats.num_preemptions
        totals["hits"] += step.stats.prefix_cache_hits
        totals["queries"] += step.stats.prefix_cache_queries
    return [tokens[r] for r in ids], totals


def _engine(model_dir: Path, **kw: object) -> EngineCore:
    sched = {k: kw.pop(k) for k in ("max_num_seqs", "max_num_batched_tokens") if k in kw}
    cache = {
        k: kw.pop(k) for k in ("num_kv_blocks", "enable_prefix_caching", "block_size") if k in kw
    }
    assert not kw
    return EngineCore(
        EngineConfig(
            model=ModelConfig(str(model_dir), dtype="float32"),
            cache=CacheConfig(**cache),  # type: ignore[arg-type]
            scheduler=SchedulerConfig(**sched),  # type: ignore[arg-type]
        )
    )


GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llama_ref(tiny_models: dict[str, Path]):  # type: ignore[no-untyped-def]
    hf = load_hf(tiny_models["llama"])
    cache: dict[tuple[int, ...], list[int]] = {}

    def want(prompts: list[list[int]]) -> list[list[int]]:
        for p in prompts:
            if tuple(p) not in cache:
                cache[tuple(p)] = hf_greedy(hf, p, MAX_NEW, stop_at_eos=False)
        return [cache[tuple(p)] for p in prompts]

    return want


def test_shared_prefix_hits_cache_and_matches(tiny_models: dict[str, Path], llama_ref) -> None:  # type: ignore[no-untyped-def]
    rng = random.Random(7)
    prefix = [rng.randrange(4, 384) for _ in range(40)]  # 2 full blocks + 8 tokens
    prompts = [prefix + [rng.randrange(4, 384) for _ in range(n)] for n in (1, 8, 9, 30)]
    engine = _engine(tiny_models["llama"], num_kv_blocks=128)
    first, _ = _run_engine(engine, prompts[:1], GREEDY)  # warms the cache with the prefix
    rest, totals = _run_engine(engine, prompts[1:], GREEDY)
    assert first + rest == llama_ref(prompts)
    # Each of the three later prompts reuses the two full prefix blocks (32 tokens).
    assert totals["hits"] >= 3 * 32
    assert engine.kv.num_free_blocks == 128


def test_tiny_token_budget_chunks_prefill_and_matches(
    tiny_models: dict[str, Path], llama_ref
) -> None:  # type: ignore[no-untyped-def]
    prompts = _prompts(LENGTHS, 384, seed=1)
    engine = _engine(tiny_models["llama"], num_kv_blocks=256, max_num_batched_tokens=7)
    got, _ = _run_engine(engine, prompts, GREEDY)
    assert got == llama_ref(prompts)


def test_tiny_kv_cache_preempts_and_matches(tiny_models: dict[str, Path], llama_ref) -> None:  # type: ignore[no-untyped-def]
    prompts = _prompts([30, 33, 40, 17, 50, 25], 384, seed=2)
    # 12 blocks x 16 = 192 slots for ~6 x 60 tokens: requests must be preempted and recomputed.
    engine = _engine(tiny_models["llama"], num_kv_blocks=12, enable_prefix_caching=False)
    got, totals = _run_engine(engine, prompts, GREEDY)
    assert totals["preemptions"] > 0
    assert got == llama_ref(prompts)
    assert engine.kv.num_free_blocks == 12


def test_preemption_with_prefix_caching_matches(tiny_models: dict[str, Path], llama_ref) -> None:  # type: ignore[no-untyped-def]
    prompts = _prompts([30, 33, 40, 17, 50, 25], 384, seed=3)
    engine = _engine(tiny_models["llama"], num_kv_blocks=12, max_num_batched_tokens=20)
    got, totals = _run_engine(engine, prompts, GREEDY)
    assert totals["preemptions"] > 0
    assert got == llama_ref(prompts)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_mostly_agrees(tiny_models: dict[str, Path], dtype: str) -> None:
    """Half precision: the first tokens agree with transformers in the same dtype (greedy on a
    random model drifts once two logits are closer than the dtype's resolution)."""
    import torch

    model_dir = tiny_models["qwen3"]
    hf = load_hf(model_dir, getattr(torch, dtype))
    prompts = _prompts([5, 16, 33, 64], hf.config.vocab_size, seed=4)
    llm = LLM(model_dir, dtype=dtype, num_kv_blocks=64)
    got = _tandem(llm, prompts, ignore_eos=True)
    want = [hf_greedy(hf, p, MAX_NEW, stop_at_eos=False) for p in prompts]
    first_tokens_agree = sum(g[:4] == w[:4] for g, w in zip(got, want, strict=True))
    assert first_tokens_agree >= 3, (got, want)
