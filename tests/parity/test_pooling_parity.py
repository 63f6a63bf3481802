"""Pooling through Tandem equals transformers on tiny random-weight models (float32):

* embeddings: ``AutoModel``'s last_hidden_state pooled (LAST, MEAN, CLS), L2-normalized (or not),
  cut to Matryoshka ``dimensions``, for Llama, Qwen2, Qwen3 and a Qwen2Model base checkpoint;
* classification: ``AutoModelForSequenceClassification``'s logits (activation off), softmax /
  sigmoid of them (on); cross-encoder scores of tokenizer-encoded pairs;
* the engine's side: pooling rows share steps with generation rows without changing what those
  generate (greedy tokens, logprobs, penalties, a structured-output constraint); chunked prefill,
  the prefix cache and preemption give the same vectors; no KV block or partial state is left.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from pathlib import Path

import numpy as np
import pytest
import torch

from engine_svc import LLM, PoolingParams, SamplingParams
from engine_svc.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine_svc.core.outputs import EngineCoreOutput
from engine_svc.core.sampling_params import StructuredOutputParams
from engine_svc.core.scheduler import SchedulerOutput
from engine_svc.engine_core import EngineCore
from tests.parity.pooling_reference import TOL
from tests.parity.pooling_reference import pool_states as _pool
from tests.parity.pooling_reference import random_prompts as _prompts
from tests.parity.pooling_reference import token_prompts as _ids

LENGTHS = [1, 2, 15, 16, 17, 40, 75]


@cache
def _hf_states(model_dir: Path, prompt: tuple[int, ...]) -> torch.Tensor:
    """transformers' last_hidden_state of one unpadded prompt, [len, hidden]."""
    from transformers import AutoModel

    hf = _hf_model(model_dir, AutoModel)
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        states: torch.Tensor = hf(ids, attention_mask=torch.ones_like(ids)).last_hidden_state[0]
    return states


@cache
def _hf_model(model_dir: Path, cls: type) -> torch.nn.Module:
    return cls.from_pretrained(str(model_dir), dtype=torch.float32).eval()  # type: ignore[no-any-return, attr-defined]


def _want(model_dir: Path, prompt: list[int], pooling: str, normalize: bool = True) -> np.ndarray:
    vec = _pool(_hf_states(model_dir, tuple(prompt)), pooling)
    return (torch.nn.functional.normalize(vec, dim=-1) if normalize else vec).numpy()


def _core(model_dir: Path, **kw: object) -> EngineCore:
    sched = {k: kw.pop(k) for k in ("max_num_seqs", "max_num_batched_tokens") if k in kw}
    cache_kw = {k: kw.pop(k) for k in ("num_kv_blocks", "enable_prefix_caching") if k in kw}
    return EngineCore(
        EngineConfig(
            model=ModelConfig(str(model_dir), dtype="float32", **kw),  # type: ignore[arg-type]
            cache=CacheConfig(**cache_kw),  # type: ignore[arg-type]
            scheduler=SchedulerConfig(**sched),  # type: ignore[arg-type]
        )
    )


def _record_schedules(core: EngineCore) -> list[SchedulerOutput]:
    """Every SchedulerOutput the core's steps run, in order."""
    seen: list[SchedulerOutput] = []
    schedule: Callable[[], SchedulerOutput] = core.scheduler.schedule

    def recording() -> SchedulerOutput:
        out = schedule()
        seen.append(out)
        return out

    core.scheduler.schedule = recording  # type: ignore[method-assign]
    return seen


def _finals(core: EngineCore) -> dict[str, list[EngineCoreOutput]]:
    outs: dict[str, list[EngineCoreOutput]] = {}
    for step in core.run_until_idle(60):
        assert not step.errors, step.errors
        for o in step.outputs:
            outs.setdefault(o.request_id, []).append(o)
    return outs


