"""A client that goes away mid-request frees the engine: no running request, no KV block used.

The engine's load figures reach the gateway with every engine message and are served as
Prometheus gauges; after the abort they must read exactly zero again, well before the same
request run to its end would have finished (so it was aborted, not left to run out).
"""

from __future__ import annotations

import json
import socket
import time
from urllib.parse import urlsplit

import httpx
import pytest

from tests.integration.harness import MODEL, Gateway
from tests.integration.metrics_util import KV_USAGE, RUNNING, finished, wait_for

pytestmark = pytest.mark.timeout(60)
LONG = {"model": MODEL, "prompt": "Hello world", "max_tokens": 1900, "ignore_eos": True}
IDLE = {RUNNING: 0.0, KV_USAGE: 0.0}


@pytest.fixture(autouse=True)
def _baseline(gateway: Gateway) -> None:
    """A finished request first, so the gauges exist; the idle engine then reads zero."""
    r = httpx.post(
        f"{gateway.url}/v1/completions",
        json={"model": MODEL, "prompt": "Hi", "max_tokens": 2},
        headers=gateway.headers,
        timeout=20,
    )
    assert r.status_code == 200, r.text
    assert wait_for(gateway.url, running=0) == IDLE


@pytest.fixture(scope="module")
def whole_s(gateway: Gateway) -> float:
    """Seconds the long request takes run to its end (~1.5 s on a 2-core CPU)."""
    t = time.monotonic()
    r = httpx.post(f"{gateway.url}/v1/completions", json=LONG, headers=gateway.headers, timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length", r.text
    return time.monotonic() - t


def _assert_aborted(gateway: Gateway, since: float, whole_s: float, before: dict) -> None:
    """Idle again well before the whole run's time (typically a tenth of it), no completion
    counted for the request (the engine stopped it), and one abort counted, as vLLM does."""
    assert wait_for(gateway.url, running=0) == IDLE
    gone = time.monotonic() - since
    assert gone < 0.6 * whole_s, (gone, whole_s)
    after = finished(gateway.url)
    assert before.get("length", 0.0) > 0, before  # the counter is read (earlier requests)
    assert after.get("length", 0.0) == before.get("length", 0.0), (before, after)
    assert after.get("abort", 0.0) == before.get("abort", 0.0) + 1, (before, after)


def test_streaming_client_disconnect(gateway: Gateway, whole_s: float) -> None:
    before = finished(gateway.url)
    t = time.monotonic()
    with httpx.Client(timeout=20) as http:
        with http.stream(
            "POST",
            f"{gateway.url}/v1/completions",
            json={**LONG, "stream": True},
            headers=gateway.headers,
        ) as r:
            assert r.status_code == 200
            events = 0
            for line in r.iter_lines():
                events += line.startswith("data: {")
                if events == 3:
                    busy = wait_for(gateway.url, running=1, busy=True)
                    assert busy[RUNNING] == 1.0 and busy[KV_USAGE] > 0.0, busy
                    break  # closing the line iterator drops the connection mid-stream
    _assert_aborted(gateway, t, whole_s, before)


def test_non_streaming_client_gone_mid_request(gateway: Gateway, whole_s: float) -> None:
    """A non-streaming client that gives up (a read timeout closes its socket) while the gateway
    waits for the whole completion. The test closes the socket itself once the engine runs the
    request: a client-side timer raced the engine (1900 tokens took ~1.5 s, the timeout was
    1.5 s, and CI once saw the request finish first)."""
    host, port = urlsplit(gateway.url).hostname, urlsplit(gateway.url).port
    assert host is not None and port is not None
    body = json.dumps(LONG).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
        f"Authorization: {gateway.headers['Authorization']}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    before = finished(gateway.url)
    t = time.monotonic()
    with socket.create_connection((host, port), timeout=10) as client:
        client.sendall(head + body)
        busy = wait_for(gateway.url, running=1, busy=True)
        assert busy[RUNNING] == 1.0 and busy[KV_USAGE] > 0.0, busy
        client.shutdown(socket.SHUT_RDWR)
    _assert_aborted(gateway, t, whole_s, before)
