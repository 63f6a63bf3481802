"""Disconnects abort engine requests; a dead engine gives prompt errors, 503s, then recovery."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from tokenizers import Tokenizer

from tests.frontend.conftest import make_engine
from tests.frontend.fake_engine import MODEL_NAME, FakeEngine
from tests.frontend.harness import GatewayServer, free_port, wait_for

pytestmark = pytest.mark.timeout(40)

LONG = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 240}  # ~1 s on the fake engine


def test_streaming_disconnect_aborts(gateway: GatewayServer, engine: FakeEngine) -> None:
    before = set(engine.aborted)
    with httpx.stream(
        "POST", f"{gateway.url}/v1/completions", json={**LONG, "stream": True}, timeout=10
    ) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        request_id = json.loads(first[len("data: ") :])["id"]
        assert engine.num_in_flight == 1
    # leaving the block closed the connection mid-stream
    wait_for(lambda: engine.num_in_flight == 0, 5, "the abort")
    aborted = set(engine.aborted) - before
    assert [rid for rid in aborted if rid.startswith(request_id)], (request_id, aborted)


def test_non_streaming_disconnect_aborts(gateway: GatewayServer, engine: FakeEngine) -> None:
    before = set(engine.aborted)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{gateway.url}/v1/completions", json=LONG, timeout=0.3)
    wait_for(lambda: engine.num_in_flight == 0, 5, "the abort")
    assert set(engine.aborted) - before


@pytest.fixture()
def own_engine(tokenizer_dir: Path, hf_tokenizer: Tokenizer) -> Iterator[FakeEngine]:
    e = make_engine(tokenizer_dir, hf_tokenizer)
    e.start()
    yield e
    e.stop()


def test_engine_down_at_start_is_503_then_recovers(
    tokenizer_dir: Path, hf_tokenizer: Tokenizer
) -> None:
    port = free_port()
    g = GatewayServer(f"127.0.0.1:{port}").start()
    engine = make_engine(tokenizer_dir, hf_tokenizer)
    try:
        r = httpx.get(f"{g.url}/health")
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
        assert httpx.get(f"{g.url}/live").status_code == 200
        client = openai.OpenAI(base_url=f"{g.url}/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.InternalServerError) as e:
            client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=2)
        assert e.value.status_code == 503
        engine.start(port)
        g.wait_healthy()
        assert client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=2).choices
    finally:
        g.stop()
        engine.stop()


def test_engine_killed_mid_stream(own_engine: FakeEngine) -> None:
    g = GatewayServer(own_engine.address).start()
    try:
        g.wait_healthy()
        body = {**LONG, "stream": True}
        with httpx.stream("POST", f"{g.url}/v1/completions", json=body, timeout=10) as r:
            lines = (line for line in r.iter_lines() if line)
            assert next(lines).startswith("data: {")
            own_engine.stop()
            killed = time.monotonic()
            rest = list(lines)
        assert time.monotonic() - killed < 2.0
        assert rest[-1] == "data: [DONE]"
        error = json.loads(rest[-2][len("data: ") :])["error"]
        assert error["code"] == "engine_unavailable"
        g.wait_healthy(expected=503, timeout=5)

        own_engine.start(int(g.config.engine_address.rsplit(":", 1)[1]))
        g.wait_healthy(timeout=10)
        client = openai.OpenAI(base_url=f"{g.url}/v1", api_key="x", max_retries=0)
        assert client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=3).choices
    finally:
        g.stop()


def test_openai_stream_raises_when_engine_dies(own_engine: FakeEngine) -> None:
    g = GatewayServer(own_engine.address).start()
    try:
        g.wait_healthy()
        client = openai.OpenAI(base_url=f"{g.url}/v1", api_key="x", max_retries=0)
        stream = client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=240,
            stream=True,
        )
        with pytest.raises(openai.APIError):
            for i, _ in enumerate(stream):
                if i == 2:
                    own_engine.stop()
    finally:
        g.stop()
