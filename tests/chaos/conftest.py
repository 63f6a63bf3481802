"""The chaos suite: real engine and gateway processes on loopback under faults and hostile input.

Every case is bounded in requests and time and stops by itself. Each records its figures with
``record``; ``TANDEM_CHAOS_REPORT=path.json pytest tests/chaos`` writes them out (the source of
the table in docs/reliability.md), and ``-s`` prints them.
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.harness import Engine, Gateway

_FIGURES: dict[str, dict[str, Any]] = {}


@pytest.fixture(scope="session")
def record() -> Iterator[Any]:
    def add(case: str, **figures: Any) -> None:
        _FIGURES.setdefault(case, {}).update(figures)
        print(f"\n[chaos] {case}: {figures}")

    yield add
    path = os.environ.get("TANDEM_CHAOS_REPORT")
    if path and _FIGURES:
        meta = {
            "date": time.strftime("%Y-%m-%d %H:%M %Z"),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform()}",
            "python": platform.python_version(),
        }
        Path(path).write_text(json.dumps({"meta": meta, "cases": _FIGURES}, indent=2))


@pytest.fixture()
def pair(cache_dir: Path, log_dir: Path, request: pytest.FixtureRequest) -> Iterator[Any]:
    """A fresh engine and gateway: ``pair(*engine_flags, gateway_flags=(...))``."""
    started: list[Engine | Gateway] = []

    def start(*engine_flags: str, gateway_flags: tuple[str, ...] = ()) -> tuple[Engine, Gateway]:
        engine = Engine(cache_dir, log_dir, *engine_flags)
        started.append(engine)
        engine.wait_ready()
        gateway = Gateway(engine.address, cache_dir, log_dir, *gateway_flags)
        started.append(gateway)
        return engine, gateway.wait_healthy()

    yield start
    for proc in reversed(started):
        proc.stop()
