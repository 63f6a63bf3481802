"""The engine's utility calls through the real gateway in front of the real engine
(--enable-utility-endpoints): /sleep, /is_sleeping, /wake_up, /reset_prefix_cache,
/start_profile and /stop_profile. A sleeping engine refuses completions with 503 and the
gateway's /health is 503; after /wake_up the same greedy tokens come back."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.integration.harness import MODEL, Engine, Gateway

pytestmark = pytest.mark.timeout(300)
PROMPT = [300, 301, 302, 303, 304, 305, 306, 307, 308, 309, 310, 311, 312, 313, 314, 315, 316]


@pytest.fixture(scope="module")
def gateway(
    cache_dir: Path, log_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Gateway, Path]]:
    profile_dir = tmp_path_factory.mktemp("profiles")
    engine = Engine(cache_dir, log_dir, "--profile-dir", str(profile_dir))
    gw: Gateway | None = None
    try:
        engine.wait_ready()
        gw = Gateway(
            engine.address,
            cache_dir,
            log_dir,
            "--enable-utility-endpoints",
            "--enable-prompt-tokens-details",
        )
        yield gw.wait_healthy(), profile_dir
    finally:
        if gw is not None:
            gw.stop()
        engine.stop()


def call(gw: Gateway, method: str, path: str) -> httpx.Response:
    return httpx.request(method, f"{gw.url}{path}", headers=gw.headers, timeout=60)


def tokens(gw: Gateway) -> httpx.Response:
    body = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    return httpx.post(f"{gw.url}/v1/completions", json=body, headers=gw.headers, timeout=60)


def health_becomes(gw: Gateway, status: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if httpx.get(f"{gw.url}/health", timeout=10).status_code == status:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_refuses_work_and_wake_up_gives_the_same_tokens(
    gateway: tuple[Gateway, Path], level: int
) -> None:
    gw, _ = gateway
    before = tokens(gw)
    assert before.status_code == 200, before.text
    assert call(gw, "GET", "/is_sleeping").json() == {"is_sleeping": False}
    assert call(gw, "POST", f"/sleep?level={level}").status_code == 200
    assert call(gw, "GET", "/is_sleeping").json() == {"is_sleeping": True}
    refused = tokens(gw)
    assert refused.status_code == 503, refused.text
    assert refused.json()["error"]["message"]
    assert health_becomes(gw, 503)  # the gateway follows the engine's health (Watch)
    assert call(gw, "POST", "/wake_up").status_code == 200
    gw.wait_healthy()
    assert call(gw, "GET", "/is_sleeping").json() == {"is_sleeping": False}
    after = tokens(gw)
    assert after.status_code == 200, after.text
    first = before.json()["choices"][0]["token_ids"]
    assert after.json()["choices"][0]["token_ids"] == first and len(first) == 8


def test_reset_prefix_cache_and_profile(gateway: tuple[Gateway, Path]) -> None:
    gw, profile_dir = gateway
    assert tokens(gw).status_code == 200
    cached = tokens(gw).json()["usage"].get("prompt_tokens_details") or {}
    assert cached.get("cached_tokens", 0) > 0, cached  # the prompt's full blocks are cached
    r = call(gw, "POST", "/reset_prefix_cache")
    assert r.status_code == 200 and r.json() == {"success": True}, r.text
    fresh = tokens(gw).json()["usage"].get("prompt_tokens_details") or {}
    assert fresh.get("cached_tokens", 0) == 0, fresh
    assert call(gw, "POST", "/start_profile").status_code == 200
    assert tokens(gw).status_code == 200
    r = call(gw, "POST", "/stop_profile")
    assert r.status_code == 200, r.text
    paths = [Path(p) for p in r.json()["trace_paths"]]
    assert paths and all(p.parent == profile_dir and p.stat().st_size > 0 for p in paths)
