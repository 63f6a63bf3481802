"""Tensor parallelism with each CPU attention backend: the torch reference kernels (the engine's
default is the C kernels, ``test_tp_engine``) over 2 ranks give transformers' greedy tokens,
through chunked prefill and preemption. Its own module: one process joins one group at a time."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from engine_svc.core.sampling_params import SamplingParams
from engine_svc.engine_core import EngineCore
from engine_svc.executor import MultiprocExecutor
from tests.parity.hf_reference import hf_greedy, load_hf
from tests.parity.test_tp_engine import MAX_NEW, _config, _prompts, _run


def test_the_torch_backend_over_two_ranks_matches_transformers(
    tiny_models: dict[str, Path],
) -> None:
    engine = EngineCore(replace(_config(tiny_models["qwen3"], tp=2), attention_backend="torch"))
    try:
        assert isinstance(engine.runner, MultiprocExecutor)
        assert engine.runner.rank0.kernels.attention.name == "torch", engine.runner.rank0.kernels
        prompts = _prompts([30, 33, 40, 17, 50, 25], seed=4)
        greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
        got, totals, _ = _run(engine, prompts, greedy)
    finally:
        engine.runner.shutdown()
    assert totals["preemptions"] > 0
    hf = load_hf(tiny_models["qwen3"])
    assert got == [hf_greedy(hf, p, MAX_NEW, stop_at_eos=False) for p in prompts]