def _assert_clean(core: EngineCore, num_blocks: int) -> None:
    core.step()  # the runner drops the rows (and partial state) of the last finished requests
    assert core.kv.num_free_blocks == num_blocks
    assert core.runner.pooler.num_partial == 0
    assert core.runner.input_batch.num_rows == 0


# ---------------------------------------------------------------------------------- embeddings
@pytest.mark.parametrize("pooling", ["LAST", "MEAN", "CLS"])
@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3"])
def test_embeddings_match_transformers(
    tiny_models: dict[str, Path], name: str, pooling: str
) -> None:
    model_dir = tiny_models[name]
    prompts = _prompts(LENGTHS, seed=1)
    # A 32-token budget splits the longer prompts over several steps (chunked prefill).
    llm = LLM(
        model_dir,
        dtype="float32",
        num_kv_blocks=128,
        max_num_batched_tokens=32,
        pooling_type=pooling,
    )
    assert llm.engine.info.tasks.supported_tasks == ("generate", "embed")
    normalized = llm.embed(_ids(prompts), use_tqdm=False)
    raw = llm.embed(_ids(prompts), normalize=False, use_tqdm=False)
    for p, n, r in zip(prompts, normalized, raw, strict=True):
        assert n.prompt_token_ids == p
        np.testing.assert_allclose(n.outputs.embedding, _want(model_dir, p, pooling), **TOL)
        np.testing.assert_allclose(r.outputs.embedding, _want(model_dir, p, pooling, False), **TOL)
        assert n.outputs.hidden_size == _hf_states(model_dir, tuple(p)).shape[-1]
    _assert_clean(llm.engine, 128)


@pytest.mark.parametrize("pooling", ["LAST", "MEAN"])
def test_base_model_checkpoint_embeds(tiny_pooling_models: dict[str, Path], pooling: str) -> None:
    """A Qwen2Model checkpoint: no lm_head, weight names without ``model.``; embed only."""
    model_dir = tiny_pooling_models["embed_base"]
    llm = LLM(model_dir, dtype="float32", num_kv_blocks=64, pooling_type=pooling)
    assert llm.engine.info.tasks.supported_tasks == ("embed",)
    assert llm.engine.runner.model.lm_head is None
    prompts = _prompts([3, 30, 64], seed=2)
    for p, out in zip(prompts, llm.embed(_ids(prompts), use_tqdm=False), strict=True):
        assert len(out.outputs.embedding) == 96
        np.testing.assert_allclose(out.outputs.embedding, _want(model_dir, p, pooling), **TOL)
    with pytest.raises(ValueError, match="does not generate text"):
        llm.generate(_ids(prompts[:1]), use_tqdm=False)


def test_matryoshka_dimensions_cut_then_normalize(tiny_pooling_models: dict[str, Path]) -> None:
    model_dir = tiny_pooling_models["embed"]
    llm = LLM(model_dir, dtype="float32", num_kv_blocks=64)
    assert llm.engine.info.tasks.pooling_type.value == "LAST"  # type: ignore[union-attr]
    prompts = _prompts([5, 20, 33], seed=3)
    # Per-prompt parameters in one batch: different cuts, and one left whole.
    params = [
        PoolingParams(dimensions=16),
        PoolingParams(dimensions=48, normalize=False),
        PoolingParams(),
    ]
    outs = llm.embed(_ids(prompts), params, use_tqdm=False)
    full = [_want(model_dir, p, "LAST", normalize=False) for p in prompts]
    want = [
        full[0][:16] / np.linalg.norm(full[0][:16]),
        full[1][:48],
        full[2] / np.linalg.norm(full[2]),
    ]
    for out, w in zip(outs, want, strict=True):
        assert len(out.outputs.embedding) == len(w)
        np.testing.assert_allclose(out.outputs.embedding, w, **TOL)
    same = llm.embed(_ids(prompts), dimensions=32, use_tqdm=False)  # one cut for the batch
    for out, f in zip(same, full, strict=True):
        np.testing.assert_allclose(out.outputs.embedding, f[:32] / np.linalg.norm(f[:32]), **TOL)


