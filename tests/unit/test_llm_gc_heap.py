"""The offline ``LLM`` freezes its startup heap as the server does (``protos.gc_heap``): the
model and the engine are out of the collector's walks once it is built, and an LLM that is
dropped is still freed."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine_svc import LLM


@pytest.fixture()
def unfrozen() -> Iterator[None]:
    """The test process's heap is the test run's: thawed before and after."""
    gc.unfreeze()
    yield
    gc.unfreeze()


def _tracked(obj: object) -> bool:
    return any(o is obj for o in gc.get_objects())


def test_the_offline_llm_freezes_what_it_built(
    tiny_models: dict[str, Path], unfrozen: None
) -> None:
    assert gc.get_freeze_count() == 0
    llm = LLM(tiny_models["llama"], dtype="float32", num_kv_blocks=16)
    assert gc.get_freeze_count() > 0
    assert not _tracked(llm.engine.runner.model) and not _tracked(llm.engine.scheduler)
    model = weakref.ref(llm.engine.runner.model)
    del llm
    assert model() is None  # freed by reference counts, frozen or not
