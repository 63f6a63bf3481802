"""Structured outputs over 2 tensor-parallel ranks (CPU, gloo): rank 0 masks and samples, the
worker's mirror of each request has no grammar and is fed rank 0's tokens, so a constrained
batch gives the one-rank engine's tokens. Its own module: one process joins one group at a
time, and ``test_tp_engine``'s engine runs on a model without a tokenizer."""

from __future__ import annotations

import json
import re
from pathlib import Path

from engine_svc.core.sampling_params import SamplingParams, StructuredOutputParams
from engine_svc.default_model import ensure_default_model
from engine_svc.engine_core import EngineCore
from tests.parity.test_tp_engine import _config, _prompts


def test_structured_outputs_equal_the_one_rank_engine() -> None:
    """Sampled (seeded) and greedy rows under a regex and a JSON schema, beside an unconstrained
    row, give the one-rank engine's tokens, which the grammars accept."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    regex = StructuredOutputParams(regex="[ab]{3,8}")
    json_schema = StructuredOutputParams(json_schema=schema)
    cases = [
        SamplingParams(max_tokens=16, temperature=0.0, structured_output=regex),
        SamplingParams(max_tokens=24, temperature=1.0, seed=7, structured_output=json_schema),
        SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),  # unconstrained, same batch
    ]
    prompts = _prompts([9, 14, 11], seed=12)  # ids < 384: inside the default model's vocabulary
    model = ensure_default_model()  # a grammar needs the model's tokenizer
    want = _generate(EngineCore(_config(model, tp=1)), prompts, cases)
    tp_engine = EngineCore(_config(model, tp=2))
    try:
        got = _generate(tp_engine, prompts, cases)
        assert tp_engine.kv.num_free_blocks == 12
    finally:
        tp_engine.runner.shutdown()
    assert got == want
    text = [_decode(model, t) for t in want]
    assert re.fullmatch("[ab]{3,8}", text[0]), text
    assert isinstance(json.loads(text[1])["a"], int), text
    assert len(want[2]) == 8


def _generate(
    engine: EngineCore, prompts: list[list[int]], cases: list[SamplingParams]
) -> list[list[int]]:
    """All requests in one batch; each one's tokens without a final EOS."""
    ids = [f"s{i}" for i in range(len(prompts))]
    for rid, p, c in zip(ids, prompts, cases, strict=True):
        engine.add_request(rid, p, c)
    got: dict[str, list[int]] = {rid: [] for rid in ids}
    while engine.has_unfinished_requests():
        for o in engine.step().outputs:
            got[o.request_id].extend(o.new_token_ids)
    return [got[r] for r in ids]


def _decode(model: Path, ids: list[int]) -> str:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(model / "tokenizer.json")).decode(ids)