def test_text_prompts_and_embedding_cosine_score(tiny_pooling_models: dict[str, Path]) -> None:
    model_dir = tiny_pooling_models["embed"]
    llm = LLM(model_dir, dtype="float32", num_kv_blocks=64)
    tok = llm.get_tokenizer()
    texts = ["the quick brown fox", "a lazy dog", "hello world"]
    outs = llm.embed(texts, use_tqdm=False)
    vecs = [_want(model_dir, tok.encode(t), "LAST") for t in texts]
    for out, v in zip(outs, vecs, strict=True):
        np.testing.assert_allclose(out.outputs.embedding, v, **TOL)
    scores = llm.score(texts[0], texts[1:], use_tqdm=False)  # 1:N
    assert [s.outputs.score for s in scores] == pytest.approx(
        [float(vecs[0] @ vecs[1]), float(vecs[0] @ vecs[2])], abs=1e-5
    )
    pairwise = llm.score(texts[:2], texts[1:], use_tqdm=False)  # N:N
    assert pairwise[1].outputs.score == pytest.approx(float(vecs[1] @ vecs[2]), abs=1e-5)
    with pytest.raises(ValueError, match="1:1, 1:N or N:N"):
        llm.score(texts[:2], texts, use_tqdm=False)


# ---------------------------------------------------------------------------------- classifiers
@pytest.mark.parametrize("name", ["classify_llama", "classify_qwen2", "classify_qwen3"])
def test_classification_logits_match_transformers(
    tiny_pooling_models: dict[str, Path], name: str
) -> None:
    from transformers import AutoModelForSequenceClassification

    model_dir = tiny_pooling_models[name]
    hf = _hf_model(model_dir, AutoModelForSequenceClassification)
    llm = LLM(model_dir, dtype="float32", num_kv_blocks=64, max_num_batched_tokens=32)
    assert llm.engine.info.tasks.supported_tasks == ("classify",)
    assert len(llm.engine.info.tasks.labels) == 3
    prompts = _prompts(LENGTHS, seed=4)
    logits = llm.classify(_ids(prompts), activation=False, use_tqdm=False)
    probs = llm.classify(_ids(prompts), use_tqdm=False)
    for p, lo, pr in zip(prompts, logits, probs, strict=True):
        ids = torch.tensor([p])
        with torch.inference_mode():
            want = hf(ids, attention_mask=torch.ones_like(ids)).logits[0]
        assert lo.outputs.num_classes == 3
        np.testing.assert_allclose(lo.outputs.probs, want.numpy(), **TOL)
        np.testing.assert_allclose(pr.outputs.probs, torch.softmax(want, -1).numpy(), **TOL)
    with pytest.raises(ValueError, match="'embed' is not served"):
        llm.embed(_ids(prompts[:1]), use_tqdm=False)
    _assert_clean(llm.engine, 64)


def test_cross_encoder_scores_pairs_like_transformers(tiny_pooling_models: dict[str, Path]) -> None:
    from transformers import AutoModelForSequenceClassification

    model_dir = tiny_pooling_models["cross_encoder"]
    hf = _hf_model(model_dir, AutoModelForSequenceClassification)
    llm = LLM(model_dir, dtype="float32", num_kv_blocks=64)
    tok = llm.get_tokenizer()
    query, docs = "what is a fox", ["the quick brown fox", "a lazy dog", "numbers 1 2 3"]
    scores = llm.score(query, docs, use_tqdm=False)
    raw = llm.score([query] * 3, docs, activation=False, use_tqdm=False)
    for doc, s, r in zip(docs, scores, raw, strict=True):
        ids = tok(query, text_pair=doc)["input_ids"]
        assert s.prompt_token_ids == ids
        with torch.inference_mode():
            logit = hf(torch.tensor([ids])).logits[0, 0]
        assert r.outputs.score == pytest.approx(float(logit), abs=2e-5)
        assert s.outputs.score == pytest.approx(float(torch.sigmoid(logit)), abs=2e-5)
    probs = llm.classify(docs, use_tqdm=False)  # one label: classify is the sigmoid too
    with torch.inference_mode():
        logit = hf(torch.tensor([tok.encode(docs[0])])).logits[0, 0]
    assert probs[0].outputs.probs[0] == pytest.approx(float(torch.sigmoid(logit)), abs=2e-5)


