"""Tensor parallelism on the CPU: the model sharded over 2 ranks (gloo, spawned processes)
generates greedily what the unsharded model and transformers generate, token for token, and its
logits are the unsharded model's (to float32 summation order).

The shapes cover every sharding rule: a vocabulary not divisible by the ranks (padded, untied
head and tied), attention and MLP biases (random: added once, by rank 0), fewer KV heads than
ranks
(replicated), Qwen3's q/k norms. The two ranks run all cases in one spawn (module fixture), so
the processes start once.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from tests.conftest import build_tiny_checkpoint
from tests.parity.hf_reference import hf_greedy, load_hf
from tests.parity.tp_ranks import greedy, load, run_rank

CASES: dict[str, tuple[str, dict[str, object]]] = {
    "llama_odd_vocab_biases": (
        "LlamaForCausalLM",
        dict(vocab_size=383, attention_bias=True, mlp_bias=True),
    ),
    "qwen2_one_kv_head": ("Qwen2ForCausalLM", dict(hidden_size=96, num_key_value_heads=1)),
    "qwen3_tied_odd_vocab": ("Qwen3ForCausalLM", dict(vocab_size=385, tie_word_embeddings=True)),
}
RANKS = 2
MAX_NEW = 8
_rng = random.Random(0)
PROMPTS = [[_rng.randrange(4, 380) for _ in range(n)] for n in (2, 17, 40)]

Result = tuple[list[list[int]], torch.Tensor]


def _random_biases(model_dir: Path) -> Path:
    """transformers initialises biases to zero, which would hide a bias added on every rank:
    give them random values."""
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    gen = torch.Generator().manual_seed(7)
    for name, t in tensors.items():
        if name.endswith(".bias"):
            tensors[name] = torch.randn(t.shape, generator=gen, dtype=t.dtype) * 0.5
    save_file(tensors, path, metadata={"format": "pt"})
    return model_dir


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp_models")
    return {
        n: _random_biases(build_tiny_checkpoint(root / n, arch, **kw))
        for n, (arch, kw) in CASES.items()
    }


@pytest.fixture(scope="module")
def sharded(
    checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Result]:
    """Every case's greedy tokens and prefill logits from rank 0 of a 2-rank group."""
    work = tmp_path_factory.mktemp("tp_run")
    for model_dir in checkpoints.values():
        load(model_dir)  # builds the CPU kernels once, here, for the ranks to find in the cache
    cases = [
        {"model": str(d), "prompts": PROMPTS, "max_new": MAX_NEW} for d in checkpoints.values()
    ]
    out = work / "rank0.pt"
    # join: raises if a rank fails, after terminating the other (no orphan, no hang)
    mp.spawn(run_rank, args=(RANKS, f"file://{work}/store", cases, str(out)), nprocs=RANKS)
    results: list[Result] = torch.load(out)
    return dict(zip(checkpoints, results, strict=True))


@pytest.mark.parametrize("name", list(CASES))
def test_two_ranks_generate_what_one_rank_and_transformers_do(
    name: str, checkpoints: dict[str, Path], sharded: dict[str, Result]
) -> None:
    model_dir = checkpoints[name]
    model = load(model_dir)
    tokens, logits = greedy(model, PROMPTS, MAX_NEW)
    hf = load_hf(model_dir)
    assert tokens == [hf_greedy(hf, p, MAX_NEW, stop_at_eos=False) for p in PROMPTS]
    tp_tokens, tp_logits = sharded[name]
    assert tp_tokens == tokens
    assert tp_logits.shape == (len(PROMPTS), model.spec.vocab_size)  # padding columns dropped
    torch.testing.assert_close(tp_logits, logits, atol=1e-5, rtol=1e-5)
