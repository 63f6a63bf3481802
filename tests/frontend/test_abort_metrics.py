"""A sequence the gateway aborts because its client left counts once in
``vllm:request_success_total{finished_reason="abort"}``, as vLLM counts it; the engine's own
report of that abort, arriving later, adds nothing."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from frontend_svc.server.metrics import Metrics
from protos.types import EngineOutput, FinishReason
from tests.frontend.fake_engine import MODEL_NAME, FakeEngine
from tests.frontend.harness import GatewayServer, wait_for
from tests.frontend.test_metrics_scrape import scrape

pytestmark = pytest.mark.timeout(40)

LONG = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 240}  # ~1 s on the fake engine
SUCCESS = "vllm:request_success_total"


@pytest.fixture()
def gateway(own_gateway: GatewayServer) -> GatewayServer:
    return own_gateway


def successes(gateway: GatewayServer, reason: str) -> float:
    return scrape(gateway.url).get(SUCCESS, model_name=MODEL_NAME, finished_reason=reason)


def leave_stream_after_first_chunk(gateway: GatewayServer, **fields: object) -> str:
    body = {**LONG, "stream": True, **fields}
    with httpx.stream("POST", f"{gateway.url}/v1/completions", json=body, timeout=10) as r:
        first = next(line for line in r.iter_lines() if line.startswith("data: "))
    return str(json.loads(first[len("data: ") :])["id"])


def settled(engine: FakeEngine, request_id: str, n: int) -> None:
    """The engine aborted the request's ``n`` sequences, and its abort outputs had time to
    reach the gateway (which no longer listens to them)."""

    def aborted() -> bool:
        return sum(rid.startswith(request_id) for rid in engine.aborted) == n

    wait_for(aborted, 5, "the engine's aborts")
    time.sleep(0.2)


def test_a_client_leaving_a_stream_counts_one_abort(
    gateway: GatewayServer, engine: FakeEngine
) -> None:
    assert successes(gateway, "abort") == 0
    request_id = leave_stream_after_first_chunk(gateway)
    settled(engine, request_id, 1)
    figures = scrape(gateway.url)
    assert figures.get(SUCCESS, model_name=MODEL_NAME, finished_reason="abort") == 1
    assert figures.total(SUCCESS) == 1  # nothing else: not a length, not twice
    assert figures.get("vllm:e2e_request_latency_seconds_count", model_name=MODEL_NAME) == 1
    assert figures.get("vllm:request_generation_tokens_count", model_name=MODEL_NAME) == 1


def test_every_sequence_of_a_request_left_counts(
    gateway: GatewayServer, engine: FakeEngine
) -> None:
    request_id = leave_stream_after_first_chunk(gateway, n=2)
    settled(engine, request_id, 2)
    assert successes(gateway, "abort") == 2  # as vLLM counts each of n child requests


def test_a_client_leaving_a_non_streamed_request_counts_one_abort(
    gateway: GatewayServer, engine: FakeEngine
) -> None:
    before = len(engine.aborted)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{gateway.url}/v1/completions", json=LONG, timeout=0.3)
    wait_for(lambda: len(engine.aborted) == before + 1, 5, "the abort")
    time.sleep(0.2)
    assert successes(gateway, "abort") == 1
    assert scrape(gateway.url).total(SUCCESS) == 1


def test_requests_that_end_are_not_aborts(gateway: GatewayServer, engine: FakeEngine) -> None:
    """Finished by length, and ended by a stop string (the gateway aborts the engine request,
    but the sequence finished: "stop")."""
    short = {**LONG, "max_tokens": 3}
    assert httpx.post(f"{gateway.url}/v1/completions", json=short, timeout=10).status_code == 200
    r = httpx.post(
        f"{gateway.url}/v1/completions", json={**LONG, "stop": [" "], "stream": True}, timeout=10
    )
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
    time.sleep(0.2)
    figures = scrape(gateway.url)
    assert figures.get(SUCCESS, model_name=MODEL_NAME, finished_reason="length") == 1
    assert figures.get(SUCCESS, model_name=MODEL_NAME, finished_reason="stop") == 1
    assert figures.get(SUCCESS, model_name=MODEL_NAME, finished_reason="abort") == 0


def test_a_sequence_is_counted_once_however_it_ends() -> None:
    metrics = Metrics("m")
    timer = metrics.sequence(4)
    timer.observe(EngineOutput("r", (1,), finish_reason=FinishReason.LENGTH), "length")
    timer.aborted()  # closed after its last output: nothing more
    left = metrics.sequence(4)
    left.observe(EngineOutput("s", (1,)), None)
    left.aborted()
    left.aborted()
    counts = {
        s.labels["finished_reason"]: s.value
        for family in metrics.registry.collect()
        if family.name == "vllm:request_success"
        for s in family.samples
        if s.name.endswith("_total")
    }
    assert counts == {"length": 1.0, "abort": 1.0}
