"""Speculative decoding keeps every sampling feature's meaning (issue 34).

Greedy output with speculation equals greedy output without it, token for token, for each of:
repetition penalty, frequency + presence penalties, logit bias, bad words (one token and several),
allowed token ids, min_tokens with a stop id, prompt logprobs, a regex grammar and a JSON schema
grammar. Each case runs alone (the engine is idle between cases), so the step counters are its
requests': proposals were made and verified (drafts), some accepted (multi-token runs, where the
positions after the first see the proposals before them) and some rejected. The grammar cases
also see proposals the grammar refuses and proposals it allows that the model rejects, and the
matcher ends having accepted exactly the output. Sampled requests with these features (a
grammar too) speculate, keep their bans and grammar at every position and follow their seed.
(The per-position metadata itself, greedy and sampled, is checked against decoding one token at
a time in ``tests/unit/test_spec_decode_positions.py``.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine_svc.core.sampling_params import SamplingParams, StructuredOutputParams
from engine_svc.engine_core import EngineCore
from tests.parity.test_spec_decode import SPEC, _engine, _prompts, _run

GREEDY: dict[str, Any] = dict(max_tokens=24, temperature=0.0, ignore_eos=True)


def _cases(free: list[list[int]], prompts: list[list[int]]) -> dict[str, list[SamplingParams]]:
    """Each feature's parameters for the four prompts, some built from the free output ``free``
    (so the bans and biases hit tokens the model wants)."""
    same = {
        "repetition": dict(repetition_penalty=1.1),
        "frequency_presence": dict(frequency_penalty=0.05, presence_penalty=0.1),
    }
    cases = {name: [SamplingParams(**GREEDY, **kw)] * len(free) for name, kw in same.items()}
    cases["logit_bias"] = [
        SamplingParams(**GREEDY, logit_bias={f[5]: -1.0, f[8]: 1.0}) for f in free
    ]
    cases["bad_word"] = [SamplingParams(**GREEDY, bad_words_token_ids=[[f[3]]]) for f in free]
    cases["bad_words_multi"] = [
        SamplingParams(**GREEDY, bad_words_token_ids=[[f[2], f[3]], [f[5], f[6], f[7]]])
        for f in free
    ]
    cases["allowed_token_ids"] = [
        SamplingParams(**GREEDY, allowed_token_ids=sorted(set(f[:12]) | set(p[:3])))
        for f, p in zip(free, prompts, strict=True)
    ]
    cases["min_tokens"] = [
        SamplingParams(**GREEDY, min_tokens=10, stop_token_ids=[f[4]]) for f in free
    ]
    return cases


CASES = [
    "repetition",
    "frequency_presence",
    "logit_bias",
    "bad_word",
    "bad_words_multi",
    "allowed_token_ids",
    "min_tokens",
]


@pytest.fixture(scope="module")
def engines(tiny_models: dict[str, Path]) -> tuple[EngineCore, EngineCore]:
    return _engine(tiny_models["llama"], None), _engine(tiny_models["llama"], SPEC)


@pytest.mark.parametrize("case", CASES)
def test_greedy_feature_output_is_the_same_with_and_without_speculation(
    engines: tuple[EngineCore, EngineCore], case: str
) -> None:
    base, spec = engines
    prompts = _prompts(21, 4)
    free, _, _ = _run(base, prompts, [SamplingParams(**GREEDY)] * 4)
    params = _cases(free, prompts)[case]
    want, want_reasons, _ = _run(base, prompts, params)
    got, reasons, totals = _run(spec, prompts, params)
    assert want != free  # the feature changes the output
    assert got == want and reasons == want_reasons
    assert totals["drafts"] > 0  # these requests speculated
    assert 0 < totals["accepted"] < totals["proposed"], totals  # accepted and rejected both
    assert spec.kv.num_free_blocks == 64


def test_prompt_logprobs_requests_speculate(engines: tuple[EngineCore, EngineCore]) -> None:
    base, spec = engines
    prompts = _prompts(22, 3)
    params = [SamplingParams(**GREEDY, prompt_logprobs=2)] * 3

    def run(engine: EngineCore) -> tuple[list[list[int]], list[Any], int]:
        reqs = [
            engine.add_request(f"p{i}", p, sp)
            for i, (p, sp) in enumerate(zip(prompts, params, strict=True))
        ]
        drafts = 0
        while engine.has_unfinished_requests():
            drafts += engine.step().stats.spec_num_drafts
        return [r.output_token_ids for r in reqs], [r.prompt_logprobs for r in reqs], drafts

    want, want_lp, _ = run(base)
    got, got_lp, drafts = run(spec)
    assert got == want and drafts > 0
    for g, w, p in zip(got_lp, want_lp, prompts, strict=True):
        assert len(g) == len(w) == len(p) and g[0] is None and w[0] is None
        for a, b in zip(g[1:], w[1:], strict=True):
            assert a.token_id == b.token_id and a.rank == b.rank and list(a.top) == list(b.top)
            assert a.logprob == pytest.approx(b.logprob, abs=1e-5)


def test_sampled_requests_with_features_speculate_and_follow_their_seed(
    engines: tuple[EngineCore, EngineCore],
) -> None:
    """Each request bans the token its free output repeats most (which the proposer then keeps
    proposing): a bias of -100, allowed ids without it, a bad word, min_tokens before it as a
    stop id. The bans hold at every position, and the seeded draws repeat."""
    _, spec = engines
    prompts = _prompts(23, 4)
    sampled: dict[str, Any] = dict(max_tokens=20, temperature=0.3, ignore_eos=True)
    seeded = [SamplingParams(**sampled, seed=i) for i in range(4)]
    free, _, _ = _run(spec, prompts, seeded)
    top = [max(set(f), key=f.count) for f in free]
    allowed = sorted(set(free[1] + prompts[1]) - {top[1]})
    params = [
        SamplingParams(**sampled, seed=0, frequency_penalty=0.1, logit_bias={top[0]: -100}),
        SamplingParams(**sampled, seed=1, repetition_penalty=1.1, allowed_token_ids=allowed),
        SamplingParams(**sampled, seed=2, presence_penalty=0.2, bad_words_token_ids=[[top[2]]]),
        SamplingParams(**sampled, seed=3, min_tokens=12, stop_token_ids=[top[3]]),
    ]
    first, _, totals = _run(spec, prompts, params)
    again, _, _ = _run(spec, prompts, params)
    assert first == again  # seeded: the same draws
    assert totals["drafts"] > 0 and 0 < totals["accepted"] < totals["proposed"], totals
    assert top[0] not in first[0] and set(first[1]) <= set(allowed) and top[2] not in first[2]
    assert len(first[3]) >= 12 and top[3] not in first[3][:11]


# ---------------------------------------------------------------------------- grammars

DIGITS = StructuredOutputParams(regex="[0-9]{1,40}")
ARRAY = StructuredOutputParams(
    json_schema={
        "type": "object",
        "properties": {"a": {"type": "array", "items": {"type": "integer"}}},
        "required": ["a"],
    }
)
# Prompts whose repeats the proposer copies: letters among the digits (refused by DIGITS), JSON.
TEXTS = ["12a12a12a12a12a", "7 8 x 7 8 x 7 8 x 7 8", '{"a": [1, 2, 1, 2, 1, 2]} {"a": [1, 2,']


def _default_engine(spec: bool) -> EngineCore:
    from engine_svc.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from engine_svc.default_model import ensure_default_model

    return EngineCore(
        EngineConfig(
            model=ModelConfig(str(ensure_default_model()), dtype="float32"),
            cache=CacheConfig(block_size=4, num_kv_blocks=128),
            scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64),
            device="cpu",
            speculative=SPEC if spec else None,
        )
    )


@pytest.fixture(scope="module")
def grammar_engines(cache_dir: Path) -> tuple[EngineCore, EngineCore]:
    pytest.importorskip("xgrammar")
    return _default_engine(False), _default_engine(True)


@pytest.mark.parametrize("constraint", [DIGITS, ARRAY], ids=["regex", "json_schema"])
def test_grammar_output_is_the_same_with_and_without_speculation(
    grammar_engines: tuple[EngineCore, EngineCore],
    constraint: StructuredOutputParams,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from tokenizers import Tokenizer

    from engine_svc.default_model import ensure_default_model
    from engine_svc.structured_output.bitmask import GrammarBitmask

    tok = Tokenizer.from_file(str(ensure_default_model() / "tokenizer.json"))
    prompts = [tok.encode(t).ids for t in TEXTS]
    params = [SamplingParams(max_tokens=40, temperature=0.0, structured_output=constraint)] * 3
    base, spec = grammar_engines

    # How many proposals the grammar let through, of how many, at every verification.
    looked: list[tuple[int, int]] = []
    apply_ahead = GrammarBitmask.apply_ahead

    def spy(self: GrammarBitmask, logits: Any, positions: int, requests: Any) -> list[int]:
        reached = apply_ahead(self, logits, positions, requests)
        looked.extend((len(p), m) for (_, _, p), m in zip(requests, reached, strict=True))
        return reached

    monkeypatch.setattr(GrammarBitmask, "apply_ahead", spy)

    def run(engine: EngineCore) -> tuple[list[list[int]], dict[str, int]]:
        reqs = [
            engine.add_request(f"g{i}", p, sp)
            for i, (p, sp) in enumerate(zip(prompts, params, strict=True))
        ]
        totals = dict(drafts=0, proposed=0, accepted=0)
        while engine.has_unfinished_requests():
            step = engine.step()
            assert step.errors == []  # a matcher out of step fails its request
            totals["drafts"] += step.stats.spec_num_drafts
            totals["proposed"] += step.stats.spec_num_draft_tokens
            totals["accepted"] += step.stats.spec_num_accepted_tokens
        for r in reqs:  # the matcher has accepted the output, no more, no less
            assert r.grammar is not None and r.grammar.num_accepted == len(r.output_token_ids)
        return [r.output_token_ids for r in reqs], totals

    want, _ = run(base)
    got, totals = run(spec)
    assert got == want
    assert totals["drafts"] > 0 and 0 < totals["accepted"] < totals["proposed"], totals
    allowed = sum(m for _, m in looked)
    assert totals["accepted"] < allowed  # some proposals the grammar allows, the model rejects
    if constraint is DIGITS:
        assert any(m < n for n, m in looked)  # some proposals the grammar refuses


def test_sampled_grammar_requests_speculate_within_their_grammar(
    grammar_engines: tuple[EngineCore, EngineCore],
) -> None:
    import re

    from tokenizers import Tokenizer

    from engine_svc.default_model import ensure_default_model

    tok = Tokenizer.from_file(str(ensure_default_model() / "tokenizer.json"))
    prompts = [tok.encode(t).ids for t in TEXTS]
    _, spec = grammar_engines

    def run() -> tuple[list[list[int]], int]:
        sampled = dict(max_tokens=40, temperature=0.5, structured_output=DIGITS)
        reqs = [
            spec.add_request(f"s{i}", p, SamplingParams(**sampled, seed=i))  # type: ignore[arg-type]
            for i, p in enumerate(prompts)
        ]
        accepted = 0
        while spec.has_unfinished_requests():
            step = spec.step()
            assert step.errors == []
            accepted += step.stats.spec_num_accepted_tokens
        for r in reqs:
            assert r.grammar is not None and r.grammar.num_accepted == len(r.output_token_ids)
        return [r.output_token_ids for r in reqs], accepted

    first, accepted = run()
    again, _ = run()
    assert first == again and accepted > 0
    for out in first:
        text = tok.decode([t for t in out if t != 2])  # EOS (<|im_end|>) ends the text
        assert re.fullmatch("[0-9]{1,40}", text), text
