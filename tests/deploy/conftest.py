"""A real engine on the embedded default model, for the tests that run the images' health checks
(``python -m engine_svc.healthcheck``, the gateway's urllib checks) against live processes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.harness import Engine, Gateway, free_port, kill_all

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def deploy_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """TANDEM_CACHE_DIR of the engines started here; the first one builds the default model."""
    return tmp_path_factory.mktemp("tandem_cache")


@pytest.fixture(scope="session")
def deploy_log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="session", autouse=True)
def _no_leftover_processes() -> Iterator[None]:
    yield
    kill_all()


@pytest.fixture(scope="session")
def live_engine(deploy_cache_dir: Path, deploy_log_dir: Path) -> Iterator[Engine]:
    e = Engine(deploy_cache_dir, deploy_log_dir, "--device", "cpu", "--kv-cache-memory", "16MiB")
    try:
        yield e.wait_ready(timeout=180)
    finally:
        e.stop()


@pytest.fixture()
def live_gateway(
    live_engine: Engine, deploy_cache_dir: Path, deploy_log_dir: Path
) -> Iterator[Gateway]:
    """A gateway connected to ``live_engine`` (its /health answers 200)."""
    g = Gateway(live_engine.address, deploy_cache_dir, deploy_log_dir)
    try:
        yield g.wait_healthy()
    finally:
        g.stop()


@pytest.fixture()
def lonely_gateway(deploy_cache_dir: Path, deploy_log_dir: Path) -> Iterator[Gateway]:
    """A gateway whose engine address has nothing listening: /live 200, /health 503."""
    g = Gateway(f"127.0.0.1:{free_port()}", deploy_cache_dir, deploy_log_dir)
    try:
        yield g
    finally:
        g.stop()
