"""A client that goes away mid-request frees the engine: no running request, no KV block used.

The engine's load figures reach the gateway with every engine message and are served as
Prometheus gauges; after the abort they must read exactly zero again.
"""

from __future__ import annotations

import threading

import httpx
import pytest

from tests.integration.harness import MODEL, Gateway
from tests.integration.metrics_util import KV_USAGE, RUNNING, wait_for

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


def test_streaming_client_disconnect(gateway: Gateway) -> None:
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
    assert wait_for(gateway.url, running=0) == IDLE


def test_non_streaming_client_timeout(gateway: Gateway) -> None:
    outcome: list[BaseException] = []

    def impatient() -> None:
        try:
            httpx.post(
                f"{gateway.url}/v1/completions",
                json=LONG,
                headers=gateway.headers,
                timeout=httpx.Timeout(10.0, read=1.5),
            )
        except BaseException as e:  # the read timeout is the point
            outcome.append(e)

    thread = threading.Thread(target=impatient)
    thread.start()
    busy = wait_for(gateway.url, running=1, busy=True)
    assert busy[RUNNING] == 1.0 and busy[KV_USAGE] > 0.0, busy
    thread.join(10)
    assert len(outcome) == 1 and isinstance(outcome[0], httpx.ReadTimeout), outcome
    assert wait_for(gateway.url, running=0) == IDLE
