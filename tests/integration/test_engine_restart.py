"""SIGKILL the engine under a live stream: the client gets an error promptly, /health turns 503,
and an engine restarted on the same port is picked up without restarting the gateway, within a
second of its readiness."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

from tests.integration.harness import MODEL, Engine, Gateway

pytestmark = pytest.mark.timeout(60)


def _wait_status(url: str, status: int, timeout: float) -> httpx.Response:
    deadline = time.monotonic() + timeout
    while True:
        r = httpx.get(f"{url}/health", timeout=5)
        if r.status_code == status or time.monotonic() > deadline:
            return r
        time.sleep(0.05)


def test_engine_killed_mid_stream_then_restarted(cache_dir: Path, log_dir: Path) -> None:
    engine = Engine(cache_dir, log_dir).wait_ready()
    gateway = Gateway(engine.address, cache_dir, log_dir)  # default reconnect backoff
    try:
        gateway.wait_healthy()
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": 1900, "ignore_eos": True}
        events: list[str] = []
        with httpx.stream(
            "POST",
            f"{gateway.url}/v1/completions",
            json={**body, "stream": True},
            headers=gateway.headers,
            timeout=httpx.Timeout(10.0, read=5.0),  # a hang would raise ReadTimeout
        ) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line:
                    continue
                events.append(line)
                if len(events) == 3:
                    engine.kill()  # SIGKILL
                    killed = time.monotonic()
        ended = time.monotonic() - killed
        assert ended < 5.0
        assert events[-1] == "data: [DONE]"
        error = json.loads(events[-2].removeprefix("data: "))["error"]
        assert error["type"] == "service_unavailable_error"
        assert error["code"] == "engine_unavailable"

        health = _wait_status(gateway.url, 503, timeout=5)
        assert health.status_code == 503
        assert health.json()["error"]["code"] == "engine_unavailable"
        down = httpx.post(
            f"{gateway.url}/v1/completions", json=body, headers=gateway.headers, timeout=10
        )
        assert down.status_code == 503
        assert down.json()["error"]["type"] == "service_unavailable_error"

        time.sleep(3)  # down long enough for the reconnect backoff to reach its cap
        engine = Engine(cache_dir, log_dir, port=engine.port).wait_ready()
        ready = time.monotonic()
        assert _wait_status(gateway.url, 200, timeout=15).status_code == 200
        assert time.monotonic() - ready < 1.0  # serving again within 1 s of readiness
        r2 = httpx.post(
            f"{gateway.url}/v1/completions",
            json={**body, "max_tokens": 5},
            headers=gateway.headers,
            timeout=20,
        )
        assert r2.status_code == 200, r2.text
        assert r2.json()["usage"]["completion_tokens"] == 5
    finally:
        gateway.stop()
        engine.kill()
