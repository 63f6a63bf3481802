"""Session fixtures: the default model built once, one real engine and one real gateway.

Tests that need an engine of their own (queue limits, shutdown, SIGKILL) start it from
``harness``; every process is killed at the end of the session even when a test fails.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import grpc
import openai
import pytest

from tests.integration.harness import API_KEY, Engine, Gateway, kill_all

SESSION_ENGINE_FLAGS = ("--max-num-seqs", "16", "--kv-cache-memory", "64MiB")


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """TANDEM_CACHE_DIR shared by this process and every child; the model is built once here."""
    path = tmp_path_factory.mktemp("tandem_cache")
    old = os.environ.get("TANDEM_CACHE_DIR")
    os.environ["TANDEM_CACHE_DIR"] = str(path)
    from engine_svc.default_model import ensure_default_model

    ensure_default_model()
    yield path
    if old is None:
        os.environ.pop("TANDEM_CACHE_DIR", None)
    else:
        os.environ["TANDEM_CACHE_DIR"] = old


@pytest.fixture(scope="session")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="session", autouse=True)
def _no_leftover_processes() -> Iterator[None]:
    yield
    kill_all()


@pytest.fixture(scope="session")
def engine(cache_dir: Path, log_dir: Path) -> Iterator[Engine]:
    e = Engine(cache_dir, log_dir, *SESSION_ENGINE_FLAGS)
    try:
        yield e.wait_ready()
    finally:
        e.stop()


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


@pytest.fixture()
def channel(engine: Engine) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(engine.address) as ch:
        yield ch
