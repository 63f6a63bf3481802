"""Speculative decoding: the sampling metadata of a verification step's k + 1 positions, and a
grammar's masks over its proposals (issue 34).

Position j of a request must be sampled exactly as decoding without speculation would sample
the token after the request's output followed by its first j proposals: the metadata built for
the expanded rows (``sampling_metadata(..., num_draft)``) is checked here against the metadata of
a batch that really holds those tokens, for penalties, min_tokens, bad words, logit bias and
allowed token ids, greedy and sampled. ``RequestGrammar.fill_bitmask_ahead`` fills the masks a
step-by-step matcher would, stops at the first refused proposal and leaves the matcher as it
found it (reasoning gate included)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from engine_svc.core.request import Request
from engine_svc.core.sampling_params import SamplingParams, StructuredOutputParams
from engine_svc.worker.input_batch import InputBatch
from engine_svc.worker.sampler import greedy_tokens, target_probs
from engine_svc.worker.sampling_inputs import sampling_metadata

V = 64
EOS_ID = 2
# (parameters, prompt, output so far, proposals): tokens repeat across them on purpose.
CASES: list[tuple[dict[str, Any], list[int], list[int], list[int]]] = [
    (
        dict(frequency_penalty=0.5, presence_penalty=0.3, repetition_penalty=1.4),
        [5, 8],
        [5, 6],
        [7, 7, 5, 9],  # 7 twice (+2 at one entry), 9 seen nowhere before (repetition)
    ),
    (dict(min_tokens=5, stop_token_ids=[11]), [1, 2], [3, 4], [12, 11, 13, 11]),
    (dict(bad_words_token_ids=[[20, 21, 22], [23], [30, 20]]), [20, 21], [20], [21, 30, 20, 21]),
    (
        dict(logit_bias={40: 4.0, 41: -2.0}, allowed_token_ids=[40, 41, 42, 43, 7]),
        [9],
        [],
        [40, 41],
    ),
    (dict(frequency_penalty=1.0, bad_words_token_ids=[[33, 34]]), [33], [34, 33], [34]),
    (dict(), [3, 3], [4], [4, 3, 4]),
]


def _request(
    rid: str, params: dict[str, Any], prompt: list[int], output: list[int], temperature: float
) -> Request:
    sp = SamplingParams(temperature=temperature, ignore_eos=False, **params)
    req = Request(rid, prompt, sp, eos_token_ids=(EOS_ID,))
    for t in output:
        req.append_output_token(t)
    return req


def _processed(logits: torch.Tensor, batch: InputBatch, reqs: list[Request], **kw: Any) -> Any:
    rows = np.array([batch.row_of[r.request_id] for r in reqs], dtype=np.int64)
    md = sampling_metadata(batch, rows, reqs, {}, V, **kw)
    if md.all_greedy:
        return greedy_tokens(logits, md)
    return target_probs(logits, md)


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
def test_each_position_is_sampled_as_after_the_proposals_before_it(temperature: float) -> None:
    batch = InputBatch(8, 64, 4, V, torch.device("cpu"))
    reqs = []
    for i, (params, prompt, output, drafts) in enumerate(CASES):
        req = _request(f"r{i}", params, prompt, output, temperature)
        row = batch.add(req, [0])
        n = int(batch.num_tokens[row])
        batch.token_ids[row, n : n + len(drafts)] = drafts  # as the runner writes them
        reqs.append(req)
    num = np.array([len(c[3]) for c in CASES], dtype=np.int64)
    k1 = int(num.max()) + 1
    logits = torch.randn(len(CASES) * k1, V, generator=torch.Generator().manual_seed(3)) * 3
    for t in (7, 9, 22, 40):  # make the tokens the features touch the likely ones
        logits[:, t] += 4.0
    logits[:, 11] += 8.0  # the stop id: the argmax wherever min_tokens lets it be
    got = _processed(logits, batch, reqs, num_draft=num, positions=k1)

    for i, (params, prompt, output, drafts) in enumerate(CASES):
        for j in range(len(drafts) + 1):
            ref_batch = InputBatch(1, 64, 4, V, torch.device("cpu"))
            ref = _request("ref", params, prompt, output + drafts[:j], temperature)
            ref_batch.add(ref, [0])
            row = i * k1 + j
            want = _processed(logits[row : row + 1], ref_batch, [ref])[0]
            if temperature == 0.0:
                assert int(got[row]) == int(want), (i, j)
            else:
                assert torch.equal(got[row] > 0, want > 0), (i, j)  # the same tokens allowed
                torch.testing.assert_close(got[row], want, rtol=0, atol=1e-6)


def test_proposals_change_the_later_positions() -> None:
    """The cases above are not vacuous: with the proposals ignored, positions differ."""
    batch = InputBatch(8, 64, 4, V, torch.device("cpu"))
    params, prompt, output, drafts = CASES[0]
    req = _request("a", params, prompt, output, 0.8)
    batch.add(req, [0])
    n = int(batch.num_tokens[0])
    batch.token_ids[0, n : n + len(drafts)] = drafts
    logits = torch.randn(1, V).repeat(len(drafts) + 1, 1)
    probs = _processed(logits, batch, [req], num_draft=np.array([len(drafts)]))
    assert probs[2, 7] < probs[1, 7] < probs[0, 7]  # 7 counted once, then twice


# ---------------------------------------------------------------------------- grammars


def test_grammar_masks_ahead_then_leaves_the_matcher_as_it_was(manager: Any) -> None:
    from tokenizers import Tokenizer

    from tests.unit.grammar_helpers import EOS, VOCAB, ready

    tok = Tokenizer.from_file(str(manager.tokenizer_dir / "tokenizer.json"))
    d = [tok.token_to_id(c) for c in "1234"]
    letter = tok.token_to_id("a")
    words = (VOCAB + 31) // 32

    def step_by_step(tokens: list[int], rows: int) -> torch.Tensor:
        g = ready(manager.grammar_for(StructuredOutputParams(regex="[0-9]{1,4}")))
        want = torch.zeros(rows, words, dtype=torch.int32)
        for j in range(rows):
            g.fill_bitmask(want, j)
            if j < len(tokens):
                assert g.accept(tokens[j])
        return want

    grammar = ready(manager.grammar_for(StructuredOutputParams(regex="[0-9]{1,4}")))
    assert grammar.accept(d[0])
    before = torch.zeros(1, words, dtype=torch.int32)
    grammar.fill_bitmask(before, 0)

    # All allowed: one row per proposal and the bonus position.
    mask = torch.zeros(6, words, dtype=torch.int32)
    assert grammar.fill_bitmask_ahead(mask, 1, [d[1], d[2]]) == 2
    assert torch.equal(mask[1:4], step_by_step([d[0], d[1], d[2]], 4)[1:])
    # A refused proposal: the rows stop at it (it is masked out there).
    mask.zero_()
    assert grammar.fill_bitmask_ahead(mask, 0, [d[1], letter, d[2]]) == 1
    assert torch.equal(mask[:2], step_by_step([d[0], d[1]], 3)[1:3])
    assert not bool(mask[1, letter // 32] >> (letter % 32) & 1)
    assert bool((mask[2:] == 0).all())  # never reached: not filled
    # Four digits, then EOS ends the text: nothing is constrained after it.
    mask.zero_()
    assert grammar.fill_bitmask_ahead(mask, 0, [d[1], d[2], d[3], EOS, d[1]]) == 4
    assert bool((mask[4] == -1).all())

    # The matcher is where it was: it accepts what it accepted before, and nothing more.
    after = torch.zeros(1, words, dtype=torch.int32)
    grammar.fill_bitmask(after, 0)
    assert torch.equal(after, before) and grammar.num_accepted == 1
    assert grammar.accept(d[1]) and grammar.accept(d[2]) and grammar.accept(d[3])
    assert not grammar.accept(d[0])  # a fifth digit: the lookahead left no extra state


def test_grammar_masks_ahead_through_the_reasoning_end(manager: Any) -> None:
    from tokenizers import Tokenizer

    from tests.unit.grammar_helpers import VOCAB, ready

    tok = Tokenizer.from_file(str(manager.tokenizer_dir / "tokenizer.json"))
    letter, digit = tok.token_to_id("a"), tok.token_to_id("7")
    end = (tok.token_to_id("x"), tok.token_to_id("y"))
    params = StructuredOutputParams(regex="[0-9]+", reasoning_end_token_ids=end)
    grammar = ready(manager.grammar_for(params))
    words = (VOCAB + 31) // 32
    mask = torch.zeros(6, words, dtype=torch.int32)
    # Reasoning, its end, a digit (constrained now), then a letter the grammar refuses.
    assert grammar.fill_bitmask_ahead(mask, 0, [letter, end[0], end[1], digit, letter]) == 4
    assert bool((mask[:3] == -1).all())  # free while reasoning, the end included
    assert not bool((mask[3] == -1).all()) and not bool((mask[4] == -1).all())
    assert not grammar.constraining and grammar.num_accepted == 0  # as it was
    assert grammar.accept(end[0]) and not grammar.constraining  # the watch starts over
    assert grammar.accept(end[1]) and grammar.constraining and not grammar.accept(letter)
