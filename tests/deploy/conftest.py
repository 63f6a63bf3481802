"""Gateways for the tests that run the images' health checks (``python -m engine_svc.healthcheck``,
the gateway's urllib checks) against live processes; the engine is the session one
(``engine`` in ``tests/conftest.py``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.harness import Engine, Gateway, free_port

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture()
def live_gateway(engine: Engine, cache_dir: Path, log_dir: Path) -> Iterator[Gateway]:
    """A gateway connected to ``engine`` (its /health answers 200)."""
    g = Gateway(engine.address, cache_dir, log_dir)
    try:
        yield g.wait_healthy()
    finally:
        g.stop()


@pytest.fixture()
def lonely_gateway(cache_dir: Path, log_dir: Path) -> Iterator[Gateway]:
    """A gateway whose engine address has nothing listening: /live 200, /health 503."""
    g = Gateway(f"127.0.0.1:{free_port()}", cache_dir, log_dir)
    try:
        yield g
    finally:
        g.stop()
