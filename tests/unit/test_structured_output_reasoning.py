"""Structured outputs after the reasoning: with a reasoning end (the ids of ``</think>``) the
constraint waits for that sequence in the output; the tokens before it and the sequence itself
are sampled freely, the matcher never sees them, and the grammar applies from the next token."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from engine_svc.config import SchedulerConfig
from engine_svc.core.request import RequestStatus
from engine_svc.core.sampling_params import SamplingParams, StructuredOutputParams
from engine_svc.structured_output import RequestGrammar, StructuredOutputManager
from engine_svc.structured_output.bitmask import GrammarBitmask
from tests.unit.grammar_helpers import EOS, VOCAB, ready

pytest.importorskip("xgrammar")

# Small enough for greedy output of the random model to close it within max_tokens.
ANSWER = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}},
    "required": ["ok"],
    "additionalProperties": False,
}


def _digits(manager: StructuredOutputManager, end: tuple[int, ...]) -> RequestGrammar:
    return ready(manager.grammar_for(StructuredOutputParams(regex="[0-9]+", **_end(end))))


def _end(end: tuple[int, ...]) -> dict[str, Any]:
    return {"reasoning_end_token_ids": end}


def test_params_take_the_reasoning_end_apart_from_the_cache_key() -> None:
    plain = StructuredOutputParams(regex="a+")
    gated = StructuredOutputParams(regex="a+", reasoning_end_token_ids=[7, 8])
    assert gated.reasoning_end_token_ids == (7, 8)
    assert plain.key == gated.key  # one compiled grammar serves both
    with pytest.raises(ValueError, match="reasoning_end_token_ids"):
        StructuredOutputParams(regex="a+", reasoning_end_token_ids=(-1,))
    params = SamplingParams(structured_output=StructuredOutputParams(regex="a", **_end((600,))))
    with pytest.raises(ValueError, match="reasoning_end_token_ids contains token ids outside"):
        params.check_vocab(VOCAB)


def test_tokens_before_the_end_are_free_and_not_fed_to_the_matcher(
    manager: StructuredOutputManager, tokenizer_dir: Path
) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    letter, digit = tok.token_to_id("a"), tok.token_to_id("7")
    end = (tok.token_to_id("x"), tok.token_to_id("y"))
    grammar = _digits(manager, end)
    assert not grammar.constraining
    # A letter, a lone half of the end, EOS: all free while reasoning, and no text ends.
    for t in (letter, end[0], letter, end[1], EOS):
        assert grammar.accept(t)
    assert not grammar.is_terminated and not grammar.constraining
    bitmask = torch.zeros(2, (VOCAB + 31) // 32, dtype=torch.int32)
    grammar.fill_bitmask(bitmask, 1)
    assert bool((bitmask[1] == -1).all())  # every token allowed
    assert grammar.accept(end[0]) and grammar.accept(end[1])  # the end, whole: from now on
    assert grammar.constraining
    assert not grammar.accept(letter)  # the grammar's rules now
    assert grammar.accept(digit) and grammar.accept(EOS) and grammar.is_terminated
    assert grammar.num_accepted == 9  # 7 reasoning tokens (end included) + the digit and EOS


def test_bitmask_leaves_rows_still_reasoning_alone(manager: StructuredOutputManager) -> None:
    reasoning = _digits(manager, (11,))
    constrained = _digits(manager, ())
    torch.manual_seed(0)
    logits = torch.randn(2, VOCAB)
    free = logits.clone()
    GrammarBitmask(4, VOCAB, torch.device("cpu")).apply(logits, [0, 1], [reasoning, constrained])
    assert torch.equal(logits[0], free[0])
    assert not bool(logits[1].isfinite().all())  # letters and the rest forbidden
    only = torch.randn(1, VOCAB)
    kept = only.clone()
    GrammarBitmask(4, VOCAB, torch.device("cpu")).apply(only, [0], [reasoning])
    assert torch.equal(only, kept)


# ---------------------------------------------------------------------------- the whole engine


@pytest.fixture(scope="module")
def engine_core(cache_dir: Path) -> Any:
    from engine_svc.config import CacheConfig, EngineConfig, ModelConfig
    from engine_svc.default_model import default_model_dir
    from engine_svc.engine_core import EngineCore

    config = EngineConfig(
        model=ModelConfig(str(default_model_dir()), dtype="float32"),
        cache=CacheConfig(block_size=4, num_kv_blocks=64),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64),
        device="cpu",
    )
    return EngineCore(config)


def _run(core: Any) -> None:
    for _ in range(2000):
        if not core.has_unfinished_requests():
            return
        assert core.step().errors == []
    raise AssertionError("the engine did not finish")


def _decode(ids: list[int]) -> str:
    from tokenizers import Tokenizer

    from engine_svc.default_model import default_model_dir

    path = default_model_dir() / "tokenizer.json"
    return Tokenizer.from_file(str(path)).decode(ids, skip_special_tokens=False)


def test_engine_constrains_only_after_the_reasoning_end(engine_core: Any) -> None:
    """The model's own greedy first tokens play the reasoning and its end: with the
    constraint waiting for them they come out as without it, then the JSON follows."""
    import jsonschema

    prompt = [10, 20, 30]
    free = engine_core.add_request("free", prompt, SamplingParams(max_tokens=3, temperature=0))
    _run(engine_core)
    a, b, _ = free.output_token_ids
    gated = StructuredOutputParams(json_schema=ANSWER, reasoning_end_token_ids=(a, b))
    request = engine_core.add_request(
        "gated", prompt, SamplingParams(max_tokens=200, temperature=0, structured_output=gated)
    )
    _run(engine_core)
    out = request.output_token_ids
    assert out[:2] == [a, b]  # unconstrained: the free greedy tokens
    assert request.status is RequestStatus.FINISHED_STOPPED and out[-1] == EOS
    jsonschema.validate(json.loads(_decode(out[2:-1])), ANSWER)
    assert request.grammar is not None and request.grammar.num_accepted == len(out)

    # The same constraint without the reasoning end: JSON from the first token.
    whole = StructuredOutputParams(json_schema=ANSWER)
    plain = engine_core.add_request(
        "plain", prompt, SamplingParams(max_tokens=200, temperature=0, structured_output=whole)
    )
    _run(engine_core)
    jsonschema.validate(json.loads(_decode(plain.output_token_ids[:-1])), ANSWER)
    assert plain.output_token_ids[:2] != [a, b]


def test_engine_output_without_the_reasoning_end_is_never_constrained(engine_core: Any) -> None:
    prompt = [40, 50, 60]
    free = engine_core.add_request("free2", prompt, SamplingParams(max_tokens=6, temperature=0))
    _run(engine_core)
    never = StructuredOutputParams(choice=["red"], reasoning_end_token_ids=(511, 511))
    request = engine_core.add_request(
        "never", prompt, SamplingParams(max_tokens=6, temperature=0, structured_output=never)
    )
    _run(engine_core)
    assert request.output_token_ids == free.output_token_ids


def test_the_engine_edge_keeps_the_reasoning_end() -> None:
    from engine_svc.rpc.convert import structured_output
    from protos.types import StructuredOutput

    for sent in (
        StructuredOutput("regex", spec="a+", reasoning_end_token_ids=(5, 6)),
        StructuredOutput("choice", choices=("a",), reasoning_end_token_ids=(5, 6)),
        StructuredOutput("json_object", reasoning_end_token_ids=(5, 6)),
    ):
        params = structured_output(sent)
        assert params is not None and params.reasoning_end_token_ids == (5, 6)
        assert params.kind == sent.kind