# ---------------------------------------------------------------------------------- the engine
def test_pooling_shares_steps_with_generation_without_changing_it(
    tiny_pooling_models: dict[str, Path],
) -> None:
    """Greedy tokens, logprobs, penalties and a structured-output choice come out the same
    whether pooling rows share the generation rows' steps or not."""
    model_dir = tiny_pooling_models["embed"]
    gens = {
        "logprobs": SamplingParams(max_tokens=12, temperature=0.0, logprobs=3, ignore_eos=True),
        "penalty": SamplingParams(
            max_tokens=12, temperature=0.0, repetition_penalty=1.5, presence_penalty=1.0,
            ignore_eos=True,
        ),
        "choice": SamplingParams(
            max_tokens=12, temperature=0.0,
            structured_output=StructuredOutputParams(choice=["yes please", "no thanks"]),
        ),
    }  # fmt: skip
    gen_prompts = dict(zip(gens, _prompts([9, 21, 4], seed=5), strict=True))
    pool_prompts = _prompts([3, 50, 17, 1, 90], seed=6)

    def run(with_pooling: bool) -> tuple[dict[str, list[EngineCoreOutput]], list[SchedulerOutput]]:
        core = _core(model_dir, num_kv_blocks=64, max_num_batched_tokens=48)
        seen = _record_schedules(core)
        for rid, params in gens.items():
            core.add_request(rid, gen_prompts[rid], params)
        if with_pooling:
            for i, p in enumerate(pool_prompts):
                core.add_request(
                    f"pool-{i}", p, SamplingParams(), pooling_params=PoolingParams("embed")
                )
        outs = _finals(core)
        _assert_clean(core, 64)
        return outs, seen

    alone, _ = run(with_pooling=False)
    mixed, seen = run(with_pooling=True)
    shared = [
        s for s in seen
        if {x.request.is_pooling for x in s.scheduled} == {True, False}
    ]  # fmt: skip
    assert len(shared) >= 2, "pooling and generation rows never shared a step"
    for rid in gens:
        tokens = [t for o in mixed[rid] for t in o.new_token_ids]
        assert tokens == [t for o in alone[rid] for t in o.new_token_ids], rid
    lp_mixed = [lp for o in mixed["logprobs"] for lp in o.new_logprobs]
    lp_alone = [lp for o in alone["logprobs"] for lp in o.new_logprobs]
    assert [lp.top.keys() for lp in lp_mixed] == [lp.top.keys() for lp in lp_alone]
    assert [lp.logprob for lp in lp_mixed] == pytest.approx(
        [lp.logprob for lp in lp_alone], abs=1e-4
    )
    for i, p in enumerate(pool_prompts):
        (final,) = mixed[f"pool-{i}"]
        assert final.new_token_ids == [] and str(final.finish_reason) == "stop"
        assert final.pooled is not None
        np.testing.assert_allclose(final.pooled, _want(model_dir, p, "LAST"), **TOL)


