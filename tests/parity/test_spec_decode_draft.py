"""Speculative decoding with a draft model (issue 34): a small model of the same vocabulary
proposes k tokens a step, with its own KV cache over the target's blocks.

Greedy output with a draft equals greedy output without speculation, token for token (Llama and
Qwen3 tiny shapes; a draft equal to the target and one of a quarter of its layers), through
chunked prefill, prefix-cache hits and preemption (each asserted to happen); a draft equal to
the target has every proposal accepted (k + 1 tokens per verification step); sampled tokens
follow the target's distribution (chi-square against the exact distribution) and seeded
requests repeat themselves; aborts and preemption return every KV block; the scheduler's
lookahead slots; the KV budget counts both caches; refusals (another vocabulary, bad keys).
With tensor parallelism: ``test_tp_spec_decode.py``."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from engine_svc.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine_svc.core.kv_cache_manager import KVCacheManager
from engine_svc.core.request import Request
from engine_svc.core.sampling_params import SamplingParams
from engine_svc.core.scheduler import Scheduler
from engine_svc.engine_core import EngineCore
from engine_svc.spec_decode.config import DraftModelConfig, parse_speculative_config
from engine_svc.spec_decode.draft_model import DraftModel
from tests.conftest import build_tiny_checkpoint
from tests.parity.draft_checkpoint import layer_prefix_draft
from tests.parity.test_spec_decode import run_counted

K = 4


@pytest.fixture(scope="module")
def four_layer(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """arch -> (a 4-layer tiny target, its first layer as a draft: a quarter of the layers)."""
    root = tmp_path_factory.mktemp("draft_models")
    out = {}
    for arch, cls in (("llama", "LlamaForCausalLM"), ("qwen3", "Qwen3ForCausalLM")):
        target = build_tiny_checkpoint(root / arch, cls, num_hidden_layers=4)
        out[arch] = (target, layer_prefix_draft(target, root / f"{arch}_draft", 1))
    return out


def _engine(
    model_dir: Path,
    draft: Path | None,
    blocks: int = 64,
    budget: int = 64,
    k: int = K,
    seqs: int = 64,
) -> EngineCore:
    return EngineCore(
        EngineConfig(
            model=ModelConfig(str(model_dir), dtype="float32"),
            cache=CacheConfig(num_kv_blocks=blocks),
            scheduler=SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=budget),
            speculative=None if draft is None else DraftModelConfig(str(draft), k),
        )
    )


def _prompts(seed: int, n: int, prefix: list[int] = []) -> list[list[int]]:  # noqa: B006
    rng = random.Random(seed)
    return [prefix + [rng.randrange(4, 380) for _ in range(rng.randint(4, 40))] for _ in range(n)]


def _run(engine: EngineCore, prompts: list[list[int]], params: list[SamplingParams]) -> tuple:
    run = run_counted(engine, prompts, params)
    return run.tokens, run.chunks, run.totals


@pytest.mark.parametrize("which", ["itself", "quarter"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_output_is_the_same_with_a_draft_model(
    four_layer: dict[str, tuple[Path, Path]], arch: str, which: str
) -> None:
    target, quarter = four_layer[arch]
    draft = target if which == "itself" else quarter
    shared = _prompts(1, 1)[0][:36]  # a shared prefix of several blocks: prefix-cache hits
    prompts = _prompts(2, 5) + _prompts(3, 3, shared)
    greedy = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)] * len(prompts)
    # A small cache and token budget: chunked prefill and preemption, with and without.
    base = _engine(target, None, blocks=12, budget=32)
    spec = _engine(target, draft, blocks=12, budget=32)
    want, _, _ = _run(base, prompts, greedy)
    got, _, totals = _run(spec, prompts, greedy)
    assert got == want
    assert totals["preemptions"] > 0 and totals["hits"] > 0, totals
    assert max(len(p) for p in prompts) > 32  # chunked prefill
    assert totals["proposed"] > 0
    if which == "itself":
        assert totals["accepted"] == totals["proposed"], totals
    assert spec.kv.num_free_blocks == base.kv.num_free_blocks == 12  # nothing leaked
    assert isinstance(spec.proposer, DraftModel) and not spec.proposer.probs


def test_a_draft_equal_to_the_target_accepts_every_proposal(tiny_models: dict[str, Path]) -> None:
    """Every verification step emits k + 1 tokens: the k proposals and the bonus token. With
    max_tokens = 1 + 5m no proposal is cut by the length limit."""
    target = tiny_models["llama"]
    prompts = _prompts(4, 6)
    params = [SamplingParams(max_tokens=1 + 5 * 4, temperature=0.0, ignore_eos=True)] * 6
    want, _, _ = _run(_engine(target, None), prompts, params)
    spec = _engine(target, target)
    got, chunks, totals = _run(spec, prompts, params)
    assert got == want
    assert totals["drafts"] == 6 * 4 and totals["proposed"] == K * totals["drafts"]
    assert totals["accepted"] == totals["proposed"]
    assert all(c == [1] + [K + 1] * 4 for c in chunks), chunks  # prefill's token, then k + 1s
    assert spec.kv.num_free_blocks == 64


def test_sampled_tokens_follow_the_target_distribution(
    four_layer: dict[str, tuple[Path, Path]], tmp_path: Path
) -> None:
    """Many unseeded requests from one prompt, grouped by their first token: their second
    token (the first verified one) and their third (verified against the draft's second q)
    each checked by chi-square against the target's exact distribution given the first
    (transformers; the third's summed over the second). A draft of 3 of the 4 layers
    overlaps the target's top-k without matching it (about a quarter accepted): accepted
    draws and residual draws, which both depend on q, are checked."""
    from tests.parity.hf_reference import hf_logits, load_hf

    target, _ = four_layer["llama"]
    draft = layer_prefix_draft(target, tmp_path / "draft3", 3)
    prompt = _prompts(5, 1)[0][:10]
    n, temperature, top_k = 2400, 1.0, 10
    params = SamplingParams(max_tokens=5, temperature=temperature, top_k=top_k, ignore_eos=True)
    engine = _engine(target, draft, blocks=2048, budget=4096, seqs=256)
    got, _, totals = _run(engine, [prompt] * n, [params] * n)
    assert 0 < totals["accepted"] < totals["proposed"], totals
    assert engine.kv.num_free_blocks == 2048
    hf = load_hf(target)

    def dist(context: list[int]) -> torch.Tensor:
        """The target's top-k distribution after ``context``, as the sampler draws."""
        logits = hf_logits(hf, context)[-1] / temperature
        kth = logits.topk(top_k).values[-1]
        return torch.softmax(logits.masked_fill(logits < kth, float("-inf")), -1).double()

    by_first: dict[int, list[list[int]]] = {}
    for t in got:
        by_first.setdefault(t[0], []).append(t)
    for first, runs in sorted(by_first.items(), key=lambda kv: -len(kv[1]))[:2]:
        assert len(runs) >= 300, len(runs)
        after = dist([*prompt, first])
        _chi2_check([t[1] for t in runs], after)
        # the third token given the first: summed over the second
        third = sum(float(after[t]) * dist([*prompt, first, t]) for t in after.nonzero().view(-1))
        _chi2_check([t[2] for t in runs], third)


def _chi2_check(samples: list[int], p: torch.Tensor) -> None:
    """Chi-square of ``samples`` against ``p``, bins expected under 5 pooled into one;
    p-value 1e-4 (a correct sampler fails 1 in 10^4)."""
    counts = torch.bincount(torch.tensor(samples), minlength=p.numel()).double()
    expected = p * len(samples)
    assert counts[expected == 0].sum() == 0  # never outside the target's support
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    keep = exp > 0
    chi2 = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    df = int(keep.sum()) - 1
    # the p = 1e-4 critical value (Wilson-Hilferty; within 2 % above the exact one for df >= 2)
    z = 3.719
    critical = df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3
    assert df >= 2 and chi2 < critical, (chi2, df)


def test_seeded_sampled_requests_repeat_themselves(
    four_layer: dict[str, tuple[Path, Path]],
) -> None:
    target, draft = four_layer["qwen3"]
    prompts = _prompts(6, 3)
    params = [
        SamplingParams(max_tokens=18, temperature=0.7, top_k=20, seed=11, ignore_eos=True),
        SamplingParams(max_tokens=9, temperature=1.0, top_p=0.9, seed=12, ignore_eos=True),
        SamplingParams(max_tokens=13, temperature=0.5, min_p=0.05, seed=13, ignore_eos=True),
    ]
    spec = _engine(target, draft)
    first, _, totals = _run(spec, prompts, params)
    again, _, _ = _run(spec, prompts, params)
    assert [len(t) for t in first] == [18, 9, 13]
    assert first == again
    assert totals["drafts"] > 0
    assert spec.kv.num_free_blocks == 64
    assert isinstance(spec.proposer, DraftModel) and not spec.proposer.probs


def test_aborts_and_preemption_return_every_block(four_layer: dict[str, tuple[Path, Path]]) -> None:
    target, draft = four_layer["llama"]
    spec = _engine(target, draft, blocks=14, budget=48)
    prompts = _prompts(7, 6)
    for i, p in enumerate(prompts):
        params = SamplingParams(max_tokens=200, temperature=0.0 if i % 2 else 0.9, seed=i)
        spec.add_request(f"a{i}", p, params)
    drafted = preempted = 0
    for _ in range(16):
        stats = spec.step().stats
        drafted += stats.spec_num_drafts
        preempted += stats.num_preemptions
    assert drafted > 0 and preempted > 0
    spec.abort_requests([f"a{i}" for i in range(6)])
    spec.step()
    assert not spec.has_unfinished_requests()
    assert spec.kv.num_free_blocks == 14
    assert isinstance(spec.proposer, DraftModel) and not spec.proposer.probs


def test_requests_reaching_the_context_bound(tiny_models: dict[str, Path]) -> None:
    """A cache of 4 blocks serves a context of 64 tokens: requests run to it with the draft
    writing no KV past their slots (the checkpoint's context is longer); output as without
    speculation."""
    target = tiny_models["llama"]
    prompts = [(_prompts(12, 1)[0] * 3)[:50], list(range(5, 40))]
    params = [
        SamplingParams(max_tokens=64 - len(p), temperature=0, ignore_eos=True) for p in prompts
    ]
    want, _, _ = _run(_engine(target, None, blocks=4), prompts, params)
    spec = _engine(target, target, blocks=4)
    got, _, totals = _run(spec, prompts, params)
    assert got == want
    assert [len(p) + len(g) for p, g in zip(prompts, got, strict=True)] == [64, 64]
    assert totals["accepted"] > 0
    assert spec.kv.num_free_blocks == 4


def test_the_scheduler_allocates_lookahead_slots_for_the_draft() -> None:
    """A step that reaches a request's last token gets k slots past it (never past
    max_model_len); a partial prefill chunk gets none; lookahead slots never publish a block."""
    kv = KVCacheManager(num_blocks=16, block_size=4)
    sched = Scheduler(
        SchedulerConfig(max_num_batched_tokens=8), kv, max_model_len=20, num_lookahead_tokens=3
    )
    long = Request("long", list(range(10, 22)), SamplingParams(max_tokens=4))  # 12 tokens
    sched.add_request(long)
    out = sched.schedule()  # a chunk of 8: no lookahead, 2 blocks
    assert [len(s.block_ids) for s in out.scheduled] == [2]
    sched.update_from_output(out, {})
    out = sched.schedule()  # the last 4: 12 tokens + 3 lookahead = 15 -> 4 blocks
    assert out.scheduled[0].block_ids == [2, 3]
    assert kv.num_published["long"] == 3  # the lookahead block holds no token: not published
    sched.update_from_output(out, {"long": 7})
    out = sched.schedule()  # a decode: 13 + 3 = 16 tokens fit the 4 blocks held
    assert out.scheduled[0].block_ids == []
    sched.abort_requests(["long"])
    assert kv.num_free_blocks == 16
    wide = Scheduler(SchedulerConfig(), kv, max_model_len=20, num_lookahead_tokens=3)
    wide.add_request(Request("near", list(range(30, 48)), SamplingParams(max_tokens=1)))
    out = wide.schedule()  # 18 tokens + only 2 lookahead (max_model_len 20): 5 blocks
    assert len(out.scheduled[0].block_ids) == 5
    wide.abort_requests(["near"])
    assert kv.num_free_blocks == 16


def test_the_kv_budget_holds_both_caches(tiny_models: dict[str, Path]) -> None:
    target = tiny_models["qwen3"]
    plain = EngineCore(
        EngineConfig(model=ModelConfig(str(target), dtype="float32"),
                     cache=CacheConfig(kv_cache_memory=4 * 2**20))
    )  # fmt: skip
    spec = EngineCore(
        EngineConfig(model=ModelConfig(str(target), dtype="float32"),
                     cache=CacheConfig(kv_cache_memory=4 * 2**20),
                     speculative=DraftModelConfig(str(target), 2))
    )  # fmt: skip
    per_block = plain.runner.layout.bytes_per_block
    assert spec.runner.layout.bytes_per_block == 2 * per_block  # the draft is the same shape
    assert spec.runner.layout.num_blocks == plain.runner.layout.num_blocks // 2
    assert spec.runner.kv_cache_nbytes() == spec.runner.layout.num_blocks * 2 * per_block


def test_sleep_frees_and_wake_up_remakes_the_drafts_cache(tiny_models: dict[str, Path]) -> None:
    target = tiny_models["llama"]
    spec = _engine(target, target)
    runner = spec.runner
    assert runner.kv_cache_nbytes() == 64 * runner.layout.bytes_per_block
    prompts = _prompts(13, 2)
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)] * 2
    want, _, _ = _run(spec, prompts, params)
    spec.sleep(1)
    assert runner.kv_cache_nbytes() == 0
    spec.wake_up()
    assert runner.kv_cache_nbytes() == 64 * runner.layout.bytes_per_block
    got, _, totals = _run(spec, prompts, params)
    assert got == want and totals["accepted"] == totals["proposed"] > 0


