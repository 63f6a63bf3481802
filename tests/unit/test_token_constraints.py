"""allowed_token_ids, bad words and logit_bias in the engine: parameters, the persistent batch's
per-row state, the sampler (mixed with free, penalised, greedy, random and grammar rows) and the
offline LLM."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from engine_svc import LLM, SamplingParams
from engine_svc.core.request import Request
from engine_svc.rpc import convert
from engine_svc.worker.input_batch import InputBatch
from engine_svc.worker.sampler import (
    AllowedTokens,
    LogitBias,
    Penalties,
    SamplingMetadata,
    sample,
)
from engine_svc.worker.sampling_inputs import bad_word_bans, sampling_metadata
from protos.bad_words import EmptyBadWord, bad_words_token_ids
from protos.convert import sampling_params_from_pb
from protos.tandem.engine.v1 import engine_pb2 as pb

NEG_INF = float("-inf")

# ---------------------------------------------------------------------------- parameters


@pytest.mark.parametrize(
    ("kw", "name"),
    [
        ({"logit_bias": {1: 100.5}}, "logit_bias"),
        ({"logit_bias": {1: -101}}, "logit_bias"),
        ({"logit_bias": {1: float("nan")}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {"1": 1.0}}, "logit_bias"),
        ({"logit_bias": [1, 2]}, "logit_bias"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [1, -2]}, "allowed_token_ids"),
        ({"allowed_token_ids": [True]}, "allowed_token_ids"),
        ({"bad_words": [" "]}, "bad_words"),
        ({"bad_words_token_ids": [[1], []]}, "bad_words_token_ids"),
        ({"bad_words_token_ids": [[1]] * 257}, "bad_words_token_ids"),
        ({"bad_words_token_ids": [[1] * 4097]}, "bad_words_token_ids"),
    ],
)
def test_invalid_values_name_the_parameter(kw: dict[str, Any], name: str) -> None:
    with pytest.raises(ValueError, match=rf"^{name} "):
        SamplingParams(**kw)


def test_token_ids_are_checked_against_the_vocabulary() -> None:
    SamplingParams(
        logit_bias={9: 1.0}, allowed_token_ids=[9], bad_words_token_ids=[[9]]
    ).check_vocab(10)
    for kw, name in (
        ({"logit_bias": {10: 1.0}}, "logit_bias"),
        ({"allowed_token_ids": [3, 10]}, "allowed_token_ids"),
        ({"bad_words_token_ids": [[1, 12]]}, "bad_words_token_ids"),
    ):
        with pytest.raises(ValueError, match=rf"^{name} contains .* \[0, 10\): \[1\d\]"):
            SamplingParams(**kw).check_vocab(10)  # type: ignore[arg-type]


def test_contract_fields_convert() -> None:
    m = pb.SamplingParams(allowed_token_ids=[4, 5], logit_bias={7: -100.0, 8: 2.5})
    m.bad_words.add(token_ids=[1, 2])
    m.bad_words.add(token_ids=[3])
    p = convert.sampling_params(sampling_params_from_pb(m), 20)
    assert p.allowed_token_ids == [4, 5]
    assert p.logit_bias == {7: -100.0, 8: 2.5}
    assert p.bad_words_token_ids == [[1, 2], [3]]
    empty = convert.sampling_params(sampling_params_from_pb(pb.SamplingParams()), 20)
    assert (empty.allowed_token_ids, empty.logit_bias, empty.bad_words_token_ids) == (None,) * 3
    m = pb.SamplingParams()
    m.bad_words.add()
    with pytest.raises(ValueError, match="^bad_words_token_ids "):
        convert.sampling_params(sampling_params_from_pb(m), 20)


def test_bad_words_are_tokenized_with_and_without_a_leading_space() -> None:
    vocab = {"bad": [10], " bad": [11], "two words": [20, 21], " two words": [22, 21]}
    vocab |= {"x": [30], " x": [31, 30]}  # the spaced form is longer: not added

    def encode(text: str) -> list[int]:
        return vocab[text]

    assert bad_words_token_ids(encode, ["bad", "  two words", "x", " bad"]) == [
        (10,),
        (11,),
        (20, 21),
        (22, 21),
        (30,),
    ]  # " bad" repeats "bad": dropped
    with pytest.raises(EmptyBadWord, match="'empty' tokenizes to no token"):
        bad_words_token_ids(lambda text: [], ["empty"])


def test_bad_word_bans_follow_the_output_suffix() -> None:
    words = [([], 5), ([1, 2], 3), ([2], 4), ([9, 9, 9], 7)]
    out = np.array([], dtype=np.int32)
    assert bad_word_bans(words, out) == [5]
    assert bad_word_bans(words, np.array([1, 2], dtype=np.int32)) == [5, 3, 4]
    assert bad_word_bans(words, np.array([2, 1], dtype=np.int32)) == [5]
    assert bad_word_bans(words, np.array([9, 9], dtype=np.int32)) == [5]  # too short
    assert bad_word_bans(words, np.array([0, 9, 9, 9], dtype=np.int32)) == [5, 7]


# ---------------------------------------------------------------------------- the sampler


def _md(b: int, **kw: Any) -> SamplingMetadata:
    base: dict[str, Any] = dict(
        temperature=torch.ones(b), all_greedy=False, top_k=None, top_p=None, min_p=None
    )
    base.update(kw)
    return SamplingMetadata(generators=base.pop("generators", {}), **base)


def _dense(
    logits: torch.Tensor,
    allowed: dict[int, list[int]],
    bias: dict[int, dict[int, float]],
    pen: Penalties | None,
    banned: dict[int, list[int]],
) -> torch.Tensor:
    """The adjusted logits written out row by row, in vLLM's order."""
    out = logits.float().clone()
    for row, ids in allowed.items():
        keep = torch.zeros(out.shape[1], dtype=torch.bool)
        keep[ids] = True
        out[row][~keep] = NEG_INF
    for row, ids in banned.items():
        out[row, ids] = NEG_INF
    for row, entries in bias.items():
        for t, v in entries.items():
            out[row, t] += v
    if pen is not None:
        for i, row in enumerate(pen.rows.tolist()):
            x = out[row]
            rep = float(pen.repetition[i])
            seen = pen.seen_mask[i]
            x[seen] = torch.where(x[seen] > 0, x[seen] / rep, x[seen] * rep)
            counts = pen.output_counts[i].float()
            x -= float(pen.frequency[i]) * counts
            x -= float(pen.presence[i]) * (counts > 0).float()
    return out


