"""Greedy generation with LoRA adapters equals transformers + PEFT token for token: several
adapters of different ranks and target sets and the base model in one batch (sharing steps),
adapters moved through a single device slot, and the prefix cache kept apart per adapter."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine_svc import LLM, LoRARequest, SamplingParams
from engine_svc.worker.model_runner import ModelRunner
from tests.lora_peft import load_peft, make_adapter
from tests.parity.hf_reference import hf_greedy

MAX_NEW = 12
ADAPTERS: dict[str, dict[str, Any]] = {
    "qv": dict(r=4, alpha=8, targets=["q_proj", "v_proj"]),
    "all": dict(r=8, alpha=16, targets="all-linear", use_rslora=True),
    "mlp": dict(
        r=2,
        alpha=4,
        targets=["o_proj", "gate_proj", "up_proj", "down_proj"],
        rank_pattern={"down_proj": 1},
    ),
}


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def family(
    request: pytest.FixtureRequest,
    tiny_models: dict[str, Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Path, dict[str, Path], Any]]:
    """(base checkpoint, adapter dirs by name, PEFT model holding all of them)."""
    base = tiny_models[request.param]
    root = tmp_path_factory.mktemp(f"lora_{request.param}")
    dirs = {
        name: make_adapter(base, root / name, seed=10 + i, **cfg)
        for i, (name, cfg) in enumerate(ADAPTERS.items())
    }
    yield base, dirs, load_peft(base, dirs)


def reference(peft_model: Any, prompt: list[int], adapter: str | None) -> list[int]:
    if adapter is None:
        with peft_model.disable_adapter():
            return hf_greedy(peft_model, prompt, MAX_NEW, stop_at_eos=False)
    peft_model.set_adapter(adapter)
    return hf_greedy(peft_model, prompt, MAX_NEW, stop_at_eos=False)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 380) for _ in range(rng.randint(3, 21))] for _ in range(n)]


def generate(
    llm: LLM, batch: list[list[int]], names: list[str | None], dirs: dict[str, Path]
) -> list[Any]:
    ids = {name: i + 1 for i, name in enumerate(ADAPTERS)}
    requests = [None if n is None else LoRARequest(n, ids[n], str(dirs[n])) for n in names]
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    return llm.generate(
        [{"prompt_token_ids": p} for p in batch], params, use_tqdm=False, lora_request=requests
    )


def record_steps(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> list[set[int]]:
    """The adapter ids (0: base) of the requests of every step the model runner executes."""
    steps: list[set[int]] = []
    execute = ModelRunner.execute

    def spy(self: ModelRunner, so: Any) -> Any:
        if so.scheduled:
            steps.append({s.request.lora_id for s in so.scheduled})
        return execute(self, so)

    monkeypatch.setattr(llm.engine.runner, "execute", spy.__get__(llm.engine.runner))
    return steps


def test_adapters_and_base_share_steps(
    family: tuple[Path, dict[str, Path], Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    base, dirs, peft_model = family
    llm = LLM(
        base,
        dtype="float32",
        enable_lora=True,
        max_loras=3,
        max_lora_rank=8,
        num_kv_blocks=128,
        block_size=4,
        max_num_batched_tokens=32,  # prompts are chunked, and chunks ride with decodes
    )
    steps = record_steps(llm, monkeypatch)
    cycle: list[str | None] = ["qv", "all", None, "mlp"]
    names = [cycle[i % 4] for i in range(10)]
    batch = prompts(len(names))
    outs = generate(llm, batch, names, dirs)
    for prompt, name, out in zip(batch, names, outs, strict=True):
        assert out.outputs[0].token_ids == reference(peft_model, prompt, name), name
    # the three adapters and the base model ran in the same steps
    assert max(len(s) for s in steps) == 4
    assert llm.engine.kv.num_free_blocks == 128
    # every adapter changed the output (else parity would prove nothing about it)
    base_out = [reference(peft_model, p, None) for p in batch]
    for i, name in enumerate(names):
        if name is not None:
            assert outs[i].outputs[0].token_ids != base_out[i], name


def test_one_slot_three_adapters_interleaved(
    family: tuple[Path, dict[str, Path], Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    base, dirs, peft_model = family
    llm = LLM(
        base,
        dtype="float32",
        enable_lora=True,
        max_loras=1,
        max_lora_rank=8,
        num_kv_blocks=128,
        block_size=4,
        pad_decode_batches=True,  # padding rows use no adapter
    )
    steps = record_steps(llm, monkeypatch)
    manager = llm.engine.runner.lora
    assert manager is not None
    loads: list[int] = []
    load = manager.weights.load
    monkeypatch.setattr(
        manager.weights, "load", lambda slot, a: (loads.append(slot), load(slot, a))
    )
    names: list[str | None] = ["qv", "all", "mlp", None, "all", "qv", "mlp", "qv"]
    batch = prompts(len(names), seed=1)
    outs = generate(llm, batch, names, dirs)
    for prompt, name, out in zip(batch, names, outs, strict=True):
        assert out.outputs[0].token_ids == reference(peft_model, prompt, name), name
    # never two adapters in one step (the base model may join any)
    assert all(len(s - {0}) <= 1 for s in steps)
    assert len(loads) >= 3 and set(loads) == {0}  # adapters took turns in the one slot
    assert [i.on_device for i in llm.engine.list_loras()].count(True) == 1


def test_prefix_cache_never_shared_between_adapters(
    family: tuple[Path, dict[str, Path], Any],
) -> None:
    base, dirs, peft_model = family
    llm = LLM(
        base,
        dtype="float32",
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        num_kv_blocks=128,
        block_size=4,
    )
    prompt = prompts(1, seed=2)[0] + [7] * 13  # at least 4 full blocks
    full_blocks = (len(prompt) - 1) // 4 * 4

    def run(name: str | None) -> tuple[list[int], int]:
        out = generate(llm, [prompt], [name], dirs)[0]
        return out.outputs[0].token_ids, out.num_cached_tokens

    qv, cached = run("qv")
    assert cached == 0
    again, cached = run("qv")
    assert (again, cached) == (qv, full_blocks)  # the cache works within one adapter
    for name in ("all", None):
        tokens, cached = run(name)
        assert cached == 0, name  # ... and is never shared across adapters or the base
        assert tokens == reference(peft_model, prompt, name)
    assert qv == reference(peft_model, prompt, "qv")
    assert qv != reference(peft_model, prompt, None)


def test_an_adapter_added_again_under_its_name_reads_no_stale_cache(
    family: tuple[Path, dict[str, Path], Any], tmp_path: Path
) -> None:
    base, dirs, _ = family
    llm = LLM(
        base, dtype="float32", enable_lora=True, max_lora_rank=8, num_kv_blocks=64, block_size=4
    )
    prompt = prompts(1, seed=3)[0] + [9] * 12
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    first = llm.generate(
        [{"prompt_token_ids": prompt}],
        params,
        use_tqdm=False,
        lora_request=LoRARequest("x", 7, str(dirs["qv"])),
    )[0]
    llm.engine.remove_lora("x")
    other = make_adapter(base, tmp_path / "x2", r=4, alpha=8, targets=["q_proj", "v_proj"], seed=99)
    second = llm.generate(
        [{"prompt_token_ids": prompt}],
        params,
        use_tqdm=False,
        lora_request=LoRARequest("x", 7, str(other)),
    )[0]
    assert second.num_cached_tokens == 0
    assert second.outputs[0].token_ids == reference(load_peft(base, {"x": other}), prompt, "x")
    assert second.outputs[0].token_ids != first.outputs[0].token_ids


def test_bfloat16_serving_stays_close_to_float32(
    tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    """The slots hold the serving dtype: an adapter's logprobs in bf16 track float32's, and
    differ from the base model's by far more than that."""
    base = tiny_models["llama"]
    d = make_adapter(base, tmp_path / "a", r=8, alpha=16, targets="all-linear", seed=5)
    prompt = prompts(1, seed=4)[0]

    def top(dtype: str, adapter: bool) -> dict[int, float]:
        llm = LLM(base, dtype=dtype, enable_lora=True, max_lora_rank=8, num_kv_blocks=32)
        res = llm.generate(
            [{"prompt_token_ids": prompt}],
            SamplingParams(max_tokens=1, temperature=0.0, logprobs=20),
            use_tqdm=False,
            lora_request=LoRARequest("a", 1, str(d)) if adapter else None,
        )[0]
        assert res.outputs[0].logprobs is not None
        return res.outputs[0].logprobs[0].top

    f32, bf16, plain = top("float32", True), top("bfloat16", True), top("float32", False)
    shared = set(f32) & set(bf16)
    assert len(shared) >= 10
    assert max(abs(f32[t] - bf16[t]) for t in shared) < 0.1
    assert max(abs(f32[t] - plain[t]) for t in set(f32) & set(plain)) > 0.3
