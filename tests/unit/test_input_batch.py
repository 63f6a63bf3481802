"""The persistent batch keeps every running request's tokens, blocks and parameters in dense
rows through adds, removals (the last row moves into the hole) and sampled tokens; penalty
counts follow the sampled tokens on the device."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from engine_svc.core.request import Request
from engine_svc.core.sampling_params import SamplingParams
from engine_svc.worker.input_batch import InputBatch

VOCAB = 50


def _req(rid: str, n: int, rng: random.Random, **params: object) -> Request:
    tokens = [rng.randrange(VOCAB) for _ in range(n)]
    return Request(rid, tokens, SamplingParams(**params))  # type: ignore[arg-type]


def _check(batch: InputBatch, live: dict[str, tuple[Request, list[int]]]) -> None:
    assert batch.num_rows == len(live)
    assert sorted(batch.row_of) == sorted(live)
    assert sorted(batch.row_of.values()) == list(range(len(live)))  # dense
    for rid, (req, blocks) in live.items():
        row = batch.row_of[rid]
        assert batch.requests[row] is req
        n = batch.num_tokens[row]
        assert batch.token_ids[row, :n].tolist() == req.all_token_ids
        assert batch.block_table[row, : batch.num_blocks[row]].tolist() == blocks
        assert batch.temperature[row] == pytest.approx(req.sampling_params.temperature)
        assert batch.min_tokens[row] == req.sampling_params.min_tokens
        if req.sampling_params.has_penalties:
            assert batch.output_counts is not None and batch.seen_mask is not None
            counts = torch.bincount(torch.tensor(req.output_token_ids, dtype=torch.int64),
                                    minlength=VOCAB)  # fmt: skip
            assert torch.equal(batch.output_counts[row].long(), counts)
            seen = torch.zeros(VOCAB, dtype=torch.bool)
            seen[req.all_token_ids] = True
            assert torch.equal(batch.seen_mask[row], seen)


def test_random_adds_removals_and_samples_keep_rows_consistent() -> None:
    rng = random.Random(0)
    batch = InputBatch(8, 64, 16, VOCAB, torch.device("cpu"))
    live: dict[str, tuple[Request, list[int]]] = {}
    next_id = 0
    for _ in range(400):
        op = rng.random()
        if op < 0.3 and len(live) < 8:
            penalties = rng.random() < 0.5
            params: dict[str, object] = {"temperature": rng.choice([0.0, 0.7])}
            if penalties:
                params["repetition_penalty"] = 1.3
            req = _req(f"r{next_id}", rng.randint(1, 10), rng, **params)
            next_id += 1
            for _ in range(rng.randint(0, 3)):  # a request coming back after a preemption
                req.append_output_token(rng.randrange(VOCAB))
            blocks = [rng.randrange(100) for _ in range(rng.randint(1, 3))]
            batch.add(req, blocks)
            live[req.request_id] = (req, blocks)
        elif op < 0.5 and live:
            rid = rng.choice(sorted(live))
            batch.remove(rid)
            del live[rid]
        elif op < 0.6 and live:
            rid = rng.choice(sorted(live))
            new = [rng.randrange(100)]
            batch.append_blocks(batch.row_of[rid], new)
            live[rid][1].extend(new)
        elif live:
            rids = [r for r in sorted(live) if live[r][0].num_tokens < 60]
            rng.shuffle(rids)
            rids = rids[: rng.randint(1, len(rids))] if rids else []
            tokens = [rng.randrange(VOCAB) for _ in rids]
            if rids:
                rows = [batch.row_of[r] for r in rids]
                batch.append_sampled(rows, tokens, torch.tensor(tokens))
                for r, t in zip(rids, tokens, strict=True):
                    live[r][0].append_output_token(t)
        _check(batch, live)
    assert next_id > 20


def test_adding_twice_or_beyond_capacity_is_refused() -> None:
    rng = random.Random(1)
    batch = InputBatch(1, 16, 4, VOCAB, torch.device("cpu"))
    batch.add(_req("a", 3, rng), [0])
    with pytest.raises(ValueError, match="already"):
        batch.add(batch.requests[0], [1])  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="full"):
        batch.add(_req("b", 3, rng), [1])
    batch.remove("a")
    batch.remove("a")  # unknown ids are ignored
    assert batch.num_rows == 0 and np.all(batch.num_tokens[:0] == 0)
