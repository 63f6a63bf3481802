"""Pooling models under tensor parallelism (2 ranks, gloo, on the CPU): embedding and
classification requests through the multi-process executor give the one-rank engine's vectors
and label scores, through chunked prefill and beside generation rows in the same steps.

Every rank's hidden states are whole (the row-parallel layers all-reduce) and the classifier
head is replicated: rank 0 pools, and its results are the step's. One process joins one
torch.distributed group at a time: one engine per module and model, the previous one shut down
before the next starts.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from engine_svc.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine_svc.core.outputs import EngineCoreOutput
from engine_svc.core.pooling_params import PoolingParams
from engine_svc.core.sampling_params import SamplingParams
from engine_svc.engine_core import EngineCore
from engine_svc.executor import MultiprocExecutor
from protos.types import PoolingTask
from tests.parity.pooling_reference import TOL
from tests.parity.pooling_reference import random_prompts as _prompts

RANKS = 2
LENGTHS = [1, 2, 15, 40, 75]  # a 32-token budget splits the longer prompts over several steps
# case -> (tiny_pooling_models key, the model's pooling type override)
CASES: dict[str, tuple[str, str | None]] = {
    "embed_last": ("embed", None),
    "embed_mean": ("embed", "MEAN"),  # sums kept across the chunks' steps
    "embed_base": ("embed_base", "CLS"),  # Qwen2Model: no LM head, hidden size 96
    "classify": ("classify_llama", None),
}


def _config(model_dir: Path, pooling_type: str | None, tp: int) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(str(model_dir), dtype="float32", pooling_type=pooling_type),
        cache=CacheConfig(num_kv_blocks=64),
        scheduler=SchedulerConfig(max_num_batched_tokens=32),
        tensor_parallel_size=tp,
    )


@pytest.fixture(scope="module", params=list(CASES))
def engines(
    request: pytest.FixtureRequest, tiny_pooling_models: dict[str, Path]
) -> Iterator[tuple[str, EngineCore, EngineCore]]:
    """(case, the engine at 2 ranks, the engine at one)."""
    name, pooling_type = CASES[request.param]
    model_dir = tiny_pooling_models[name]
    threads = torch.get_num_threads()  # the executor gives each rank its share of the CPUs
    tp = EngineCore(_config(model_dir, pooling_type, RANKS))
    assert isinstance(tp.runner, MultiprocExecutor)
    try:
        yield request.param, tp, EngineCore(_config(model_dir, pooling_type, 1))
    finally:
        tp.runner.shutdown()
        torch.set_num_threads(threads)
    assert not any(p.is_alive() for p in tp.runner._procs)


def _finals(engine: EngineCore) -> dict[str, list[EngineCoreOutput]]:
    outs: dict[str, list[EngineCoreOutput]] = {}
    for step in engine.run_until_idle(60):
        assert not step.errors, step.errors
        for o in step.outputs:
            outs.setdefault(o.request_id, []).append(o)
    return outs


Results = tuple[dict[str, np.ndarray], dict[str, list[int]]]
Requests = list[tuple[str, list[int], PoolingParams | None]]  # (id, prompt, None: generate)


def _run(engine: EngineCore, requests: Requests) -> Results:
    """Each pooling request's result, and each generation request's greedy tokens."""
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    for rid, prompt, pooling in requests:
        engine.add_request(rid, prompt, greedy, pooling_params=pooling)
    pooled: dict[str, np.ndarray] = {}
    tokens: dict[str, list[int]] = {}
    for rid, outs in _finals(engine).items():
        if outs[-1].pooled is not None:
            pooled[rid] = outs[-1].pooled
        else:
            tokens[rid] = [t for o in outs for t in o.new_token_ids]
    assert len(pooled) + len(tokens) == len(requests)
    return pooled, tokens


def test_pooling_requests_equal_the_one_rank_engine(
    engines: tuple[str, EngineCore, EngineCore],
) -> None:
    case, tp, one = engines
    prompts = _prompts(LENGTHS, seed=3)
    if case == "classify":  # label scores: softmax, and the logits
        task = PoolingTask.CLASSIFY
        params = [PoolingParams(task), PoolingParams(task, activation=False)]
    else:  # vectors: L2-normalized, and not
        task = PoolingTask.EMBED
        params = [PoolingParams(task), PoolingParams(task, normalize=False)]
    requests: Requests = [
        (f"p{i}-{j}", p, pp) for i, p in enumerate(prompts) for j, pp in enumerate(params)
    ]
    if case in ("embed_last", "embed_mean"):  # with an LM head: generation rows join the steps
        requests += [(f"g{i}", p, None) for i, p in enumerate(_prompts([9, 30], seed=4))]
    got_pooled, got_tokens = _run(tp, requests)
    want_pooled, want_tokens = _run(one, requests)
    assert got_tokens == want_tokens
    assert got_pooled.keys() == want_pooled.keys()
    for rid, want in want_pooled.items():
        np.testing.assert_allclose(got_pooled[rid], want, **TOL, err_msg=rid)
    if case == "classify":
        assert want_pooled["p0-0"].shape == (3,)  # one score per label
    else:
        assert want_pooled["p0-0"].shape == (96 if case == "embed_base" else 64,)
    assert tp.kv.num_free_blocks == one.kv.num_free_blocks == 64
