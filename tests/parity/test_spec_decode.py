"""Speculative decoding in the engine (issue 34): n-gram proposals verified in one step.

Greedy output with speculation equals greedy output without it, token for token, for Llama,
Qwen2 and Qwen3 tiny shapes, through chunked prefill, prefix-cache hits and preemption (each
asserted to happen), with proposals accepted and rejected (both asserted); stop ids, EOS and
max_tokens end a request inside an accepted run where they would without speculation; logprobs
of the emitted tokens equal those without it; requests with penalties, a logit bias or
min_tokens still to reach speculate beside plain ones with their output unchanged (each feature
on its own: ``test_spec_decode_features.py``); every KV block is back in the pool afterwards,
aborts mid-run included."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from engine_svc.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine_svc.core.request import Logprobs
from engine_svc.core.sampling_params import SamplingParams
from engine_svc.engine_core import EngineCore
from engine_svc.spec_decode.ngram import NgramConfig

SPEC = NgramConfig(num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)


def _engine(model_dir: Path, spec: NgramConfig | None, **cache: int) -> EngineCore:
    return EngineCore(
        EngineConfig(
            model=ModelConfig(str(model_dir), dtype="float32"),
            cache=CacheConfig(num_kv_blocks=cache.get("blocks", 64)),
            scheduler=SchedulerConfig(max_num_batched_tokens=cache.get("budget", 64)),
            speculative=spec,
        )
    )


def _prompts(seed: int, n: int, prefix: list[int] = []) -> list[list[int]]:  # noqa: B006
    """Prompts that repeat their own spans (so the proposer finds earlier occurrences)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        span = [rng.randrange(4, 300) for _ in range(rng.randint(3, 8))]
        out.append(prefix + span * rng.randint(2, 4) + [rng.randrange(4, 300)])
    return out


class Counted(NamedTuple):
    """A run's outputs by request (in the order given) and its totals."""

    tokens: list[list[int]]
    reasons: list[object]  # finish reasons
    chunks: list[list[int]]  # tokens per output, in order
    logprobs: list[list[Logprobs | None]]
    totals: dict[str, int]  # steps, speculation counters, preemptions, prefix hits


def run_counted(
    engine: EngineCore, prompts: list[list[int]], params: list[SamplingParams]
) -> Counted:
    """Add one request per prompt, step the engine to the end, and count."""
    ids = [f"r{i}" for i in range(len(prompts))]
    for rid, p, sp in zip(ids, prompts, params, strict=True):
        engine.add_request(rid, p, sp)
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    chunks: dict[str, list[int]] = {rid: [] for rid in ids}
    lps: dict[str, list[Logprobs | None]] = {rid: [] for rid in ids}
    reasons: dict[str, object] = {}
    totals = dict(steps=0, drafts=0, proposed=0, accepted=0, preemptions=0, hits=0)
    while engine.has_unfinished_requests():
        step = engine.step()
        totals["steps"] += 1
        for o in step.outputs:
            tokens[o.request_id].extend(o.new_token_ids)
            chunks[o.request_id].append(len(o.new_token_ids))
            lps[o.request_id].extend(o.new_logprobs)
            if o.finish_reason is not None:
                reasons[o.request_id] = o.finish_reason
        s = step.stats
        totals["drafts"] += s.spec_num_drafts
        totals["proposed"] += s.spec_num_draft_tokens
        totals["accepted"] += s.spec_num_accepted_tokens
        totals["preemptions"] += s.num_preemptions
        totals["hits"] += s.prefix_cache_hits
    return Counted(
        [tokens[r] for r in ids],
        [reasons[r] for r in ids],
        [chunks[r] for r in ids],
        [lps[r] for r in ids],
        totals,
    )


def _run(engine: EngineCore, prompts: list[list[int]], params: list[SamplingParams]) -> tuple:
    run = run_counted(engine, prompts, params)
    return run.tokens, run.reasons, run.totals


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_greedy_output_is_the_same_with_and_without_speculation(
    tiny_models: dict[str, Path], arch: str
) -> None:
    shared = _prompts(1, 1)[0] * 2  # a shared prefix of several blocks: prefix-cache hits
    prompts = _prompts(2, 5) + _prompts(3, 3, shared)
    greedy = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)] * len(prompts)
    # A small cache and token budget: chunked prefill and preemption, with and without.
    base = _engine(tiny_models[arch], None, blocks=10, budget=32)
    spec = _engine(tiny_models[arch], SPEC, blocks=10, budget=32)
    want, _, base_totals = _run(base, prompts, greedy)
    got, _, totals = _run(spec, prompts, greedy)
    assert got == want
    assert totals["preemptions"] > 0 and totals["hits"] > 0
    assert 0 < totals["accepted"] < totals["proposed"], totals  # accepted and rejected both
    assert totals["steps"] < base_totals["steps"]  # accepted proposals save steps
    assert spec.kv.num_free_blocks == base.kv.num_free_blocks == 10  # nothing leaked


