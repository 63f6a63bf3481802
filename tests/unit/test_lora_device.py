"""LoRAManager: the registry's decisions carried out on the tensors (slot loads, host copies
dropped and read again, pins, deferred removal)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from engine_svc.lora.adapter import LoRAAdapter, ModelDims
from engine_svc.lora.config import LoRAConfig
from engine_svc.lora.errors import (
    LoRACapacityError,
    LoRAExistsError,
    LoRAInvalidError,
    LoRANotFoundError,
)
from engine_svc.lora.manager import LoRAManager
from engine_svc.models.llama import DecoderSpec
from engine_svc.models.loader import architecture_of, read_hf_config
from tests.lora_peft import make_adapter


@pytest.fixture(scope="module")
def dims(tiny_models: dict[str, Path]) -> ModelDims:
    cfg = read_hf_config(tiny_models["llama"])
    return ModelDims.from_spec(DecoderSpec.from_hf_config(cfg, architecture_of(cfg)))


@pytest.fixture(scope="module")
def dirs(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    root = tmp_path_factory.mktemp("lora_dev")
    return [
        make_adapter(tiny_models["llama"], root / f"a{i}", r=2 + i, alpha=4, targets=t, seed=i)
        for i, t in enumerate([["q_proj"], ["q_proj", "down_proj"], "all-linear"])
    ]


def manager(dims: ModelDims, **config: object) -> LoRAManager:
    return LoRAManager(LoRAConfig(**config), dims, torch.float32, torch.device("cpu"))  # type: ignore[arg-type]


def slot_holds(m: LoRAManager, slot: int, adapter: LoRAAdapter) -> bool:
    q = adapter.modules[(0, "q_proj")]
    stack = m.weights.layers[0]["qkv_proj"]
    return bool(
        torch.equal(stack.a[slot, :, : q.rank], q.a.t())
        and torch.equal(stack.b[slot, : q.rank, : q.b.shape[0]], q.b.t() * q.scaling)
    )


def test_prepare_loads_and_moves_adapters_through_one_slot(
    dims: ModelDims, dirs: list[Path]
) -> None:
    m = manager(dims, max_loras=1)
    adapters = [m.read(d) for d in dirs]
    ids = [m.add(f"n{i}", a).lora_id for i, a in enumerate(adapters)]
    for i in (0, 2, 1, 0):
        assert m.prepare([ids[i]]) == {ids[i]: 0}
        assert slot_holds(m, 0, adapters[i])
        assert [info.on_device for info in m.infos()] == [j == i for j in range(3)]


def test_add_refuses_a_name_in_use(dims: ModelDims, dirs: list[Path]) -> None:
    m = manager(dims)
    m.add("x", m.read(dirs[0]))
    with pytest.raises(LoRAExistsError):
        m.add("x", m.read(dirs[1]))
    with pytest.raises(ValueError, match="lora_name"):
        m.add("bad name", m.read(dirs[1]))


def test_pin_loads_at_once_and_stays(dims: ModelDims, dirs: list[Path]) -> None:
    m = manager(dims, max_loras=2)
    adapters = [m.read(d) for d in dirs]
    a = m.add("a", adapters[0]).lora_id
    b = m.add("b", adapters[1], pin=True).lora_id
    c = m.add("c", adapters[2]).lora_id
    slot_b = m.registry.slot_of(b)
    assert slot_b is not None and slot_holds(m, slot_b, adapters[1])
    for lora_id in (a, c, a, c):
        slots = m.prepare([lora_id])
        assert slots[lora_id] != slot_b
    assert slot_holds(m, slot_b, adapters[1])


def test_host_copies_dropped_and_read_again(
    dims: ModelDims, dirs: list[Path], tmp_path: Path
) -> None:
    m = manager(dims, max_loras=1, max_cpu_loras=1)
    moved = tmp_path / "a0"
    shutil.copytree(dirs[0], moved)
    a = m.add("a", m.read(moved)).lora_id
    b = m.add("b", m.read(dirs[1])).lora_id
    assert m.host_ids == {b}  # a was the least recently used
    assert m.acquire("a") == a  # read again from its directory
    assert m.host_ids == {a}
    assert slot_holds(m, m.prepare([a])[a], m.read(moved))
    m.release(a)
    # b's turn: a is idle and goes; if b's files vanished, the request is refused, not stuck
    entry_b = m.registry.entry(b)
    entry_b.path = str(dirs[1].parent / "gone")
    with pytest.raises(LoRAInvalidError, match="gone"):
        m.acquire("b")
    assert m.registry.entry(b).users == 0


def test_remove_in_use_keeps_the_weights_until_the_last_request(
    dims: ModelDims, dirs: list[Path]
) -> None:
    m = manager(dims, max_loras=1)
    a = m.add("a", m.read(dirs[0])).lora_id
    assert m.acquire("a") == a
    m.prepare([a])
    m.remove("a")
    with pytest.raises(LoRANotFoundError):
        m.acquire("a")
    assert m.host_ids == {a} and m.prepare([a]) == {a: 0}  # still serves its request
    m.release(a)
    assert m.host_ids == set() and m.infos() == []
    b = m.add("a", m.read(dirs[1])).lora_id  # the name is free again: a new adapter
    assert b != a


def test_add_with_a_pin_that_cannot_be_honoured_adds_nothing(
    dims: ModelDims, dirs: list[Path]
) -> None:
    m = manager(dims, max_loras=1)
    m.add("a", m.read(dirs[0]), pin=True)
    with pytest.raises(LoRACapacityError):
        m.add("b", m.read(dirs[1]), pin=True)
    assert [i.name for i in m.infos()] == ["a"]
    assert len(m.host_ids) == 1
