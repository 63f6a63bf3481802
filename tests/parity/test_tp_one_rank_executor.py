"""One rank through the multi-process executor (``distributed_executor_backend="mp"``, vLLM's
flag) is the in-process engine: its group of one runs the same model (the collectives return
their input), so greedy tokens and logprobs are equal, and the executor starts no worker. Its
own module: one process joins one group at a time."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine_svc.config import EngineConfig
from engine_svc.core.sampling_params import SamplingParams
from engine_svc.engine_core import EngineCore
from engine_svc.executor import MultiprocExecutor
from engine_svc.worker.model_runner import ModelRunner
from tests.parity.test_tp_engine import _config, _prompts, _run


def test_one_rank_through_the_executor_equals_the_in_process_engine(
    tiny_models: dict[str, Path],
) -> None:
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    prompts = _prompts([30, 33, 40, 17, 50, 25], seed=3)  # chunked prefill and preemption
    plain = EngineCore(_config(tiny_models["llama"], tp=1))
    assert isinstance(plain.runner, ModelRunner)
    want_tokens, want_totals, want = _run(plain, prompts, params)
    config = _config(tiny_models["llama"], tp=1)
    config = EngineConfig(**{**config.__dict__, "distributed_executor_backend": "mp"})
    engine = EngineCore(config)
    try:
        assert isinstance(engine.runner, MultiprocExecutor)
        assert engine.runner.worker_pids == [] and engine.runner.tp.size == 1
        got_tokens, got_totals, got = _run(engine, prompts, params)
    finally:
        engine.runner.shutdown()
    assert want_totals["preemptions"] > 0
    assert (got_tokens, got_totals) == (want_tokens, want_totals)
    for g, w in zip(got, want, strict=True):
        assert [(e.token_id, list(e.top)) for e in g] == [(e.token_id, list(e.top)) for e in w]
        assert [e.logprob for e in g] == pytest.approx([e.logprob for e in w], abs=1e-6)
