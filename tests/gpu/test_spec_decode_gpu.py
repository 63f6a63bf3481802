"""Speculative decoding on CUDA (issue 34), through the offline ``LLM``.

Verification steps of decodes and verifications only are attended one row per token and replay
the decode CUDA graphs (``step_inputs``): in float32 the greedy tokens with n-gram speculation
and with a draft model equal the tokens without speculation (graphs on in both), and the graphs
were replayed for verification steps."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
pytest.importorskip("cupy", reason="the CUDA kernels load through CuPy")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from engine_svc import LLM, SamplingParams  # noqa: E402
from engine_svc.worker import model_runner  # noqa: E402
from engine_svc.worker.step_inputs import StepInputs  # noqa: E402
from tests.conftest import build_tiny_checkpoint  # noqa: E402
from tests.parity.draft_checkpoint import layer_prefix_draft  # noqa: E402

MAX_NEW = 32


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("spec_gpu_models")
    target = build_tiny_checkpoint(
        root / "target", "Qwen3ForCausalLM", hidden_size=128, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, num_hidden_layers=4, max_position_embeddings=4096,
    )  # fmt: skip
    return target, layer_prefix_draft(target, root / "draft", 1)


def _prompts(n: int, seed: int) -> list[list[int]]:
    """Edit-style prompts: random spans, each repeated (the n-gram proposer finds them)."""
    rng = random.Random(seed)
    return [
        [t for _ in range(rng.randint(2, 4)) for t in span]
        for span in ([rng.randrange(4, 384) for _ in range(rng.randint(3, 12))] for _ in range(n))
    ]


def _greedy(llm: LLM, prompts: list[list[int]]) -> tuple[list[list[int]], int]:
    """Tokens, and how many graph replays the generation made."""
    graphs = llm.engine.runner.graphs
    assert graphs is not None
    replays = 0
    replay = graphs.replay

    def counted(size: int) -> torch.Tensor:
        nonlocal replays
        replays += 1
        return replay(size)

    graphs.replay = counted  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], replays


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculation_replays_graphs_and_keeps_the_greedy_tokens(
    models: tuple[Path, Path], method: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    target, draft = models
    prompts = _prompts(12, seed=3)
    kw = dict(dtype="float32", device="cuda", num_kv_blocks=1024, max_num_seqs=16)
    want, plain_replays = _greedy(LLM(target, **kw), prompts)  # type: ignore[arg-type]
    spec: dict[str, object] = {"num_speculative_tokens": 4}
    spec.update({"method": "ngram", "prompt_lookup_max": 3} if method == "ngram" else {})
    spec.update({"model": str(draft)} if method == "draft" else {})
    llm = LLM(target, speculative_config=spec, **kw)  # type: ignore[arg-type]
    verifying = 0  # steps of decodes and verifications, attended as decode rows
    build = model_runner.build_step

    def spy(*args: object, **kwargs: object) -> StepInputs:
        nonlocal verifying
        step = build(*args, **kwargs)  # type: ignore[arg-type]
        verifying += step.decode_only and any(r.spec_token_ids for r in step.batch)
        return step

    monkeypatch.setattr(model_runner, "build_step", spy)
    got, replays = _greedy(llm, prompts)
    assert got == want
    assert plain_replays >= MAX_NEW - 2  # every decode step of the plain run
    assert verifying > 0 and replays >= verifying  # 16 rows x 5 tokens: all within the graphs