def test_refusals(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    target = tiny_models["llama"]
    other = build_tiny_checkpoint(tmp_path / "other_vocab", "LlamaForCausalLM", vocab_size=512)
    with pytest.raises(ValueError, match="vocab_size 512.*384"):
        _engine(target, other)
    for bad, message in [
        ('{"model": "/m/d", "num_speculative_tokens": 2, "draft_x": 1}', "unknown keys"),
        ('{"method": "draft_model", "num_speculative_tokens": 2}', 'needs "model"'),
        ('{"model": "/m/d"}', "needs num_speculative_tokens"),
        ('{"model": "/m/d", "num_speculative_tokens": 0}', "at least 1"),
        ('{"method": "eagle", "model": "/m/d", "num_speculative_tokens": 2}', "not supported"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_speculative_config(bad)
    assert parse_speculative_config(
        '{"method": "draft_model", "model": "/m/d", "num_speculative_tokens": 3}'
    ) == DraftModelConfig("/m/d", 3)


def test_the_offline_llm_takes_a_draft_model(tiny_models: dict[str, Path]) -> None:
    from engine_svc.entrypoints.llm import LLM

    target = str(tiny_models["qwen3"])
    spec = LLM(target, speculative_config={"model": target, "num_speculative_tokens": 3})
    assert isinstance(spec.engine.proposer, DraftModel)
    assert spec.engine.proposer.config == DraftModelConfig(target, 3)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in _prompts(9, 2)]
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)]
    want = [o.outputs[0].token_ids for o in LLM(target).generate(prompts, params, use_tqdm=False)]
    assert got == want
