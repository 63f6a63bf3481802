"""Sleep mode on CUDA: level 1 moves the weights to pinned host memory and frees the KV cache,
level 2 drops the weights; device memory falls by (about) what they held, and wake_up gives the
same greedy tokens as before. Skipped without a CUDA device."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from engine_svc.core.sampling_params import SamplingParams  # noqa: E402
from engine_svc.entrypoints.llm import LLM  # noqa: E402

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": [5, 17, 29, 41, 53, 65, 77, 89]}, {"prompt_token_ids": [7, 8, 9]}]


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_frees_device_memory_and_wakes_up_the_same(
    tiny_models: dict[str, Path], level: int
) -> None:
    llm = LLM(tiny_models["llama"], dtype="float32", device="cuda", kv_cache_memory="512MiB")
    runner = llm.engine.runner
    tokens = lambda: [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]  # noqa: E731
    before = tokens()
    torch.cuda.synchronize()
    kv_bytes = runner.kv_cache_nbytes()
    weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    awake = torch.cuda.memory_allocated()
    llm.sleep(level)
    asleep = torch.cuda.memory_allocated()
    assert awake - asleep >= kv_bytes + weight_bytes
    assert all(p.device.type == "cuda" and p.numel() == 0 for p in runner.model.parameters())
    llm.wake_up()
    assert torch.cuda.memory_allocated() - asleep >= kv_bytes + weight_bytes
    assert tokens() == before