def test_stops_inside_an_accepted_run_end_the_request_where_they_would(
    tiny_models: dict[str, Path],
) -> None:
    prompts = _prompts(4, 4)
    free = [SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)] * len(prompts)
    base = _engine(tiny_models["llama"], None)
    want, _, _ = _run(base, prompts, free)
    # Stop at a token each request emits at position 5..9, or at max_tokens 7.
    params = [
        SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, stop_token_ids=[w[6]])
        for w in want[:3]
    ] + [SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True)]
    want_stopped, want_reasons, _ = _run(base, prompts, params)
    got, reasons, totals = _run(_engine(tiny_models["llama"], SPEC), prompts, params)
    assert totals["accepted"] > 0
    assert got == want_stopped and reasons == want_reasons
    assert [len(g) for g in got[3:]] == [7]


def test_requests_with_sampling_features_keep_their_output_beside_plain_ones(
    tiny_models: dict[str, Path],
) -> None:
    prompts = _prompts(5, 4)
    params = [
        SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, min_tokens=8),
        SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logit_bias={7: 2.0}),
    ]
    want, _, _ = _run(_engine(tiny_models["qwen3"], None), prompts, params)
    got, _, totals = _run(_engine(tiny_models["qwen3"], SPEC), prompts, params)
    assert got == want and totals["accepted"] > 0


def test_logprobs_of_emitted_tokens_equal_those_without_speculation(
    tiny_models: dict[str, Path],
) -> None:
    prompts = _prompts(8, 3)
    params = [SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True, logprobs=3)] * 3

    def run(engine: EngineCore) -> tuple[list[list[int]], list[list], dict]:  # type: ignore[type-arg]
        ids = [f"l{i}" for i in range(3)]
        for rid, p, sp in zip(ids, prompts, params, strict=True):
            engine.add_request(rid, p, sp)
        tokens: dict[str, list[int]] = {r: [] for r in ids}
        lps: dict[str, list] = {r: [] for r in ids}  # type: ignore[type-arg]
        accepted = 0
        while engine.has_unfinished_requests():
            step = engine.step()
            accepted += step.stats.spec_num_accepted_tokens
            for o in step.outputs:
                tokens[o.request_id].extend(o.new_token_ids)
                lps[o.request_id].extend(o.new_logprobs)
        return [tokens[r] for r in ids], [lps[r] for r in ids], {"accepted": accepted}

    want_tokens, want, _ = run(_engine(tiny_models["qwen3"], None))
    got_tokens, got, totals = run(_engine(tiny_models["qwen3"], SPEC))
    assert got_tokens == want_tokens and totals["accepted"] > 0
    for g, w, t in zip(got, want, got_tokens, strict=True):
        assert len(g) == len(w) == len(t) == 14  # one per token, whatever the step emitted
        for a, b, tok in zip(g, w, t, strict=True):
            assert a.token_id == b.token_id == tok and a.rank == b.rank
            assert list(a.top) == list(b.top)
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            for x, y in zip(a.top.values(), b.top.values(), strict=True):
                assert x == pytest.approx(y, abs=1e-4)


def test_sampled_requests_speculate_within_their_limits_and_follow_their_seed(
    tiny_models: dict[str, Path],
) -> None:
    prompts = _prompts(6, 3)
    params = [
        SamplingParams(max_tokens=18, temperature=0.7, top_k=20, seed=11, ignore_eos=True),
        SamplingParams(max_tokens=9, temperature=1.0, top_p=0.9, seed=12, ignore_eos=True),
        SamplingParams(max_tokens=13, temperature=0.5, min_p=0.05, seed=13, ignore_eos=True),
    ]
    spec = _engine(tiny_models["llama"], SPEC)
    first, _, totals = _run(spec, prompts, params)
    again, _, _ = _run(spec, prompts, params)
    assert [len(t) for t in first] == [18, 9, 13]
    assert first == again  # seeded: the same draws
    assert totals["drafts"] > 0
    assert spec.kv.num_free_blocks == 64


