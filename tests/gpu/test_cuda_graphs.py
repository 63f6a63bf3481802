"""Decode CUDA graphs on a GPU: replay equals the eager forward bit for bit at every captured
size (contexts crossing KV blocks and split-K partitions), greedy tokens are the same with
graphs on and off, a replay allocates nothing, a decode step waits for the GPU exactly once
(reading the sampled ids) and makes few host-side CUDA calls."""

from __future__ import annotations

import random
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.gpu
pytest.importorskip("cupy", reason="the CUDA kernels load through CuPy")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from engine_svc import LLM, SamplingParams  # noqa: E402
from engine_svc.worker import cuda_graphs  # noqa: E402
from tests.conftest import build_tiny_checkpoint  # noqa: E402

MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-d64": ("LlamaForCausalLM", dict(hidden_size=128, num_attention_heads=8,
                                           num_key_value_heads=2, head_dim=64)),
    "qwen3-d128": ("Qwen3ForCausalLM", dict(hidden_size=128, num_attention_heads=4,
                                            num_key_value_heads=2, head_dim=128)),
}  # fmt: skip
# Host-side CUDA calls of one all-greedy decode step with graphs (the target): the
# input copy, the replay, the logits GEMM, argmax, the copy of the ids back.
MAX_CALLS_PER_STEP = 10
_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC",
          "cudaGraphLaunch", "cudaMemcpyAsync", "cudaMemcpy")  # fmt: skip
_SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("graph_models")
    return {
        name: build_tiny_checkpoint(root / name, arch, max_position_embeddings=4096, **kw)
        for name, (arch, kw) in MODELS.items()
    }


def _llm(model_dir: Path, dtype: str = "bfloat16", **kw: Any) -> LLM:
    return LLM(
        model_dir,
        dtype=dtype,
        device="cuda",
        num_kv_blocks=4096,
        max_num_seqs=64,
        max_num_batched_tokens=512,
        **kw,
    )


def _prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab) for _ in range(rng.randint(1, 700))] for _ in range(n)]


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_replay_equals_eager_bit_for_bit_at_every_size(
    models: dict[str, Path], name: str, dtype: str
) -> None:
    llm = _llm(models[name], dtype)
    runner = llm.engine.runner
    graphs = runner.graphs
    assert graphs is not None and graphs.sizes == runner.buckets

    def forward(ids: torch.Tensor, pos: torch.Tensor, meta: Any) -> torch.Tensor:
        return runner.model(ids, pos, runner.kv_caches, meta, None)

    with torch.inference_mode():
        for size in graphs.sizes:
            error = cuda_graphs.check_against_eager(
                graphs,
                forward,
                runner.buffers,
                runner.kv_caches,
                size,
                runner.max_model_len,
                runner.spec.vocab_size,
            )
            assert error == 0.0, (size, error)


@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_tokens_are_the_same_with_graphs_on_and_off(
    models: dict[str, Path], name: str
) -> None:
    prompts = _prompts(40, 384, seed=3)
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    results = []
    replays: Counter[int] = Counter()
    for eager in (True, False):
        llm = _llm(models[name], enforce_eager=eager)
        graphs = llm.engine.runner.graphs
        assert (graphs is None) is eager
        if graphs is not None:
            replay = graphs.replay

            def counted(size: int, _replay: Any = replay) -> torch.Tensor:
                replays[size] += 1
                return _replay(size)

            graphs.replay = counted  # type: ignore[method-assign]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        results.append([o.outputs[0].token_ids for o in outs])
    assert results[0] == results[1]
    assert sum(replays.values()) >= 40 and len(replays) >= 3, replays


def _decoding(llm: LLM, batch: int, logprobs: int | None = None) -> None:
    """``batch`` greedy requests, run until every one is decoding."""
    rng = random.Random(0)
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True, logprobs=logprobs)
    for i in range(batch):
        llm.engine.add_request(f"r{i}", [rng.randrange(4, 384) for _ in range(100)], params)
    while any(r.num_output_tokens == 0 for r in llm.engine.scheduler.requests.values()):
        llm.engine.step()
    llm.engine.step()


def test_a_replay_allocates_nothing(models: dict[str, Path]) -> None:
    llm = _llm(models["qwen3-d128"])
    _decoding(llm, 5)
    graphs = llm.engine.runner.graphs
    assert graphs is not None
    graphs.replay(8)
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()
    for _ in range(10):
        graphs.replay(8)
    torch.cuda.synchronize()
    after = torch.cuda.memory_stats()
    for key in ("allocation.all.allocated", "segment.all.allocated", "num_alloc_retries"):
        assert after.get(key, 0) == before.get(key, 0), key


@pytest.mark.parametrize(("batch", "logprobs"), [(1, None), (13, None), (64, None), (13, 5)])
def test_a_decode_step_syncs_once_and_makes_few_cuda_calls(
    models: dict[str, Path], batch: int, logprobs: int | None
) -> None:
    """Logprobs too: their copies to the host are queued before the ids' sync and share it."""
    llm = _llm(models["qwen3-d128"])
    _decoding(llm, batch, logprobs)
    steps = 8
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(steps):
                out = llm.engine.step()
                assert len(out.outputs) == batch  # decode-only steps, every row sampled
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message).lower()]
    assert len(syncs) == steps, [str(w.message) for w in syncs]

    from torch.profiler import ProfilerActivity, profile

    # The runtime API calls are recorded with CUDA activity (CUPTI's callbacks).
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            llm.engine.step()
    counts = Counter(e.name for e in prof.events())
    calls = sum(counts[n] for n in _CALLS)
    assert counts["cudaGraphLaunch"] == steps, counts
    # The profiler's own exit synchronizes the device once, inside the window.
    assert counts["cudaDeviceSynchronize"] <= 1, counts
    assert sum(counts[n] for n in _SYNCS if n != "cudaDeviceSynchronize") <= steps, counts
    if logprobs is None:  # logprobs add their own kernels (log_softmax, gather, top-k)
        assert calls <= MAX_CALLS_PER_STEP * steps, {n: counts[n] for n in _CALLS}
