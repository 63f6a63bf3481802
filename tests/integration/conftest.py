"""The session gateway in front of the session engine (``tests/conftest.py``), and its client.

Tests that need an engine of their own (queue limits, shutdown, SIGKILL) start it from
``harness``; every process is killed at the end of the session even when a test fails.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.integration.harness import API_KEY, Engine, Gateway


@pytest.fixture(scope="session")
def gateway(engine: Engine, cache_dir: Path, log_dir: Path) -> Iterator[Gateway]:
    g = Gateway(engine.address, cache_dir, log_dir)
    try:
        yield g.wait_healthy()
    finally:
        g.stop()


@pytest.fixture()
def client(gateway: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=API_KEY, max_retries=0, timeout=30)
