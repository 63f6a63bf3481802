"""The engine loop thread builds the engine core itself, so all torch work runs on one thread
(two OpenMP pools on a small machine make libgomp sleep at every barrier: see engine_loop)."""

from __future__ import annotations

import threading
import time

import pytest

from engine_svc.loop.engine_loop import EngineLoop


class _FakeCore:
    """Records the thread of every call the loop makes into the core."""

    def __init__(self, seen: list[str]) -> None:
        self.seen = seen
        seen.append(f"build:{threading.current_thread().name}")

    def has_unfinished_requests(self) -> bool:
        self.seen.append(f"poll:{threading.current_thread().name}")
        return False


def test_core_is_built_and_driven_on_the_loop_thread() -> None:
    seen: list[str] = []
    loop = EngineLoop(lambda: _FakeCore(seen), max_waiting=4)  # type: ignore[arg-type,return-value]
    core = loop.start()
    try:
        assert isinstance(core, _FakeCore) and loop.core is core
        assert seen[0] == "build:engine-loop"
        assert threading.current_thread().name != "engine-loop"
        loop._inbox.put(None)  # wake the loop once more: it polls the core again
        deadline = time.monotonic() + 5
        while len(seen) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(seen) >= 3 and set(seen[1:]) == {"poll:engine-loop"}
    finally:
        loop.stop()


def test_a_failed_build_is_raised_by_start() -> None:
    def build() -> None:
        raise RuntimeError("no such checkpoint")

    with pytest.raises(RuntimeError, match="no such checkpoint"):
        EngineLoop(build).start()  # type: ignore[arg-type]
