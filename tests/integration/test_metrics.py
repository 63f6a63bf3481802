"""The real engine's phase times and cache facts on the wire, and the vLLM metrics the gateway
makes of them after real requests (the session gateway is shared: figures are compared as
differences over this test's requests)."""

from __future__ import annotations

import grpc
import httpx
import openai
import pytest

from protos.tandem.engine.v1 import engine_pb2 as pb
from protos.tandem.engine.v1 import engine_pb2_grpc as pb_grpc
from tests.frontend.test_metrics_scrape import Scrape
from tests.integration.grpc_util import add_request, generate
from tests.integration.harness import MODEL, Engine, Gateway

pytestmark = pytest.mark.timeout(60)


def test_phase_times_come_with_the_first_token_and_the_last_output(
    channel: grpc.Channel,
) -> None:
    stub = pb_grpc.EngineStub(channel)
    outputs = [r.output for r in generate(stub, add_request("phases", [300, 301, 302], 4))]
    assert [len(o.new_token_ids) for o in outputs] == [1, 1, 1, 1]
    first, *middle, last = outputs
    assert not [o for o in middle if o.HasField("queued_time_s") or o.HasField("decode_time_s")]
    assert first.HasField("queued_time_s") and first.HasField("prefill_time_s")
    assert not first.HasField("decode_time_s")
    assert first.queued_time_s >= 0 and first.prefill_time_s > 0
    assert last.finish_reason == pb.FINISH_REASON_LENGTH
    assert (last.queued_time_s, last.prefill_time_s) == (first.queued_time_s, first.prefill_time_s)
    assert last.decode_time_s > 0


def test_model_info_has_the_cache_facts(channel: grpc.Channel) -> None:
    info = pb_grpc.EngineStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert info.enable_prefix_caching is True
    assert info.kv_cache_dtype == "float32"  # the CPU's dtype for the tiny model


def _scrape(gateway: Gateway) -> Scrape:
    r = httpx.get(f"{gateway.url}/metrics", timeout=5)
    assert r.status_code == 200
    return Scrape(r.text)


def test_vllm_metrics_after_real_requests(
    gateway: Gateway, engine: Engine, client: openai.OpenAI
) -> None:
    model = {"model_name": MODEL}
    mine = {**model, "engine": engine.address}
    before = _scrape(gateway)
    prompts = [[300 + i, 301, 302, 303] for i in range(3)]
    for prompt in prompts:
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0)
        assert r.choices[0].finish_reason == "length"
    after = _scrape(gateway)

    def grew(name: str, **labels: str) -> float:
        return after.total(name, **labels) - before.total(name, **labels)

    assert grew("vllm:request_success_total", **model, finished_reason="length") == 3
    for phase in ("queue", "prefill", "decode", "inference"):
        assert grew(f"vllm:request_{phase}_time_seconds_count", **model) == 3, phase
    assert grew("vllm:request_prefill_time_seconds_sum", **model) > 0
    assert grew("vllm:request_decode_time_seconds_sum", **model) > 0
    assert grew("vllm:request_queue_time_seconds_sum", **model) >= 0
    assert grew("vllm:time_to_first_token_seconds_count", **model) == 3
    # One observation per output after the first: outputs merge (a full engine window, a write
    # still in progress, a reader that lags), so 5 tokens give 0-4 of them, not one per token.
    assert 1 <= grew("vllm:inter_token_latency_seconds_count", **model) <= 3 * 4
    assert grew("vllm:prompt_tokens_total", **mine) == 12
    assert grew("vllm:generation_tokens_total", **mine) == 15
    assert grew("vllm:iteration_tokens_total_sum", **mine) == 27
    assert grew("vllm:iteration_tokens_total_count", **mine) >= 5
    assert after.get("vllm:num_requests_running", **mine) == 0
    assert after.total("vllm:prefix_cache_queries_total", **mine) >= 12
    info = {
        **mine,
        "block_size": "16",
        "num_gpu_blocks": "4096",
        "enable_prefix_caching": "True",
        "cache_dtype": "float32",
    }
    assert after.get("vllm:cache_config_info", **info) == 1