def _constraints(
    b: int, vocab: int, logits: torch.Tensor
) -> tuple[dict[str, Any], dict[int, list[int]], dict[int, dict[int, float]], Penalties]:
    """Rows 0 and 5 free; 1 allowed; 2 bias; 3 allowed + bias + penalty; 4 bias + penalty."""
    allowed = {1: [3, 7, 11], 3: list(range(0, vocab, 2))}
    top = logits.float().argmax(-1).tolist()
    bias = {2: {5: 100.0, 6: -3.0}, 3: {4: 50.0, top[3]: -100.0}, 4: {top[4]: -100.0, 9: 1.5}}
    g = torch.Generator().manual_seed(5)
    pen = Penalties(
        rows=torch.tensor([3, 4]),
        presence=torch.tensor([0.5, -0.5]),
        frequency=torch.tensor([0.3, 0.2]),
        repetition=torch.tensor([1.4, 0.7]),
        output_counts=torch.randint(0, 3, (2, vocab), generator=g, dtype=torch.int32),
        seen_mask=torch.rand(2, vocab, generator=g) < 0.3,
    )
    mask = torch.zeros(len(allowed), vocab, dtype=torch.bool)
    for i, ids in enumerate(allowed.values()):
        mask[i, ids] = True
    flat = [(row, t, v) for row, entries in bias.items() for t, v in entries.items()]
    kw = dict(
        allowed=AllowedTokens(rows=torch.tensor(list(allowed)), mask=mask),
        logit_bias=LogitBias(
            rows=torch.tensor([r for r, _, _ in flat]),
            token_ids=torch.tensor([t for _, t, _ in flat]),
            values=torch.tensor([v for _, _, v in flat]),
        ),
        penalties=pen,
    )
    return kw, allowed, bias, pen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_rows", [True, False], ids=["host_rows", "derived_rows"])
