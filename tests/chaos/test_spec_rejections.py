"""Thousands of rejected proposals leak nothing (issue 34): a proposer that proposes k wrong
tokens for every request at every step, over a KV pool small enough that the proposals' slots
cross block boundaries and requests are preempted mid-run, with some aborted mid-speculation.
The greedy output is the output without speculation, every rejected proposal's slot is given
back (the pool ends where it started), and the counters show the rejections happened."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np

from engine_svc.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine_svc.core.sampling_params import SamplingParams
from engine_svc.engine_core import EngineCore
from engine_svc.spec_decode.ngram import NgramConfig

K = 4
BLOCKS = 14
VOCAB = 384


def _engine(model_dir: Path, spec: NgramConfig | None) -> EngineCore:
    return EngineCore(
        EngineConfig(
            model=ModelConfig(str(model_dir), dtype="float32"),
            cache=CacheConfig(num_kv_blocks=BLOCKS),
            scheduler=SchedulerConfig(max_num_batched_tokens=48),
            speculative=spec,
        )
    )


class WrongProposer:
    """k proposals per request per step, each a token the greedy model did not pick last time
    (the last token + 1 ...): nearly all rejected."""

    def __init__(self, k: int) -> None:
        self.k = k

    def propose(
        self, tokens: np.ndarray, rows: np.ndarray, lens: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        last = tokens[rows, lens - 1].astype(np.int64)
        proposals = (last[:, None] + np.arange(1, self.k + 1)[None, :]) % VOCAB
        return proposals.astype(np.int32), np.full(len(rows), self.k, np.int32)


def _run(engine: EngineCore, prompts: list[list[int]], abort_at: int | None) -> tuple:
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    totals = {"proposed": 0, "accepted": 0, "preemptions": 0}
    steps = 0
    while engine.has_unfinished_requests():
        out = engine.step()
        steps += 1
        if steps == abort_at:  # two requests in the middle of their speculation
            engine.abort_requests(["r1", "r4"])
        for o in out.outputs:
            tokens[o.request_id].extend(o.new_token_ids)
        totals["proposed"] += out.stats.spec_num_draft_tokens
        totals["accepted"] += out.stats.spec_num_accepted_tokens
        totals["preemptions"] += out.stats.num_preemptions
    return tokens, totals


def test_thousands_of_rejections_leak_no_block(tiny_models: dict[str, Path]) -> None:
    rng = random.Random(3)
    prompts = [[rng.randrange(4, VOCAB) for _ in range(rng.randint(5, 30))] for _ in range(10)]
    plain = _engine(tiny_models["llama"], None)
    want, _ = _run(plain, prompts, abort_at=None)
    spec = _engine(tiny_models["llama"], NgramConfig(K))
    spec.proposer = WrongProposer(K)  # type: ignore[assignment]
    got, totals = _run(spec, prompts, abort_at=None)
    assert got == want
    assert totals["proposed"] - totals["accepted"] >= 2000, totals
    assert totals["preemptions"] > 0, totals
    assert spec.kv.num_free_blocks == BLOCKS
    # and again, with two requests aborted while their proposals are in flight
    got, totals = _run(spec, prompts, abort_at=12)
    assert got["r1"] == want["r1"][: len(got["r1"])] and len(got["r1"]) < 60
    assert all(got[r] == want[r] for r in want if r not in ("r1", "r4"))
    assert spec.kv.num_free_blocks == BLOCKS
