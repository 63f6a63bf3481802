"""LoRA adapters under tensor parallelism (2 ranks, gloo, on the CPU).

* Each rank's device slots hold the slice of an adapter that goes with its shard of the base
  layer: column-parallel q/k/v and gate/up with B cut like the base weight's output rows (KV
  heads replicated when there are fewer than ranks), row-parallel o and down with A cut like
  its input columns, and the ranks' deltas put together give the unsharded delta.
* The whole engine at ``tensor_parallel_size=2``: adapters of every target (q, k, v, o, gate,
  up, down) and the base model in one batch, three adapters taking turns in two slots, and an
  adapter loaded and pinned while the engine runs, generate greedily what the one-rank engine
  and transformers + PEFT generate, token for token. A delta added after the all-reduce (twice
  the adapter) or a slice on the wrong rank changes the tokens.
* Only rank 0 reads adapter directories: an adapter whose directory was deleted after it was
  added serves on every rank (the workers got rank 0's host copy with the add), and one read
  again from a rewritten directory (``max_cpu_loras``) reaches the workers' slots too.

One process joins one torch.distributed group at a time: the engine fixture is per module and
per model, the previous one shut down before the next starts.
"""

from __future__ import annotations

import pickle
import random
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from engine_svc.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine_svc.core.sampling_params import SamplingParams
from engine_svc.core.scheduler import SchedulerOutput
from engine_svc.distributed import TPGroup
from engine_svc.engine_core import EngineCore
from engine_svc.executor import MultiprocExecutor, multiproc
from engine_svc.executor.step_message import StepEncoder
from engine_svc.lora.adapter import LoRAAdapter, ModelDims, load_adapter
from engine_svc.lora.config import LoRAConfig
from engine_svc.lora.manager import LoRAManager
from engine_svc.lora.ops import LoRAMapping
from engine_svc.lora.weights import LoRAWeights
from engine_svc.models.llama import DecoderSpec, LlamaForCausalLM
from engine_svc.models.loader import architecture_of, read_hf_config
from engine_svc.models.parallel import ShardPlan
from tests.conftest import build_tiny_checkpoint
from tests.lora_peft import ALL_TARGETS, load_peft, make_adapter
from tests.parity.hf_reference import hf_greedy

RANKS = 2
MAX_NEW = 10
ADAPTERS: dict[str, dict[str, Any]] = {
    "all": dict(r=8, alpha=16, targets=ALL_TARGETS),
    "qkv": dict(r=4, alpha=8, targets=["q_proj", "k_proj", "v_proj"], use_rslora=True),
    "mlp": dict(
        r=2,
        alpha=4,
        targets=["o_proj", "gate_proj", "up_proj", "down_proj"],
        rank_pattern={"down_proj": 1},
    ),
    "late": dict(r=6, alpha=6, targets=ALL_TARGETS),  # loaded while the engine runs
}
STARTUP = ("all", "qkv", "mlp")


