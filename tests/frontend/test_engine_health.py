"""The gateway follows an engine's grpc.health.v1 status (the engine's own verdict, pushed by
Watch): NOT_SERVING takes it out of rotation at once, SERVING brings it back, and a watch that
breaks while the engine's stream stays up is opened again instead of leaving the engine out."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
from tokenizers import Tokenizer

from tests.frontend.conftest import make_engine
from tests.frontend.fake_engine import MODEL_NAME
from tests.frontend.harness import GatewayServer, wait_for

pytestmark = pytest.mark.timeout(60)
BODY = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 2}


def test_gateway_follows_engine_health(tokenizer_dir: Path, hf_tokenizer: Tokenizer) -> None:
    engine = make_engine(tokenizer_dir, hf_tokenizer, health=True)
    engine.start()
    gateway = GatewayServer(engine.address).start()
    assert engine.health is not None
    try:
        gateway.wait_healthy()
        engine.health.serving = False
        started = time.monotonic()
        gateway.wait_healthy(expected=503)
        assert time.monotonic() - started < 1.0
        r = httpx.post(f"{gateway.url}/v1/completions", json=BODY, timeout=10)
        assert r.status_code == 503 and r.headers["retry-after"]
        assert "not serving" in r.json()["error"]["message"]
        engine.health.serving = True
        gateway.wait_healthy()
        assert httpx.post(f"{gateway.url}/v1/completions", json=BODY).status_code == 200

        # The watch breaks (a proxy reset), the engine stream does not: watched again.
        opened = engine.health.watches_opened
        engine.health.reset_watches()
        wait_for(lambda: engine.health.watches_opened > opened, 5, "the watch re-opened")
        gateway.wait_healthy()
        assert httpx.post(f"{gateway.url}/v1/completions", json=BODY).status_code == 200
    finally:
        gateway.stop()
        engine.stop()
