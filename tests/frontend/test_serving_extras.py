"""vLLM's smaller serving features: GET /load, GET /tokenizer_info, POST /invocations, ORCA
load reports and --root-path, through the real gateway and the fake engine."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from frontend_svc.config import config_from_args
from tests.frontend.fake_engine import MODEL_NAME, FakeEngine
from tests.frontend.harness import GatewayServer

pytestmark = pytest.mark.timeout(30)
KEY = "k"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def extras(engine: FakeEngine) -> Iterator[GatewayServer]:
    g = GatewayServer(
        engine.address,
        api_key=KEY,
        enable_server_load_tracking=True,
        enable_tokenizer_info_endpoint=True,
        root_path="/llm",
    ).start()
    g.wait_healthy()
    yield g
    g.stop()


def post(g: GatewayServer, path: str, body: dict[str, Any], **headers: str) -> httpx.Response:
    return httpx.post(f"{g.url}{path}", json=body, headers={**AUTH, **headers}, timeout=10)


COMPLETION = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 3}
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


def test_load_counts_the_requests_being_served(extras: GatewayServer) -> None:
    def load() -> int:
        r = httpx.get(f"{extras.url}/load", headers=AUTH, timeout=5)
        assert r.status_code == 200, r.text
        return int(r.json()["server_load"])

    assert load() == 0
    body = {**COMPLETION, "max_tokens": 40, "stream": True}
    with httpx.stream(
        "POST", f"{extras.url}/v1/completions", json=body, headers=AUTH, timeout=10
    ) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")  # streaming: the request is in progress
        assert load() == 1
        for _ in lines:
            pass
    assert load() == 0
    assert post(extras, "/v1/completions", COMPLETION).status_code == 200
    assert load() == 0


def test_disabled_endpoints_are_404_and_left_out_of_the_document(
    gateway: GatewayServer,
) -> None:
    for path in ("/load", "/tokenizer_info"):
        assert httpx.get(f"{gateway.url}{path}", timeout=5).status_code == 404
    doc = httpx.get(f"{gateway.url}/openapi.json", timeout=5).json()
    assert "/load" not in doc["paths"] and "/tokenizer_info" not in doc["paths"]


def test_tokenizer_info(extras: GatewayServer) -> None:
    r = httpx.get(f"{extras.url}/tokenizer_info", headers=AUTH, timeout=5)
    assert r.status_code == 200, r.text
    info = r.json()
    assert info["tokenizer_class"] and isinstance(info.get("chat_template"), str)
    assert "added_tokens_decoder" not in info
    doc = httpx.get(f"{extras.url}/openapi.json", timeout=5).json()
    assert "/load" in doc["paths"] and "/tokenizer_info" in doc["paths"]


def test_invocations_dispatches_by_body_shape(extras: GatewayServer) -> None:
    chat = post(extras, "/invocations", CHAT)
    assert chat.status_code == 200 and chat.json()["object"] == "chat.completion"
    text = post(extras, "/invocations", COMPLETION)
    assert text.status_code == 200 and text.json()["object"] == "text_completion"
    for body in ({"model": MODEL_NAME}, {"nothing": 1}):
        r = post(extras, "/invocations", body)
        assert r.status_code == 400 and "/invocations takes" in r.json()["error"]["message"]
    bad = post(extras, "/invocations", {**CHAT, "max_tokens": -1})  # the route's own checks
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"


@pytest.mark.parametrize("fmt", ["text", "JSON"])
def test_orca_load_report(extras: GatewayServer, fmt: str) -> None:
    r = post(extras, "/v1/completions", COMPLETION, **{"endpoint-load-metrics-format": fmt})
    assert r.status_code == 200
    report = r.headers["endpoint-load-metrics"]
    if fmt == "text":
        assert report.startswith("TEXT named_metrics.kv_cache_utilization=")
        assert "named_metrics.num_requests_waiting=0" in report
    else:
        assert report.startswith("JSON ")
        metrics = json.loads(report.removeprefix("JSON "))["named_metrics"]
        assert set(metrics) == {"kv_cache_utilization", "num_requests_waiting"}
    plain = post(extras, "/v1/completions", COMPLETION)
    assert "endpoint-load-metrics" not in plain.headers


def test_root_path_serves_under_the_prefix(extras: GatewayServer) -> None:
    assert httpx.get(f"{extras.url}/llm/health", timeout=5).status_code == 200  # public there too
    assert post(extras, "/llm/v1/completions", COMPLETION).status_code == 200
    assert post(extras, "/v1/completions", COMPLETION).status_code == 200
    unauthorized = httpx.post(f"{extras.url}/llm/v1/completions", json=COMPLETION, timeout=5)
    assert unauthorized.status_code == 401
    page = httpx.get(f"{extras.url}/llm/docs", timeout=5).text
    assert "/llm/openapi.json" in page


def test_root_path_must_be_a_path() -> None:
    assert config_from_args(["--root-path", "/llm"], {}).root_path == "/llm"
    for bad in ("llm", "/llm/"):
        with pytest.raises(SystemExit):
            config_from_args(["--root-path", bad], {})