@pytest.fixture(scope="module")
def checkpoints(
    tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """Llama with 2 KV heads (one per rank) and Qwen2 with 1 KV head (on both ranks)."""
    root = tmp_path_factory.mktemp("tp_lora_models")
    qwen2 = build_tiny_checkpoint(
        root / "qwen2_one_kv_head", "Qwen2ForCausalLM", hidden_size=96, num_key_value_heads=1
    )
    return {"llama": tiny_models["llama"], "qwen2_one_kv_head": qwen2}


@pytest.fixture(scope="module")
def adapters(
    checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, dict[str, Path]]:
    root = tmp_path_factory.mktemp("tp_lora_adapters")
    return {
        model: {
            name: make_adapter(base, root / model / name, seed=20 + i, **cfg)
            for i, (name, cfg) in enumerate(ADAPTERS.items())
        }
        for model, base in checkpoints.items()
    }


def _spec(model_dir: Path) -> DecoderSpec:
    cfg = read_hf_config(model_dir)
    return DecoderSpec.from_hf_config(cfg, architecture_of(cfg))


# ------------------------------------------------------------------ each rank's slice
@pytest.mark.parametrize("model", ["llama", "qwen2_one_kv_head"])
def test_rank_slices_put_together_give_the_whole_delta(
    model: str, checkpoints: dict[str, Path], adapters: dict[str, dict[str, Path]]
) -> None:
    spec = _spec(checkpoints[model])
    dims = ModelDims.from_spec(spec)
    adapter = load_adapter(adapters[model]["all"], dims, max_rank=8)
    whole = _slots(dims, adapter, None)
    plans = [spec.shard_plan(TPGroup(rank, RANKS)) for rank in range(RANKS)]
    ranks = [_slots(dims, adapter, plan) for plan in plans]
    d, heads, kv_heads = spec.head_dim, spec.num_heads, spec.num_kv_heads
    inter = spec.intermediate_size
    gen = torch.Generator().manual_seed(0)
    t = 5
    for layer in range(spec.num_layers):
        # column-parallel: each rank's output columns are the whole delta's at its heads
        x = torch.randn(t, spec.hidden_size, generator=gen)
        full = _delta(whole, layer, "qkv_proj", x)
        q, kv = heads * d, kv_heads * d
        fq, fk, fv = full.split([q, kv, kv], dim=-1)
        for plan, w in zip(plans, ranks, strict=True):
            got = _delta(w, layer, "qkv_proj", x)
            rq, rkv = plan.num_heads * d, plan.num_kv_heads * d
            gq, gk, gv = got.split([rq, rkv, rkv], dim=-1)
            r = plan.tp.rank
            kv_head = r * kv_heads // RANKS  # vLLM's rule: replicated over RANKS // kv_heads
            torch.testing.assert_close(gq, fq[:, r * rq : (r + 1) * rq])
            torch.testing.assert_close(gk, fk[:, kv_head * d : kv_head * d + rkv])
            torch.testing.assert_close(gv, fv[:, kv_head * d : kv_head * d + rkv])
        full = _delta(whole, layer, "gate_up_proj", x)
        fg, fu = full.split([inter, inter], dim=-1)
        half = inter // RANKS
        for plan, w in zip(plans, ranks, strict=True):
            r = plan.tp.rank
            gg, gu = _delta(w, layer, "gate_up_proj", x).split([half, half], dim=-1)
            torch.testing.assert_close(gg, fg[:, r * half : (r + 1) * half])
            torch.testing.assert_close(gu, fu[:, r * half : (r + 1) * half])
        # row-parallel: each rank's delta of its input columns; their sum is the whole delta
        for fused, width in (("o_proj", heads * d), ("down_proj", inter)):
            x = torch.randn(t, width, generator=gen)
            share = width // RANKS
            parts = [
                _delta(w, layer, fused, x[:, p.tp.rank * share : (p.tp.rank + 1) * share])
                for p, w in zip(plans, ranks, strict=True)
            ]
            torch.testing.assert_close(sum(parts), _delta(whole, layer, fused, x))
            assert not torch.allclose(parts[0], parts[1])  # each rank's share differs


def test_a_rank_takes_only_slots_sliced_for_it(checkpoints: dict[str, Path]) -> None:
    spec = _spec(checkpoints["llama"])
    dims = ModelDims.from_spec(spec)
    with torch.device("meta"):
        rank1 = LlamaForCausalLM(spec, 64, tp=TPGroup(1, RANKS))
    cpu = torch.device("cpu")
    for plan in (None, spec.shard_plan(TPGroup(0, RANKS))):
        with pytest.raises(ValueError, match="sliced for rank 0 of"):
            rank1.attach_lora(LoRAWeights(dims, 1, 8, torch.float32, cpu, plan))
    rank1.attach_lora(LoRAWeights(dims, 1, 8, torch.float32, cpu, rank1.plan))


def _slots(dims: ModelDims, adapter: LoRAAdapter, plan: ShardPlan | None) -> LoRAWeights:
    w = LoRAWeights(dims, 1, 8, torch.float32, torch.device("cpu"), plan)
    w.load(0, adapter)
    return w


def _delta(w: LoRAWeights, layer: int, fused: str, x: torch.Tensor) -> torch.Tensor:
    stack = w.layers[layer][fused]
    y = torch.zeros(x.shape[0], sum(stack.out_sizes))
    mapping = LoRAMapping.build(np.zeros(x.shape[0], np.int64), torch.device("cpu"))
    assert mapping is not None
    stack.apply(y, x, mapping)
    return y


# ------------------------------------------------------------------ workers follow rank 0
class _Mirror:
    """The executor's part in between: rank 0's host copies given to a worker, pickled."""

    def __init__(self, worker: LoRAManager) -> None:
        self.worker = worker

    def put_lora(self, lora_id: int, adapter: LoRAAdapter) -> None:
        self.worker.keep(lora_id, pickle.loads(pickle.dumps(adapter)))

    def drop_loras(self, lora_ids: list[int]) -> None:
        self.worker.discard(lora_ids)


def test_a_worker_manager_holds_what_rank_0s_slots_hold(
    checkpoints: dict[str, Path], adapters: dict[str, dict[str, Path]]
) -> None:
    dims = ModelDims.from_spec(_spec(checkpoints["llama"]))
    config = LoRAConfig(max_loras=2, max_lora_rank=8, max_cpu_loras=2)
    rank0 = LoRAManager(config, dims, torch.float32, torch.device("cpu"))
    worker = LoRAManager(config, dims, torch.float32, torch.device("cpu"))
    rank0.mirror = _Mirror(worker)
    worker.read = None  # type: ignore[assignment,method-assign]  # a worker never reads
    encoder = StepEncoder()
    ids = {n: rank0.add(n, rank0.read(adapters["llama"][n])).lora_id for n in STARTUP}
    idle = SchedulerOutput([], 0)
    for step in (["all", "qkv"], ["mlp"], ["mlp", "all"], ["qkv"]):
        for n in step:  # a request takes it: read again if its host copy went (max_cpu_loras)
            rank0.acquire(n)
        slots = rank0.prepare(sorted(ids[n] for n in step))
        msg = encoder.encode(idle, rank0.placement())
        assert msg.lora is not None  # the slots changed: the message says what they hold
        worker.follow(msg.lora)
        assert worker.prepare(sorted(ids[n] for n in step)) == slots
        for slot in slots.values():
            for a, b in zip(_slot_tensors(rank0, slot), _slot_tensors(worker, slot), strict=True):
                assert torch.equal(a, b)
        assert set(slots) <= worker.host_ids == rank0.host_ids  # rank 0's, no more
        assert encoder.encode(idle, rank0.placement()).lora is None  # unchanged: not sent
        for n in step:
            rank0.release(ids[n])
    assert not worker.registry.infos()  # a worker decides nothing


def test_an_adapter_read_again_from_a_rewritten_directory_reaches_the_workers_slots(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """``max_cpu_loras`` drops a host copy; rank 0 reads the adapter again from its directory,
    rewritten meanwhile, and puts it back in the slot it had: the worker's slot holds the new
    weights too (rank 0 gives it its new copy; the slot is loaded again though rank 0's slots
    read the same as at the last message)."""
    base = checkpoints["llama"]
    dims = ModelDims.from_spec(_spec(base))
    config = LoRAConfig(max_loras=1, max_lora_rank=8, max_cpu_loras=1)
    rank0 = LoRAManager(config, dims, torch.float32, torch.device("cpu"))
    worker = LoRAManager(config, dims, torch.float32, torch.device("cpu"))
    rank0.mirror = _Mirror(worker)
    worker.read = None  # type: ignore[assignment,method-assign]  # a worker never reads
    cfg: dict[str, Any] = dict(r=4, alpha=8, targets=ALL_TARGETS)
    x_dir = make_adapter(base, tmp_path / "x", seed=1, **cfg)
    x = rank0.add("x", rank0.read(x_dir)).lora_id
    y = rank0.add("y", rank0.read(make_adapter(base, tmp_path / "y", seed=2, **cfg))).lora_id
    encoder = StepEncoder()
    idle = SchedulerOutput([], 0)

    def step(lora_id: int) -> None:
        rank0.prepare([lora_id])
        worker.follow(encoder.encode(idle, rank0.placement()).lora)  # as worker_proc does
        assert worker.prepare([lora_id]) == {lora_id: 0}
        for a, b in zip(_slot_tensors(rank0, 0), _slot_tensors(worker, 0), strict=True):
            assert torch.equal(a, b)

    rank0.acquire("x")  # read again (y's add dropped it), y dropped
    step(x)
    old = [t.clone() for t in _slot_tensors(worker, 0)]
    rank0.release(x)
    rank0.acquire("y")  # x dropped (host and slot), y read again
    rank0.release(y)
    shutil.rmtree(x_dir)
    make_adapter(base, x_dir, seed=3, **cfg)  # x's directory rewritten
    rank0.acquire("x")  # read again: the new weights; y dropped
    assert rank0.host_ids == worker.host_ids == {x}
    step(x)  # slot 0 holds x again, as at the last message
    assert not all(torch.equal(a, b) for a, b in zip(old, _slot_tensors(worker, 0), strict=True))


def _slot_tensors(m: LoRAManager, slot: int) -> list[torch.Tensor]:
    return [t for s in m.weights.layers for st in s.values() for t in (st.a[slot], st.b[slot])]


# ------------------------------------------------------------------ the engine
def _config(model_dir: Path, tp: int, modules: dict[str, Path]) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(str(model_dir), dtype="float32"),
        cache=CacheConfig(num_kv_blocks=64, block_size=4),
        scheduler=SchedulerConfig(max_num_batched_tokens=24),  # chunks ride with decodes
        tensor_parallel_size=tp,
        lora=LoRAConfig(
            max_loras=2,  # three adapters at start: they take turns in the slots
            max_lora_rank=8,
            modules=tuple((n, str(modules[n])) for n in STARTUP),
        ),
    )


@pytest.fixture(scope="module", params=["llama", "qwen2_one_kv_head"])
def tp_engine(
    request: pytest.FixtureRequest,
    checkpoints: dict[str, Path],
    adapters: dict[str, dict[str, Path]],
) -> Iterator[tuple[str, EngineCore]]:
    model = request.param
    threads = torch.get_num_threads()  # the executor gives each rank its share of the CPUs
    engine = EngineCore(_config(checkpoints[model], RANKS, adapters[model]))
    assert isinstance(engine.runner, MultiprocExecutor)
    try:
        yield model, engine
    finally:
        engine.runner.shutdown()
        torch.set_num_threads(threads)
    assert not any(p.is_alive() for p in engine.runner._procs)


@pytest.fixture(scope="module")
def peft_models(
    checkpoints: dict[str, Path], adapters: dict[str, dict[str, Path]]
) -> dict[str, Any]:
    return {model: load_peft(base, adapters[model]) for model, base in checkpoints.items()}


def _reference(peft_model: Any, prompt: list[int], adapter: str | None) -> list[int]:
    if adapter is None:
        with peft_model.disable_adapter():
            return hf_greedy(peft_model, prompt, MAX_NEW, stop_at_eos=False)
    peft_model.set_adapter(adapter)
    return hf_greedy(peft_model, prompt, MAX_NEW, stop_at_eos=False)


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 380) for _ in range(rng.randint(3, 30))] for _ in range(n)]