@pytest.mark.parametrize("pooling", ["LAST", "MEAN", "CLS"])
def test_chunked_prefill_gives_the_unchunked_vector(
    tiny_models: dict[str, Path], pooling: str
) -> None:
    model_dir = tiny_models["qwen3"]
    prompt = _prompts([150], seed=7)[0]
    vectors = []
    for budget in (2048, 16, 7):
        core = _core(
            model_dir, num_kv_blocks=64, max_num_batched_tokens=budget, pooling_type=pooling
        )
        seen = _record_schedules(core)
        core.add_request("p", prompt, SamplingParams(), pooling_params=PoolingParams("embed"))
        (final,) = _finals(core)["p"]
        chunks = [s.num_tokens for out in seen for s in out.scheduled]
        assert chunks == ([150] if budget == 2048 else [budget] * (150 // budget) + [150 % budget])
        vectors.append(final.pooled)
        _assert_clean(core, 64)
    for v in vectors[1:]:
        np.testing.assert_allclose(v, vectors[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(vectors[0], _want(model_dir, prompt, pooling), **TOL)


@pytest.mark.parametrize("pooling", ["LAST", "MEAN"])
def test_prefix_cache_serves_a_repeated_prompt(tiny_models: dict[str, Path], pooling: str) -> None:
    model_dir = tiny_models["llama"]
    llm = LLM(model_dir, dtype="float32", num_kv_blocks=64, pooling_type=pooling)
    prompt = _prompts([70], seed=8)[0]
    first, second = (llm.embed(_ids([prompt]), use_tqdm=False)[0] for _ in range(2))
    assert first.num_cached_tokens == 0
    # LAST: the four full blocks are hits (the last token is always computed); MEAN reads every
    # position's hidden state, so it does not look the prefix up.
    assert second.num_cached_tokens == (64 if pooling == "LAST" else 0)
    np.testing.assert_allclose(
        second.outputs.embedding, first.outputs.embedding, rtol=1e-5, atol=1e-6
    )
    np.testing.assert_allclose(first.outputs.embedding, _want(model_dir, prompt, pooling), **TOL)
    _assert_clean(llm.engine, 64)


def test_preempted_pooling_requests_recompute_and_match(tiny_models: dict[str, Path]) -> None:
    model_dir = tiny_models["llama"]
    core = _core(
        model_dir,
        num_kv_blocks=10,
        max_num_batched_tokens=24,
        pooling_type="MEAN",
    )
    gen_prompts = _prompts([20, 25, 18], seed=9)
    pool_prompts = _prompts([50, 40, 33], seed=10)
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(gen_prompts):
        core.add_request(f"g{i}", p, greedy)
    for i, p in enumerate(pool_prompts):
        core.add_request(f"p{i}", p, SamplingParams(), pooling_params=PoolingParams("embed"))
    outs: dict[str, list[EngineCoreOutput]] = {}
    preemptions = 0
    for step in core.run_until_idle(120):
        preemptions += step.stats.num_preemptions
        for o in step.outputs:
            outs.setdefault(o.request_id, []).append(o)
    assert preemptions > 0
    # Where the prompt counts (vLLM's iteration tokens): once per request, with its first token
    # or its pooled result, in a run where preemptions make prompts compute again.
    for rid, seq in outs.items():
        assert [o.first for o in seq] == [True] + [False] * (len(seq) - 1), rid
        assert seq[0].new_token_ids or seq[0].pooled is not None, rid
    for i, p in enumerate(pool_prompts):
        (final,) = outs[f"p{i}"]
        np.testing.assert_allclose(final.pooled, _want(model_dir, p, "MEAN"), **TOL)
    from tests.parity.hf_reference import hf_greedy, load_hf

    hf = load_hf(model_dir)
    for i, p in enumerate(gen_prompts):
        got = [t for o in outs[f"g{i}"] for t in o.new_token_ids]
        assert got == hf_greedy(hf, p, 40, stop_at_eos=False)
    _assert_clean(core, 10)


def test_abort_mid_prefill_leaves_nothing(tiny_models: dict[str, Path]) -> None:
    for pooling in ("MEAN", "CLS"):
        core = _core(
            tiny_models["qwen2"], num_kv_blocks=32, max_num_batched_tokens=16, pooling_type=pooling
        )
        core.add_request(
            "p", _prompts([100])[0], SamplingParams(), pooling_params=PoolingParams("embed")
        )
        core.step()
        core.step()
        assert core.runner.pooler.num_partial == 1  # the running sum / the first state is kept
        assert core.kv.num_free_blocks < 32
        (final,) = core.abort_requests(["p"])
        assert str(final.finish_reason) == "abort" and final.pooled is None
        _assert_clean(core, 32)