def test_aborts_during_speculation_return_every_block(tiny_models: dict[str, Path]) -> None:
    spec = _engine(tiny_models["qwen2"], SPEC)
    prompts = _prompts(7, 6)
    for i, p in enumerate(prompts):
        spec.add_request(f"a{i}", p, SamplingParams(max_tokens=200, temperature=0.0))
    drafted = 0
    for _ in range(12):
        drafted += spec.step().stats.spec_num_drafts
    assert drafted > 0
    spec.abort_requests([f"a{i}" for i in range(6)])
    spec.step()
    assert not spec.has_unfinished_requests()
    assert spec.kv.num_free_blocks == 64


def test_the_offline_llm_takes_vllms_speculative_config(tiny_models: dict[str, Path]) -> None:
    from engine_svc.entrypoints.llm import LLM

    spec = LLM(
        str(tiny_models["llama"]),
        speculative_config={"method": "ngram", "num_speculative_tokens": 3},
    )
    plain = LLM(str(tiny_models["llama"]))
    assert spec.engine.proposer is not None and spec.engine.proposer.config == NgramConfig(3, 1, 4)
    assert plain.engine.proposer is None
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in _prompts(9, 2)]
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)]
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    assert got == want
    with pytest.raises(ValueError, match="not supported"):
        LLM(
            str(tiny_models["llama"]),
            speculative_config={"method": "eagle", "num_speculative_tokens": 2},
        )


def test_lora_requests_speculate_with_their_adapter(
    tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    """Proposals of a request with an adapter are verified with that adapter's deltas (the step
    maps each query token to its adapter): output equal to no speculation, base and adapters mixed
    in one batch."""
    from engine_svc.entrypoints.llm import LLM
    from engine_svc.lora.request import LoRARequest
    from tests.lora_peft import make_adapter

    base = tiny_models["llama"]
    adapters = {
        "qv": make_adapter(
            base, tmp_path / "qv", r=4, alpha=8, targets=["q_proj", "v_proj"], seed=3
        ),
        "all": make_adapter(base, tmp_path / "all", r=8, alpha=16, targets="all-linear", seed=4),
    }
    names = [None, "qv", "all", "qv"]
    ids = {"qv": 1, "all": 2}
    lora = [None if n is None else LoRARequest(n, ids[n], str(adapters[n])) for n in names]
    prompts = [{"prompt_token_ids": p} for p in _prompts(10, len(names))]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    kw = dict(dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8)
    outs = {}
    accepted = 0
    for label, spec in (
        ("plain", None),
        ("spec", {"method": "ngram", "num_speculative_tokens": 4}),
    ):
        llm = LLM(str(base), speculative_config=spec, **kw)  # type: ignore[arg-type]
        if spec is not None:

            def counting_step(step: Any = llm.engine.step) -> Any:
                nonlocal accepted
                out = step()
                accepted += out.stats.spec_num_accepted_tokens
                return out

            llm.engine.step = counting_step  # type: ignore[method-assign]
        got = llm.generate(prompts, params, use_tqdm=False, lora_request=lora)
        outs[label] = [o.outputs[0].token_ids for o in got]
    assert outs["spec"] == outs["plain"]
    assert accepted > 0


def test_n_completions_speculate_each_on_their_own(tiny_models: dict[str, Path]) -> None:
    """n > 1: each completion is a request of its own with its own proposals. Greedy ones equal
    the output without speculation; seeded sampled ones repeat with the seed and stay apart from
    one another; both speculate (drafts made)."""
    from engine_svc.entrypoints.llm import LLM

    spec = LLM(
        str(tiny_models["llama"]),
        speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1},
    )
    plain = LLM(str(tiny_models["llama"]))
    prompts = [{"prompt_token_ids": p} for p in _prompts(6, 3)]
    drafts = [0]
    step = spec.engine.step

    def counted() -> object:
        out = step()
        drafts[0] += out.stats.spec_num_drafts
        return out

    spec.engine.step = counted  # type: ignore[method-assign]

    def run(llm: LLM, params: SamplingParams) -> list[list[list[int]]]:
        drafts[0] = 0
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [[list(c.token_ids) for c in o.outputs] for o in outs]

    greedy = SamplingParams(n=3, max_tokens=24, temperature=0.0, ignore_eos=True)
    got = run(spec, greedy)
    assert drafts[0] > 0
    assert got == run(plain, greedy)
    assert all(len(completions) == 3 for completions in got)
    sampled = SamplingParams(
        n=3, max_tokens=24, temperature=0.7, top_k=20, seed=11, ignore_eos=True
    )
    first = run(spec, sampled)
    assert drafts[0] > 0  # a random model's samples repeat rarely: few, but some
    assert run(spec, sampled) == first
    assert all(len({tuple(c) for c in completions}) > 1 for completions in first)
