"""Seeded sampling through the engine, logprobs against transformers' logits, stop conditions."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from engine_svc import LLM, SamplingParams
from tests.parity.hf_reference import hf_logits, load_hf


@pytest.fixture(scope="module")
def llm(tiny_models: dict[str, Path]) -> LLM:
    return LLM(tiny_models["qwen3"], dtype="float32", num_kv_blocks=256, max_num_batched_tokens=64)


def _p(n: int, seed: int) -> dict[str, list[int]]:
    rng = random.Random(seed)
    return {"prompt_token_ids": [rng.randrange(4, 384) for _ in range(n)]}


def test_seeded_sampling_is_independent_of_batch(llm: LLM) -> None:
    target = _p(20, 0)
    params = SamplingParams(
        max_tokens=20, temperature=1.0, top_p=0.95, top_k=100, seed=1234, ignore_eos=True
    )
    alone = llm.generate([target], params, use_tqdm=False)[0].outputs[0].token_ids

    others = [_p(n, 10 + n) for n in (3, 40, 17, 70)]
    other_params = [
        SamplingParams(max_tokens=n, temperature=0.8, ignore_eos=True, seed=s)
        for n, s in ((5, None), (30, 7), (12, None), (25, 99))
    ]
    mixed = llm.generate(
        others[:2] + [target] + others[2:],
        other_params[:2] + [params] + other_params[2:],
        use_tqdm=False,
    )
    assert mixed[2].outputs[0].token_ids == alone
    # A different seed gives a different draw, and unseeded requests vary.
    other_seed = llm.generate(
        [target], SamplingParams(**{**params.__dict__, "seed": 4321}), use_tqdm=False
    )
    assert other_seed[0].outputs[0].token_ids != alone


def test_logprobs_match_transformers(llm: LLM, tiny_models: dict[str, Path]) -> None:
    hf = load_hf(tiny_models["qwen3"])
    prompt = _p(37, 5)
    out = llm.generate(
        [prompt],
        SamplingParams(
            max_tokens=12, temperature=0.0, logprobs=5, prompt_logprobs=3, ignore_eos=True
        ),
        use_tqdm=False,
    )[0]
    seq = prompt["prompt_token_ids"] + out.outputs[0].token_ids
    ref = torch.log_softmax(hf_logits(hf, seq), dim=-1)
    n_prompt = len(prompt["prompt_token_ids"])

    lps = out.outputs[0].logprobs
    assert lps is not None and len(lps) == 12
    for i, lp in enumerate(lps):
        row = ref[n_prompt - 1 + i]
        assert lp.token_id == seq[n_prompt + i]
        assert abs(lp.logprob - row[lp.token_id].item()) < 1e-4
        assert lp.rank == 1  # greedy picks the top token
        top_vals, top_ids = row.topk(5)
        assert list(lp.top) == top_ids.tolist()
        assert torch.allclose(torch.tensor(list(lp.top.values())), top_vals, atol=1e-4)

    plp = out.prompt_logprobs
    assert plp is not None and len(plp) == n_prompt and plp[0] is None
    for pos in range(1, n_prompt):
        entry = plp[pos]
        assert entry is not None and entry.token_id == seq[pos]
        assert abs(entry.logprob - ref[pos - 1, seq[pos]].item()) < 1e-4
        assert len(entry.top) == 3


def test_stop_token_ids_and_min_tokens(llm: LLM) -> None:
    prompt = _p(10, 9)
    free = llm.generate(
        [prompt], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True), use_tqdm=False
    )
    tokens = free[0].outputs[0].token_ids
    stop = tokens[5]
    first = tokens.index(stop)
    out = llm.generate(
        [prompt],
        SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=[stop], ignore_eos=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.token_ids == tokens[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop

    banned = llm.generate(
        [prompt],
        SamplingParams(
            max_tokens=30,
            min_tokens=first + 3,
            temperature=0.0,
            stop_token_ids=[stop],
            ignore_eos=True,
        ),
        use_tqdm=False,
    )[0].outputs[0]
    assert stop not in banned.token_ids[: first + 3]
    assert len(banned.token_ids) >= first + 3


def test_n_and_order_and_bad_input(llm: LLM) -> None:
    prompts = [_p(n, n) for n in (50, 3, 20)]
    outs = llm.generate(
        prompts, SamplingParams(max_tokens=4, temperature=1.0, n=3, seed=5), use_tqdm=False
    )
    assert [o.prompt_token_ids for o in outs] == [p["prompt_token_ids"] for p in prompts]
    assert all(len(o.outputs) == 3 and [c.index for c in o.outputs] == [0, 1, 2] for o in outs)
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate([{"prompt_token_ids": [10_000]}], use_tqdm=False)
    with pytest.raises(ValueError, match="logprobs"):
        llm.generate([prompts[0]], SamplingParams(logprobs=21), use_tqdm=False)
    with pytest.raises(ValueError, match="context length"):
        llm.generate([_p(1024, 1)], use_tqdm=False)
    assert llm.engine.kv.num_free_blocks == 256  # nothing leaked by the rejected requests


def test_unsupported_architecture_lists_supported(tmp_path: Path) -> None:
    import json

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"):
        LLM(tmp_path)


def test_context_is_capped_at_kv_capacity(tiny_models: dict[str, Path]) -> None:
    """A cache smaller than the context would let one request preempt itself forever."""
    small = LLM(tiny_models["llama"], dtype="float32", num_kv_blocks=4)  # 64 tokens
    assert small.engine.info.max_model_len == 64
    out = small.generate(
        [_p(60, 3)], SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 4  # 60 + 4 = 64
    assert small.engine.kv.num_free_blocks == 4


def test_prompt_logprobs_survive_preemption_during_chunked_prefill(
    tiny_models: dict[str, Path],
) -> None:
    """A request preempted mid-prefill recomputes its chunks; its prompt logprobs must still
    come back once per prompt token (they used to be appended again: 97 for 40 tokens)."""
    from engine_svc.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from engine_svc.engine_core import EngineCore

    model_dir = tiny_models["qwen3"]
    engine = EngineCore(
        EngineConfig(
            model=ModelConfig(str(model_dir), dtype="float32"),
            cache=CacheConfig(num_kv_blocks=8, enable_prefix_caching=False),  # 128 slots
            scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=16),
        )
    )
    long_runs = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    engine.add_request("b", _p(30, 21)["prompt_token_ids"], long_runs)
    engine.add_request("c", _p(30, 22)["prompt_token_ids"], long_runs)
    prompt = _p(40, 23)["prompt_token_ids"]
    engine.add_request(
        "a", prompt, SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=2)
    )
    preempted_in_prefill = 0
    sent: list[list] = []
    while engine.has_unfinished_requests():
        before = engine.scheduler.requests.get("a")
        preemptions = before.num_preemptions if before is not None else 0
        for o in engine.step().outputs:
            if o.request_id == "a" and o.prompt_logprobs is not None:
                sent.append(o.prompt_logprobs)
        after = engine.scheduler.requests.get("a")
        if after is not None and after.num_preemptions > preemptions:
            preempted_in_prefill += after.num_output_tokens == 0
    assert preempted_in_prefill > 0, "the scenario must preempt 'a' during its prefill"
    assert len(sent) == 1
    plp = sent[0]
    assert len(plp) == len(prompt) and plp[0] is None
    ref = torch.log_softmax(hf_logits(load_hf(model_dir), prompt), dim=-1)
    for pos in range(1, len(prompt)):
        entry = plp[pos]
        assert entry is not None and entry.token_id == prompt[pos]
        assert abs(entry.logprob - ref[pos - 1, prompt[pos]].item()) < 1e-4
        assert len(entry.top) == 2
    assert engine.kv.num_free_blocks == 8