def _run(
    engine: EngineCore, prompts: list[list[int]], names: list[str | None], tag: str
) -> tuple[list[list[int]], list[set[int]]]:
    """Each request's greedy tokens, and the adapter ids (0: base) of every step's rows."""
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    ids = [f"{tag}{i}" for i in range(len(prompts))]
    for rid, p, name in zip(ids, prompts, names, strict=True):
        engine.add_request(rid, p, params, lora_name=name)
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    steps: list[set[int]] = []
    schedule = engine.scheduler.schedule

    def recording() -> SchedulerOutput:
        so = schedule()
        if so.scheduled:
            steps.append({s.request.lora_id for s in so.scheduled})
        return so

    engine.scheduler.schedule = recording  # type: ignore[method-assign]
    try:
        while engine.has_unfinished_requests():
            for o in engine.step().outputs:
                tokens[o.request_id].extend(o.new_token_ids)
    finally:
        del engine.scheduler.schedule
    return [tokens[r] for r in ids], steps


def test_adapters_and_base_in_one_batch_equal_one_rank_and_peft(
    tp_engine: tuple[str, EngineCore],
    checkpoints: dict[str, Path],
    adapters: dict[str, dict[str, Path]],
    peft_models: dict[str, Any],
) -> None:
    model, engine = tp_engine
    cycle: list[str | None] = ["all", None, "qkv", "mlp", None, "all"]
    names = cycle * 2
    prompts = _prompts(len(names), seed=11)
    got, steps = _run(engine, prompts, names, "mix")
    peft = peft_models[model]
    want = [_reference(peft, p, n) for p, n in zip(prompts, names, strict=True)]
    assert got == want
    one = EngineCore(_config(checkpoints[model], 1, adapters[model]))
    assert _run(one, prompts, names, "mix")[0] == want
    # adapter rows and base rows shared steps; three adapters went through two slots
    assert any(0 in s and len(s) > 1 for s in steps)
    assert max(len(s - {0}) for s in steps) == 2
    assert len({i for s in steps for i in s} - {0}) == 3
    # every adapter changed the output (else parity would prove nothing about it)
    for p, n, tokens in zip(prompts, names, got, strict=True):
        if n is not None:
            assert tokens != _reference(peft, p, None), n


