"""/metrics scraped after real requests through the gateway: every vLLM metric is there with
vLLM's type and the ``model_name`` label, with figures that add up; an engine's gauges go when it
leaves. (The engine's own phase times, from the real engine: tests/integration/test_metrics.py.)"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from tokenizers import Tokenizer

from frontend_svc.engine.pool import EnginePool
from frontend_svc.server.metrics import Metrics, MetricsEvents
from tests.frontend.fake_engine import MODEL_NAME, FakeEngine
from tests.frontend.harness import GatewayServer
from tests.frontend.test_engine_pool import (
    Engines,
    complete,
    entry,
    pool_config,
    request,
    until,
    usable,
)

pytestmark = pytest.mark.timeout(30)

# Family name (as the text format's TYPE line has it) -> type, and whether it is per engine.
VLLM_METRICS = {
    "vllm:num_requests_running": ("gauge", True),
    "vllm:num_requests_waiting": ("gauge", True),
    "vllm:num_requests_waiting_by_reason": ("gauge", True),
    "vllm:kv_cache_usage_perc": ("gauge", True),
    "vllm:gpu_cache_usage_perc": ("gauge", True),
    "vllm:cache_config_info": ("gauge", True),
    "vllm:prompt_tokens": ("counter", True),
    "vllm:generation_tokens": ("counter", True),
    "vllm:iteration_tokens_total": ("histogram", True),
    "vllm:num_preemptions": ("counter", True),
    "vllm:prefix_cache_queries": ("counter", True),
    "vllm:prefix_cache_hits": ("counter", True),
    "vllm:request_success": ("counter", False),
    "vllm:time_to_first_token_seconds": ("histogram", False),
    "vllm:inter_token_latency_seconds": ("histogram", False),
    "vllm:time_per_output_token_seconds": ("histogram", False),
    "vllm:e2e_request_latency_seconds": ("histogram", False),
    "vllm:request_queue_time_seconds": ("histogram", False),
    "vllm:request_prefill_time_seconds": ("histogram", False),
    "vllm:request_decode_time_seconds": ("histogram", False),
    "vllm:request_inference_time_seconds": ("histogram", False),
    "vllm:request_prompt_tokens": ("histogram", False),
    "vllm:request_generation_tokens": ("histogram", False),
    "vllm:request_params_n": ("histogram", False),
    "vllm:request_params_max_tokens": ("histogram", False),
}


class Scrape:
    """One /metrics text, parsed: sample values by (name, labels) and family types."""

    def __init__(self, text: str) -> None:
        self.values: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
        self.types: dict[str, str] = {}
        self.labels: dict[str, list[dict[str, str]]] = {}
        for family in text_string_to_metric_families(text):
            self.types[family.name] = family.type
            for s in family.samples:
                self.values[(s.name, frozenset(s.labels.items()))] = s.value
                self.labels.setdefault(s.name, []).append(s.labels)

    def get(self, name: str, **labels: str) -> float:
        return self.values[(name, frozenset(labels.items()))]

    def total(self, name: str, **labels: str) -> float:
        """The sum over every series of ``name`` that has ``labels``."""
        want = set(labels.items())
        return sum(v for (n, ls), v in self.values.items() if n == name and want <= ls)


def scrape(url: str) -> Scrape:
    r = httpx.get(f"{url}/metrics", timeout=5)
    assert r.status_code == 200
    return Scrape(r.text)


@pytest.fixture()
def fleet(tokenizer_dir: Path, hf_tokenizer: Tokenizer) -> Iterator[Engines]:
    engines = Engines(tokenizer_dir, hf_tokenizer)
    yield engines
    engines.stop()


@pytest.fixture()
def gateway(own_gateway: GatewayServer) -> GatewayServer:
    return own_gateway


def test_every_vllm_metric_after_real_requests(gateway: GatewayServer, engine: FakeEngine) -> None:
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0, timeout=10)
    usages = []
    for _ in range(2):
        r = client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=3)
        assert r.choices[0].finish_reason == "length"
        usages.append(r.usage)
    r = client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=60, stop=["fox"])
    assert r.choices[0].finish_reason == "stop"  # a stop string: the gateway ended it
    usages.append(r.usage)
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], max_completion_tokens=4
    )
    assert chat.choices[0].finish_reason == "length"
    usages.append(chat.usage)
    prompt = sum(u.prompt_tokens for u in usages if u)
    completion = sum(u.completion_tokens for u in usages if u)

    m = scrape(gateway.url)
    model = {"model_name": MODEL_NAME}
    mine = {**model, "engine": engine.address}
    for name, (kind, per_engine) in VLLM_METRICS.items():
        assert m.types.get(name) == kind, name
        sample = name + {"counter": "_total", "histogram": "_count", "gauge": ""}[kind]
        for labels in m.labels[sample]:
            assert labels["model_name"] == MODEL_NAME, (name, labels)
            assert ("engine" in labels) is per_engine, (name, labels)
    ours = {n.removesuffix("_created") for n in m.types if n.startswith("tandem:")}
    assert ours == {"tandem:engine_requests"}  # the only name vLLM has no equivalent of

    # Every finished sequence: one success by its reason, one of each latency, one of each phase.
    assert m.get("vllm:request_success_total", **model, finished_reason="length") == 3
    assert m.get("vllm:request_success_total", **model, finished_reason="stop") == 1
    for name in (
        "time_to_first_token_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
        "request_prefill_time_seconds",
        "request_decode_time_seconds",
        "request_inference_time_seconds",
        "request_prompt_tokens",
        "request_generation_tokens",
    ):
        assert m.get(f"vllm:{name}_count", **model) == 4, name
    assert m.get("vllm:request_prompt_tokens_sum", **model) == prompt
    # The request parameters, once per sequence (vLLM's request_params histograms).
    assert m.get("vllm:request_params_n_count", **model) == 4
    assert m.get("vllm:request_params_n_sum", **model) == 4
    assert m.get("vllm:request_params_max_tokens_count", **model) == 4
    assert m.get("vllm:request_params_max_tokens_sum", **model) == 3 + 3 + 60 + 4
    assert m.get("vllm:request_generation_tokens_sum", **model) == completion
    itl = m.get("vllm:inter_token_latency_seconds_count", **model)
    assert 1 <= itl <= completion - 4
    assert m.get("vllm:time_per_output_token_seconds_count", **model) == itl
    phases = {
        p: m.get(f"vllm:request_{p}_time_seconds_sum", **model) for p in ("prefill", "decode")
    }
    assert all(v > 0 for v in phases.values()), phases
    inference = m.get("vllm:request_inference_time_seconds_sum", **model)
    assert inference == pytest.approx(phases["prefill"] + phases["decode"])
    assert m.get("vllm:e2e_request_latency_seconds_sum", **model) >= inference

    # Tokens per engine message, counted as vLLM's front end counts them.
    assert m.get("vllm:prompt_tokens_total", **mine) == prompt
    generated = m.get("vllm:generation_tokens_total", **mine)
    assert generated >= completion  # the stop string's sequence may have had a token more
    assert m.get("vllm:iteration_tokens_total_sum", **mine) == prompt + generated
    assert m.get("vllm:iteration_tokens_total_count", **mine) >= 4
    assert m.get("vllm:iteration_tokens_total_bucket", **mine, le="+Inf") >= 4

    # The engine's load and cache facts.
    assert m.get("vllm:num_requests_running", **mine) == 0
    assert m.get("vllm:kv_cache_usage_perc", **mine) == m.get("vllm:gpu_cache_usage_perc", **mine)
    assert m.total("vllm:prefix_cache_queries_total", **mine) >= prompt
    info = {
        **mine,
        "block_size": str(engine.block_size),
        "num_gpu_blocks": "64",
        "enable_prefix_caching": "True",
        "cache_dtype": "float32",
    }
    assert m.get("vllm:cache_config_info", **info) == 1
    assert m.total("tandem:engine_requests_total", **mine) == 4


def test_an_engines_load_gauges_are_zero_before_its_first_request(
    gateway: GatewayServer, engine: FakeEngine
) -> None:
    """As vLLM exports them from start-up: an autoscaler or alert reading them must not find
    the series missing until the first request."""
    mine = {"model_name": MODEL_NAME, "engine": engine.address}
    m = scrape(gateway.url)
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc",
    ):
        assert m.get(name, **mine) == 0, name
    for reason in ("capacity", "deferred"):
        assert m.get("vllm:num_requests_waiting_by_reason", reason=reason, **mine) == 0
    assert m.get("vllm:request_params_n_count", model_name=MODEL_NAME) == 0


def test_n_is_observed_per_sequence(gateway: GatewayServer) -> None:
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0, timeout=10)
    client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=2, n=3)
    m = scrape(gateway.url)
    assert m.get("vllm:request_params_n_count", model_name=MODEL_NAME) == 3
    assert m.get("vllm:request_params_n_bucket", model_name=MODEL_NAME, le="2.0") == 0
    assert m.get("vllm:request_params_n_bucket", model_name=MODEL_NAME, le="5.0") == 3


def test_gauges_of_an_engine_that_left_are_removed(fleet: Engines) -> None:
    a = fleet.start()
    b = fleet.start(a.port, host="127.0.0.2")  # another "pod" behind the same DNS name
    name = "engines.test"
    answers = ["127.0.0.1", "127.0.0.2"]
    metrics = Metrics(MODEL_NAME)

    async def scenario() -> None:
        nonlocal answers
        loop = asyncio.get_running_loop()
        real_getaddrinfo = loop.getaddrinfo

        async def getaddrinfo(host: str, port: int, **kwargs: Any) -> list[Any]:
            if host != name:
                return await real_getaddrinfo(host, port, **kwargs)
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port)) for ip in answers]

        loop.getaddrinfo = getaddrinfo  # type: ignore[assignment,method-assign]
        pool = EnginePool(
            pool_config(f"dns:///{name}:{a.port}", resolve_interval_s=0.05),
            MetricsEvents(metrics),
        )
        pool.start()
        try:
            await until(lambda: usable(pool) == {a.address, b.address}, "both engines")
            await asyncio.gather(*(complete(pool, request(f"r{k}")) for k in range(4)))
            assert a.added and b.added
            before = Scrape(metrics.exposition().decode())
            answers = ["127.0.0.1"]  # b leaves DNS
            await until(lambda: entry(pool, b.address) is None, "b to be retired")
        finally:
            await pool.close()
        after = Scrape(metrics.exposition().decode())
        for gauge in (n for n, (kind, _) in VLLM_METRICS.items() if kind == "gauge"):
            assert [ls for ls in before.labels[gauge] if ls["engine"] == b.address], gauge
            assert not [ls for ls in after.labels[gauge] if ls["engine"] == b.address], gauge
            assert [ls for ls in after.labels[gauge] if ls["engine"] == a.address], gauge
        for counter in ("vllm:generation_tokens_total", "vllm:prefix_cache_queries_total"):
            assert after.total(counter, engine=b.address) > 0  # totals stay

    fleet.run(scenario())