def test_constraints_match_their_definition_on_mixed_rows(
    dtype: torch.dtype, with_rows: bool
) -> None:
    b, vocab = 6, 40
    torch.manual_seed(0)
    logits = (torch.randn(b, vocab) * 2).to(dtype)
    before = logits.clone()
    kw, allowed, bias, pen = _constraints(b, vocab, logits)
    if with_rows:
        kw["adjusted_rows"] = torch.tensor([1, 2, 3, 4])
    banned = {2: [5], 3: [0]}  # a bad word's next token wins over a +100 bias
    kw["banned"] = list(banned.items())
    want = _dense(logits, allowed, bias, pen, banned)

    greedy = sample(logits, _md(b, temperature=torch.zeros(b), all_greedy=True, **kw))
    assert greedy.token_ids.tolist() == want.argmax(-1).tolist()
    assert greedy.token_ids[1] in (3, 7, 11) and greedy.token_ids[3] % 2 == 0
    assert torch.equal(logits, before)

    def seeded(x: torch.Tensor, seed: int, **extra: Any) -> list[int]:
        gens = {r: torch.Generator().manual_seed(seed + r) for r in range(b)}
        temp = torch.tensor([0.7, 1.0, 0.0, 1.3, 0.9, 0.0])  # greedy and random rows
        top_k = torch.tensor([vocab, 5, vocab, vocab, 8, vocab])
        md = _md(b, temperature=temp, generators=gens, top_k=top_k, max_top_k=8, **extra)
        return sample(x, md).token_ids.tolist()

    for seed in range(0, 60, 10):
        assert seeded(logits, seed, **kw) == seeded(want, seed)
    assert torch.equal(logits, before)


def test_bias_makes_greedy_pick_the_token_and_allowed_restricts_random_draws() -> None:
    torch.manual_seed(1)
    b, vocab = 200, 50
    logits = torch.randn(b, vocab) * 3
    md = _md(
        b,
        allowed=AllowedTokens(
            rows=torch.arange(100), mask=torch.zeros(100, vocab, dtype=torch.bool)
        ),
        logit_bias=LogitBias(
            rows=torch.arange(100, 200),
            token_ids=torch.full((100,), 17),
            values=torch.full((100,), 100.0),
        ),
        adjusted_rows=torch.arange(b),
    )
    assert md.allowed is not None
    md.allowed.mask[:, [2, 30, 31]] = True
    out = sample(logits, md).token_ids.tolist()
    assert set(out[:100]) <= {2, 30, 31} and len(set(out[:100])) > 1
    assert set(out[100:]) == {17}


def test_grammar_forbidden_tokens_stay_forbidden_under_bias() -> None:
    """The model runner's structured-output bitmask leaves -inf on forbidden tokens before the
    sampler runs: a +100 bias does not bring them back, and allowed ids narrow the grammar."""
    b, vocab = 4, 30
    torch.manual_seed(2)
    logits = torch.randn(b, vocab)
    logits[:, 10:] = NEG_INF  # the grammar allows ids 0-9 only
    md = _md(
        b,
        temperature=torch.zeros(b),
        all_greedy=True,
        logit_bias=LogitBias(
            rows=torch.tensor([0, 1]),
            token_ids=torch.tensor([20, 4]),
            values=torch.tensor([100.0, 100.0]),
        ),
        allowed=AllowedTokens(rows=torch.tensor([2]), mask=torch.zeros(1, vocab, dtype=torch.bool)),
    )
    assert md.allowed is not None
    md.allowed.mask[0, [5, 25]] = True
    out = sample(logits, md).token_ids.tolist()
    assert out[0] < 10 and out[1] == 4 and out[2] == 5


def _largest_allocation(fn: Callable[[], object]) -> int:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return max((int(e.cpu_memory_usage) for e in prof.events()), default=0)


def test_only_the_constrained_rows_are_copied() -> None:
    b, vocab = 64, 4096
    logits = torch.randn(b, vocab).to(torch.bfloat16)
    md = _md(
        b,
        temperature=torch.zeros(b),
        all_greedy=True,
        logit_bias=LogitBias(
            rows=torch.tensor([7]), token_ids=torch.tensor([3]), values=torch.tensor([100.0])
        ),
        allowed=AllowedTokens(rows=torch.tensor([40]), mask=torch.ones(1, vocab, dtype=torch.bool)),
        banned=[(20, [int(logits[20].float().argmax())])],  # a bad word's next token
        adjusted_rows=torch.tensor([7, 20, 40]),
    )
    # A [3, V] float copy and its temporaries; never a [B, V] one (1 MiB here).
    assert _largest_allocation(lambda: sample(logits, md)) <= 3 * vocab * 4
    tokens = sample(logits, md).token_ids
    assert tokens[7] == 3 and tokens[20] != logits[20].float().argmax()