def test_adapter_loaded_and_pinned_at_run_time_reaches_the_workers(
    tp_engine: tuple[str, EngineCore],
    adapters: dict[str, dict[str, Path]],
    peft_models: dict[str, Any],
) -> None:
    model, engine = tp_engine
    engine.add_lora("late", engine.read_lora(str(adapters[model]["late"])))
    engine.pin_lora("late")  # in a slot now on rank 0; the workers' follow at the next step
    names: list[str | None] = ["late", None, "late", "all"]
    prompts = _prompts(len(names), seed=12)
    got, _ = _run(engine, prompts, names, "late")
    peft = peft_models[model]
    assert got == [_reference(peft, p, n) for p, n in zip(prompts, names, strict=True)]
    assert got[0] != _reference(peft, prompts[0], None)
    info = {i.name: i for i in engine.list_loras()}
    assert info["late"].pinned and info["late"].on_device
    engine.remove_lora("late")
    assert "late" not in {i.name for i in engine.list_loras()}


def test_an_adapter_whose_directory_went_after_it_was_added_serves_on_every_rank(
    tp_engine: tuple[str, EngineCore],
    adapters: dict[str, dict[str, Path]],
    peft_models: dict[str, Any],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The workers got rank 0's host copy with the add: nothing is read when it first takes a
    slot, so its directory deleted after the add changes nothing (the engine stays alive)."""
    model, engine = tp_engine
    assert isinstance(engine.runner, MultiprocExecutor)
    deaths: list[str] = []  # (without the fix a worker dies: keep this process alive)
    monkeypatch.setattr(engine.runner, "on_worker_death", deaths.append)
    monkeypatch.setattr(multiproc, "exit_engine", deaths.append)
    copy = shutil.copytree(adapters[model]["late"], tmp_path / "late-copy")
    engine.add_lora("gone", engine.read_lora(str(copy)))
    shutil.rmtree(copy)
    names: list[str | None] = ["gone", None, "gone"]
    prompts = _prompts(len(names), seed=13)
    got, _ = _run(engine, prompts, names, "gone")
    peft = peft_models[model]
    late = ["late" if n else None for n in names]  # the same weights as "gone"
    want = [_reference(peft, p, n) for p, n in zip(prompts, late, strict=True)]
    assert got == want
    assert got[0] != _reference(peft, prompts[0], None)
    assert not deaths and all(p.is_alive() for p in engine.runner._procs)
    engine.remove_lora("gone")


def test_the_config_takes_lora_with_tensor_parallelism() -> None:
    config = EngineConfig(ModelConfig("unused"), tensor_parallel_size=2, lora=LoRAConfig())
    assert config.lora is not None and config.tensor_parallel_size == 2
