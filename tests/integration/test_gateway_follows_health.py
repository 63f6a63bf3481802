"""The gateway follows its engines' health: a draining or stalled engine leaves the rotation at
once (/health 503 when none can serve) and comes back when it serves again."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.integration.harness import MODEL, Engine, Gateway
from tests.integration.inprocess import start_stallable

pytestmark = pytest.mark.timeout(90)


def _wait_health(url: str, status: int, timeout: float) -> float:
    start = time.monotonic()
    while httpx.get(f"{url}/health", timeout=5).status_code != status:
        assert time.monotonic() - start < timeout, f"/health never became {status}"
        time.sleep(0.02)
    return time.monotonic() - start


def test_draining_engine_leaves_the_rotation_at_once(cache_dir: Path, log_dir: Path) -> None:
    engine = Engine(cache_dir, log_dir, "--shutdown-timeout", "30").wait_ready()
    gateway = Gateway(engine.address, cache_dir, log_dir)
    try:
        gateway.wait_healthy()
        events: list[str] = []
        body = {"model": MODEL, "prompt": "Hi", "max_tokens": 400, "ignore_eos": True}

        def stream() -> None:
            with httpx.stream(
                "POST",
                f"{gateway.url}/v1/completions",
                json={**body, "stream": True},
                headers=gateway.headers,
                timeout=60,
            ) as r:
                events.extend(line for line in r.iter_lines() if line)

        client = threading.Thread(target=stream)
        client.start()
        while not events and client.is_alive():
            time.sleep(0.01)
        engine.signal(signal.SIGTERM)
        assert _wait_health(gateway.url, 503, timeout=2) < 1.0
        r = httpx.post(f"{gateway.url}/v1/completions", json=body, headers=gateway.headers)
        assert r.status_code == 503
        assert r.json()["error"]["type"] == "service_unavailable_error"
        client.join(60)
        assert events[-1] == "data: [DONE]"
        assert '"finish_reason":"length"' in events[-2]  # the in-flight stream was finished
        assert engine.wait(30) == 0
    finally:
        gateway.stop()
        engine.kill()


def test_stalled_engine_leaves_and_rejoins(cache_dir: Path, log_dir: Path) -> None:
    from engine_svc.default_model import ensure_default_model

    engine, core = start_stallable(ensure_default_model(), MODEL, stall_timeout_s=1.0)
    gateway = Gateway(engine.address, cache_dir, log_dir)
    try:
        gateway.wait_healthy()
        core.stall.set()
        body = {"model": MODEL, "prompt": "Hi", "max_tokens": 4}
        stuck = threading.Thread(
            target=lambda: httpx.post(
                f"{gateway.url}/v1/completions", json=body, headers=gateway.headers, timeout=60
            )
        )
        stuck.start()
        assert core.stalled.wait(10)
        assert _wait_health(gateway.url, 503, timeout=5) < 3.0  # stall timeout 1 s + watchdog
        assert "not serving" in httpx.get(f"{gateway.url}/health").json()["error"]["message"]
        core.stall.clear()
        core.release.set()
        assert _wait_health(gateway.url, 200, timeout=5) < 2.0
        stuck.join(30)
        r = httpx.post(f"{gateway.url}/v1/completions", json=body, headers=gateway.headers)
        assert r.status_code == 200, r.text
    finally:
        core.release.set()
        gateway.stop()
        engine.stop()