# ---------------------------------------------------------------------------- the persistent batch

VOCAB = 50


def _req(rid: str, rng: random.Random, **params: Any) -> Request:
    tokens = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 6))]
    return Request(rid, tokens, SamplingParams(**params))


def test_rows_keep_their_constraints_through_moves_and_steps() -> None:
    rng = random.Random(0)
    batch = InputBatch(8, 320, 8, VOCAB, torch.device("cpu"))
    kinds: list[dict[str, Any]] = [
        {},
        {"allowed_token_ids": [1, 2, 3]},
        {"logit_bias": {4: 100.0, 5: -100.0}},
        {"bad_words_token_ids": [[6], [7, 8]]},
        {"allowed_token_ids": [9], "logit_bias": {9: 1.0}, "repetition_penalty": 1.2},
    ]
    live: dict[str, Request] = {}
    for step in range(300):
        if rng.random() < 0.3 and len(live) < 8:
            kind = rng.choice(kinds)
            req = _req(f"r{step}", rng, temperature=0.0, **kind)
            batch.add(req, [0])
            live[req.request_id] = req
        elif rng.random() < 0.2 and live:
            rid = rng.choice(sorted(live))
            batch.remove(rid)
            del live[rid]
        if not live:
            continue
        reqs = list(live.values())
        rng.shuffle(reqs)  # the logits order is not the rows' order
        rows = np.array([batch.row_of[r.request_id] for r in reqs], dtype=np.int64)
        md = sampling_metadata(batch, rows, reqs, {}, VOCAB)
        _check_metadata(md, reqs)
        tokens = [rng.choice([7, 8, 1, 9, 4]) for _ in reqs]
        batch.append_sampled(rows.tolist(), tokens, torch.tensor(tokens))
        for r, t in zip(reqs, tokens, strict=True):
            r.append_output_token(t)


def _check_metadata(md: SamplingMetadata, reqs: list[Request]) -> None:
    allowed = {i: r.sampling_params.allowed_token_ids for i, r in enumerate(reqs)}
    allowed = {i: ids for i, ids in allowed.items() if ids}
    if md.allowed is None:
        assert not allowed
    else:
        got = {
            row: torch.nonzero(mask).flatten().tolist()
            for row, mask in zip(md.allowed.rows.tolist(), md.allowed.mask, strict=True)
        }
        assert got == allowed
    bias = {
        (i, t, v)
        for i, r in enumerate(reqs)
        for t, v in (r.sampling_params.logit_bias or {}).items()
    }
    if md.logit_bias is None:
        assert not bias
    else:
        lb = md.logit_bias
        triples = zip(lb.rows.tolist(), lb.token_ids.tolist(), lb.values.tolist(), strict=True)
        assert set(triples) == bias
    banned = dict(md.banned or [])
    if md.allowed is not None or md.logit_bias is not None or banned:
        assert md.adjusted_rows is not None
        expect = {
            i
            for i, r in enumerate(reqs)
            if r.sampling_params.allowed_token_ids
            or r.sampling_params.logit_bias
            or r.sampling_params.has_penalties
        }
        assert md.adjusted_rows.tolist() == sorted(expect | set(banned))
    else:
        assert md.adjusted_rows is None
    for i, r in enumerate(reqs):
        words = r.sampling_params.bad_words_token_ids
        if not words:
            assert i not in banned
            continue
        out = r.output_token_ids
        want = [6] + ([8] if out and out[-1] == 7 else [])
        assert banned.get(i) == want


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
        ),
    ],
)
def test_batch_to_tokens_matches_the_definition(device: str) -> None:
    """From the persistent batch to sampled tokens, on the device the engine runs on."""
    params: list[dict[str, Any]] = [
        {},
        {"allowed_token_ids": [3, 30, 31]},
        {"logit_bias": {7: 100.0}},
        {"bad_words_token_ids": [[11, 12], [13]], "presence_penalty": 1.0},
        {"logit_bias": {8: 5.0}, "repetition_penalty": 1.5},
    ]
    batch = InputBatch(8, 32, 4, VOCAB, torch.device(device))
    reqs = [
        Request(f"r{i}", [11, 2, 11], SamplingParams(temperature=0.0, **p))
        for i, p in enumerate(params)
    ]
    for r in reqs:
        batch.add(r, [0])
    batch.append_sampled(list(range(5)), [11] * 5, torch.full((5,), 11, device=device))
    for r in reqs:
        r.append_output_token(11)
    logits = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    logits[3, 12] = logits[3, 13] = 50.0  # what the bad words ban
    md = sampling_metadata(batch, np.arange(5), reqs, {}, VOCAB)
    got = sample(logits.to(device), md).token_ids.tolist()
    want = logits.clone()
    want[1, [t for t in range(VOCAB) if t not in (3, 30, 31)]] = NEG_INF
    want[2, 7] += 100.0
    want[3, [12, 13]] = NEG_INF
    want[3, 11] -= 1.0
    want[4, 8] += 5.0
    x = want[4, [2, 11]]
    want[4, [2, 11]] = torch.where(x > 0, x / 1.5, x * 1.5)
    assert got == want.argmax(-1).tolist()
    assert got[2] == 7 and got[1] in (3, 30, 31) and got[3] not in (12, 13)


