"""Tensor parallelism on CUDA (issue 33), through the offline ``LLM`` as a user runs it.

One GPU: one rank through the multi-process executor (``distributed_executor_backend="mp"``,
an NCCL group of one, CUDA graphs captured) gives the in-process engine's greedy tokens, bit for
bit in float32 and in bfloat16 (the same kernels, the same graphs). Two or more GPUs: two ranks
over NCCL, each capturing its CUDA graphs with the all-reduces inside and replaying the same
bucket, give one rank's greedy tokens in float32 (a sum in two halves can round differently from
one sum, so a near tie may part: at least 90 % of the tokens in common prefixes).

One process joins one group at a time: every test shuts its executor down before it ends."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
pytest.importorskip("cupy", reason="the CUDA kernels load through CuPy")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from engine_svc import LLM, SamplingParams  # noqa: E402
from engine_svc.executor import MultiprocExecutor  # noqa: E402
from engine_svc.worker.model_runner import ModelRunner  # noqa: E402
from tests.conftest import build_tiny_checkpoint  # noqa: E402

MAX_NEW = 24


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tp_gpu_models")
    return build_tiny_checkpoint(
        root / "qwen3", "Qwen3ForCausalLM", hidden_size=128, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
    )  # fmt: skip


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 384) for _ in range(rng.randint(1, 300))] for _ in range(n)]


def _greedy(model: Path, dtype: str, prompts: list[list[int]], **kw: object) -> list[list[int]]:
    llm = LLM(model, dtype=dtype, device="cuda", num_kv_blocks=1024, max_num_seqs=32, **kw)
    try:
        runner = llm.engine.runner
        rank0 = runner.rank0 if isinstance(runner, MultiprocExecutor) else runner
        assert isinstance(rank0, ModelRunner)
        assert rank0.graphs is not None  # captured (with the group's collectives inside)
        params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        _close(llm)


def _close(llm: LLM) -> None:
    shutdown = getattr(llm.engine.runner, "shutdown", None)
    if shutdown is not None:
        shutdown()


@pytest.fixture
def one_group() -> Iterator[None]:
    yield
    assert not torch.distributed.is_initialized()  # every executor left its group


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_one_rank_through_the_executor_equals_the_in_process_engine(
    model: Path, dtype: str, one_group: None
) -> None:
    prompts = _prompts(24, seed=1)
    want = _greedy(model, dtype, prompts)
    got = _greedy(model, dtype, prompts, distributed_executor_backend="mp")
    assert got == want


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_ranks_over_nccl_give_one_ranks_tokens(model: Path, one_group: None) -> None:
    prompts = _prompts(24, seed=2)
    want = _greedy(model, "float32", prompts)
    got = _greedy(model, "float32", prompts, tensor_parallel_size=2)
    common = sum(
        next((i for i, (a, b) in enumerate(zip(g, w, strict=True)) if a != b), len(w))
        for g, w in zip(got, want, strict=True)
    )
    assert common >= 0.9 * MAX_NEW * len(prompts), (got, want)