def test_bad_words_count_only_the_output() -> None:
    batch = InputBatch(2, 32, 4, VOCAB, torch.device("cpu"))
    req = Request("a", [7], SamplingParams(bad_words_token_ids=[[7, 8]]))  # the prompt ends in 7
    batch.add(req, [0])
    md = sampling_metadata(batch, np.array([0]), [req], {}, VOCAB)
    assert md.banned is None


# ---------------------------------------------------------------------------- the offline LLM


@pytest.fixture(scope="module")
def llm(tiny_models: dict[str, Path]) -> LLM:
    return LLM(tiny_models["llama"], dtype="float32", num_kv_blocks=64, device="cpu")


PROMPTS = [[random.Random(i).randrange(4, 384) for _ in range(6)] for i in range(3)]


def _run(llm: LLM, **kw: Any) -> list[list[int]]:
    params = SamplingParams(max_tokens=12, ignore_eos=True, **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_offline_llm_applies_the_constraints(llm: LLM) -> None:
    free = _run(llm, temperature=0.0)
    assert all(len(set(ids)) > 1 for ids in free)
    assert _run(llm, temperature=0.0, logit_bias={77: 100.0}) == [[77] * 12] * 3
    allowed = [5, 99, 200, 301]
    for ids in _run(llm, temperature=1.0, seed=3, allowed_token_ids=allowed):
        assert set(ids) <= set(allowed)
    banned = sorted({free[0][0], free[1][1], free[2][2]})
    for ids in _run(llm, temperature=0.0, bad_words_token_ids=[[t] for t in banned]):
        assert not set(ids) & set(banned)
    with pytest.raises(ValueError, match="logit_bias contains token ids outside"):
        _run(llm, logit_bias={384: 1.0})
    with pytest.raises(ValueError, match="bad_words need a tokenizer"):
        _run(llm, bad_words=["hello"])


def test_offline_llm_bans_the_same_bad_word_sequences_as_the_gateway() -> None:
    """The offline LLM tokenizes ``bad_words`` with the rule the gateway uses
    (``protos.bad_words``): both spellings of a word, repeats dropped."""
    from engine_svc.default_model import ensure_default_model

    llm = LLM(str(ensure_default_model()), dtype="float32", num_kv_blocks=16, device="cpu")
    words = ["hello", " hello", "world"]
    params = llm._with_bad_word_ids(SamplingParams(bad_words=words, bad_words_token_ids=[[3]]))

    def encode(text: str) -> list[int]:
        return llm.tokenizer.encode(text, add_special_tokens=False)

    want = [[3]] + [list(s) for s in bad_words_token_ids(encode, words)]
    assert params.bad_words is None and params.bad_words_token_ids == want
    assert [encode("hello")] == want[1:2]  # the plain form first
    assert len({tuple(s) for s in want}) == len(want)  # " hello" repeated "hello": dropped
