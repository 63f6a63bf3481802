"""The gateway's metrics as vLLM names them: per-engine load (labelled by engine, totals turned
into counters, gone with the engine), tokens per engine message, and per-sequence timings."""

from __future__ import annotations

import dataclasses
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from frontend_svc.server.metrics import Metrics, length_buckets, observe_many
from protos.types import EngineOutput, FinishReason, LoadFigures, ModelInfo

INFO = ModelInfo(
    served_model_name="m",
    max_model_len=300,
    vocab_size=100,
    eos_token_ids=(1,),
    bos_token_id=0,
    block_size=16,
    num_kv_blocks=64,
    kv_capacity_tokens=1024,
    max_logprobs=5,
    enable_prefix_caching=True,
    kv_cache_dtype="bfloat16",
)


GAUGES = {
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:num_requests_waiting_by_reason",
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
    "vllm:cache_config_info",
}


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def samples(metrics: Metrics) -> Samples:
    found = {}
    for family in text_string_to_metric_families(metrics.exposition().decode()):
        for s in family.samples:
            if not s.name.endswith("_created"):
                found[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return found


def value(metrics: Metrics, name: str, **labels: str) -> float | None:
    return samples(metrics).get((name, tuple(sorted(labels.items()))))


def test_load_is_labelled_per_engine_and_dropped_when_the_engine_leaves() -> None:
    m = Metrics("m")
    m.observe_load("a:1", LoadFigures(num_running=3, prefix_cache_queries=10, prefix_cache_hits=4))
    m.observe_load("b:2", LoadFigures(num_running=1, prefix_cache_queries=5, prefix_cache_hits=5))
    m.observe_load(
        "a:1",
        LoadFigures(
            num_running=2,
            num_waiting=4,
            kv_cache_usage=0.25,
            prefix_cache_queries=30,
            prefix_cache_hits=9,
            num_preemptions=1,
        ),
    )
    a, b = {"model_name": "m", "engine": "a:1"}, {"model_name": "m", "engine": "b:2"}
    assert value(m, "vllm:num_requests_running", **a) == 2
    assert value(m, "vllm:num_requests_waiting", **a) == 4
    assert value(m, "vllm:kv_cache_usage_perc", **a) == 0.25
    assert value(m, "vllm:gpu_cache_usage_perc", **a) == 0.25  # the older name, same figure
    assert value(m, "vllm:num_requests_running", **b) == 1
    assert value(m, "vllm:prefix_cache_hits_total", **a) == 9  # totals become increments
    assert value(m, "vllm:prefix_cache_queries_total", **a) == 30
    assert value(m, "vllm:num_preemptions_total", **a) == 1
    assert value(m, "vllm:prefix_cache_hits_total", **b) == 5
    m.observe_load("a:1", LoadFigures(prefix_cache_hits=2))  # a restarted engine counts anew
    assert value(m, "vllm:prefix_cache_hits_total", **a) == 11
    m.observe_engine_info("a:1", INFO)
    m.forget_engine("a:1")
    left = {name for name, labels in samples(m) if ("engine", "a:1") in labels}
    assert not left & GAUGES
    assert "vllm:prefix_cache_hits_total" in left  # counters stay, as totals do
    assert value(m, "vllm:num_requests_running", **b) == 1
    m.forget_engine("never-seen:3")  # no error


def test_waiting_is_split_by_reason_as_vllm_does() -> None:
    """capacity + deferred = waiting: deferred are the ones the engine steps over for now (a
    grammar compiling, no LoRA slot), the rest wait for room."""
    m = Metrics("m")
    a = {"model_name": "m", "engine": "a:1"}

    def by_reason() -> tuple[float | None, float | None]:
        name = "vllm:num_requests_waiting_by_reason"
        return value(m, name, reason="capacity", **a), value(m, name, reason="deferred", **a)

    m.observe_engine_info("a:1", INFO)
    assert by_reason() == (0, 0)  # exported at zero from the start, as the other gauges
    m.observe_load("a:1", LoadFigures(num_waiting=5, num_waiting_deferred=2))
    assert by_reason() == (3, 2)
    m.observe_load("a:1", LoadFigures(num_waiting=5, num_waiting_deferred=0))
    assert by_reason() == (5, 0)  # waiting unchanged, the split changed: written again
    m.observe_load("a:1", LoadFigures(num_waiting=1, num_waiting_deferred=4))
    assert by_reason() == (0, 1)  # never more deferred than waiting
    m.forget_engine("a:1")
    assert by_reason() == (None, None)


def test_speculative_decoding_counters_as_vllm_names_them() -> None:
    """The engine's cumulative spec-decode totals become vLLM's counters (by their increase,
    per position too); an engine that restarted counts from its new totals."""
    m = Metrics("m")
    a = {"model_name": "m", "engine": "a:1"}
    m.observe_engine_info("a:1", INFO)

    def figures() -> tuple[float | None, ...]:
        return (
            value(m, "vllm:spec_decode_num_drafts_total", **a),
            value(m, "vllm:spec_decode_num_draft_tokens_total", **a),
            value(m, "vllm:spec_decode_num_accepted_tokens_total", **a),
            *(
                value(m, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=p, **a)
                for p in "012"
            ),
        )

    m.observe_load("a:1", LoadFigures(spec_num_drafts=4, spec_num_draft_tokens=12,
                                      spec_num_accepted_tokens=5,
                                      spec_accepted_per_pos=(3, 2)))  # fmt: skip
    assert figures() == (4, 12, 5, 3, 2, None)
    m.observe_load("a:1", LoadFigures(spec_num_drafts=6, spec_num_draft_tokens=18,
                                      spec_num_accepted_tokens=8,
                                      spec_accepted_per_pos=(4, 3, 1)))  # fmt: skip
    assert figures() == (6, 18, 8, 4, 3, 1)
    m.observe_load("a:1", LoadFigures(spec_num_drafts=1, spec_num_draft_tokens=3,
                                      spec_num_accepted_tokens=1,
                                      spec_accepted_per_pos=(1,)))  # fmt: skip  # restarted
    assert figures() == (7, 21, 9, 5, 3, 1)


def test_gauges_follow_the_model_an_engine_serves() -> None:
    m = Metrics("old")
    m.observe_engine_info("a:1", INFO)
    m.observe_load("a:1", LoadFigures(num_running=1))
    m.model_name = "new"  # the engine was replaced by one serving another model
    m.observe_engine_info("a:1", INFO)
    m.observe_load("a:1", LoadFigures(num_running=2))
    gauges = {
        (name, dict(labels)["model_name"])
        for (name, labels) in samples(m)
        if name in ("vllm:num_requests_running", "vllm:cache_config_info")
    }
    assert gauges == {("vllm:num_requests_running", "new"), ("vllm:cache_config_info", "new")}


def test_unchanged_load_keeps_its_gauges_and_a_returning_engine_gets_them_again() -> None:
    """Gauges are written only when a figure changes; an engine that left and came back (or a
    new model on it) gets them all again, even with the same figures as before."""
    m = Metrics("m")
    load = LoadFigures(num_running=3, num_waiting=1, kv_cache_usage=0.5)
    a = {"model_name": "m", "engine": "a:1"}
    for _ in range(3):
        m.observe_load("a:1", load)
    assert value(m, "vllm:num_requests_running", **a) == 3
    assert value(m, "vllm:kv_cache_usage_perc", **a) == 0.5
    m.forget_engine("a:1")
    assert value(m, "vllm:num_requests_running", **a) is None
    m.observe_load("a:1", load)  # back, with the very same figures
    assert value(m, "vllm:num_requests_running", **a) == 3
    assert value(m, "vllm:num_requests_waiting", **a) == 1
    assert value(m, "vllm:gpu_cache_usage_perc", **a) == 0.5
    m.model_name = "other"
    m.observe_load("a:1", load)
    moved = {"model_name": "other", "engine": "a:1"}
    assert value(m, "vllm:num_requests_running", **moved) == 3
    assert value(m, "vllm:kv_cache_usage_perc", **moved) == 0.5
    assert value(m, "vllm:num_requests_running", **a) is None
    m.observe_load("a:1", LoadFigures(num_running=4, num_waiting=1, kv_cache_usage=0.5))
    assert value(m, "vllm:num_requests_running", **moved) == 4


def test_cache_config_info_carries_the_engine_cache_facts() -> None:
    m = Metrics("m")
    m.observe_engine_info("a:1", INFO)
    labels = {
        "model_name": "m",
        "engine": "a:1",
        "block_size": "16",
        "num_gpu_blocks": "64",
        "enable_prefix_caching": "True",
        "cache_dtype": "bfloat16",
    }
    assert value(m, "vllm:cache_config_info", **labels) == 1
    # Reconnected with another cache size: one info series, the new one.
    m.observe_engine_info("a:1", dataclasses.replace(INFO, num_kv_blocks=32))
    info = [dict(k[1]) for k in samples(m) if k[0] == "vllm:cache_config_info"]
    assert info == [{**labels, "num_gpu_blocks": "32"}]


def test_lora_requests_info_names_the_adapters_in_use() -> None:
    """vLLM's lora_requests_info for an engine serving adapters: its labels name the running and
    waiting adapters, its value is when it was set; one series per engine, the current one."""
    m = Metrics("m")

    def series() -> dict[tuple[str, str, str, str], float]:
        return {
            (d["engine"], d["max_lora"], d["running_lora_adapters"], d["waiting_lora_adapters"]): v
            for (name, labels), v in samples(m).items()
            if name == "vllm:lora_requests_info" and (d := dict(labels))["model_name"] == "m"
        }

    m.observe_engine_info("a:1", dataclasses.replace(INFO, max_loras=2))
    m.observe_engine_info("b:2", INFO)  # serves no adapters: no series
    assert list(series()) == [("a:1", "2", "", "")]  # connected: none in use yet
    before = time.time()
    busy = LoadFigures(running_lora_adapters=("a", "b"), waiting_lora_adapters=("c",))
    m.observe_load("a:1", busy)
    m.observe_load("b:2", busy)

    found = series()
    assert list(found) == [("a:1", "2", "a,b", "c")]
    assert before <= found[("a:1", "2", "a,b", "c")] <= time.time()
    m.observe_load("a:1", busy)  # unchanged
    assert list(series()) == [("a:1", "2", "a,b", "c")]
    m.observe_load("a:1", LoadFigures(running_lora_adapters=("c",)))
    assert list(series()) == [("a:1", "2", "c", "")]  # the old combination is gone
    m.observe_load("a:1", LoadFigures())
    assert list(series()) == [("a:1", "2", "", "")]  # idle: still there, naming none
    m.model_name = "other"  # reconnected serving another model: the old series goes at once
    m.observe_engine_info("a:1", dataclasses.replace(INFO, max_loras=2))
    assert series() == {}  # (series() shows model "m" only)
    m.model_name = "m"
    m.observe_engine_info("a:1", INFO)  # reconnected without adapters
    m.observe_load("a:1", busy)
    assert series() == {}
    m.observe_engine_info("a:1", dataclasses.replace(INFO, max_loras=4))
    m.observe_load("a:1", busy)
    assert list(series()) == [("a:1", "4", "a,b", "c")]
    m.forget_engine("a:1")
    assert series() == {}


def test_tokens_per_engine_message_as_vllm_counts_them() -> None:
    m = Metrics("m")
    m.observe_step("a:1", 12, 2)  # two requests: one finished its 12-token prompt
    m.observe_step("a:1", 0, 2)
    m.observe_step("b:2", 0, 1)
    a = {"model_name": "m", "engine": "a:1"}
    assert value(m, "vllm:prompt_tokens_total", **a) == 12
    assert value(m, "vllm:generation_tokens_total", **a) == 4
    assert value(m, "vllm:iteration_tokens_total_count", **a) == 2
    assert value(m, "vllm:iteration_tokens_total_sum", **a) == 16
    assert value(m, "vllm:iteration_tokens_total_bucket", **a, le="8.0") == 1
    assert value(m, "vllm:iteration_tokens_total_bucket", **a, le="16.0") == 2
    assert value(m, "vllm:generation_tokens_total", model_name="m", engine="b:2") == 1


def test_a_merged_message_is_one_iteration_observation_per_step() -> None:
    """A gateway that fell behind gets several engine steps in one message: the histogram takes
    the engine's count of each step (a step with none of this client's tokens is not one); the
    token totals come from the outputs as always."""
    m = Metrics("m")
    m.observe_step("a:1", 12, 6, (14, 2, 2))
    a = {"model_name": "m", "engine": "a:1"}
    assert value(m, "vllm:prompt_tokens_total", **a) == 12
    assert value(m, "vllm:generation_tokens_total", **a) == 6
    assert value(m, "vllm:iteration_tokens_total_count", **a) == 3
    assert value(m, "vllm:iteration_tokens_total_sum", **a) == 18
    assert value(m, "vllm:iteration_tokens_total_bucket", **a, le="8.0") == 2  # not one of 18
    # The engine also counted tokens of a request this gateway left: one observation of its own.
    m.observe_step("a:1", 0, 3, (2, 2, 2))
    assert value(m, "vllm:iteration_tokens_total_count", **a) == 4
    assert value(m, "vllm:iteration_tokens_total_sum", **a) == 18 + 3
    assert value(m, "vllm:generation_tokens_total", **a) == 6 + 3


def test_runs_of_equal_steps_count_as_each_step_observed_alone() -> None:
    """A merged message's runs of equal step counts are observed at once (``observe_many``):
    every bucket, the sum and the count are what one observation per step gives."""
    steps = (1,) * 16 + (5, 5, 1, 300, 300, 300, 20000)
    fast, slow = Metrics("m"), Metrics("m")
    fast.observe_step("a:1", 0, sum(steps), steps)
    fast.observe_step("a:1", 0, 8, (8,))  # a run of one, and one after another message
    child = slow.iteration_tokens.labels("m", "a:1")
    for n in (*steps, 8):
        child.observe(n)
    iteration = {k: v for k, v in samples(fast).items() if "iteration_tokens" in k[0]}
    assert iteration and iteration == {
        k: v for k, v in samples(slow).items() if "iteration_tokens" in k[0]
    }
    a = {"model_name": "m", "engine": "a:1"}
    assert value(fast, "vllm:iteration_tokens_total_count", **a) == len(steps) + 1
    assert value(fast, "vllm:iteration_tokens_total_bucket", **a, le="1.0") == 17


def test_observe_many_without_the_histogram_stores_observes_each_time() -> None:
    """Should a prometheus_client release rename the stores it adds to, each observation is
    made on its own (the same figures, at the old cost)."""
    seen: list[float] = []

    class Plain:
        def observe(self, amount: float) -> None:
            seen.append(amount)

    observe_many(Plain(), 3.0, 4)  # type: ignore[arg-type]
    assert seen == [3.0] * 4


def _out(
    *tokens: int,
    finish: FinishReason | None = None,
    queued_time_s: float | None = None,
    prefill_time_s: float | None = None,
    decode_time_s: float | None = None,
) -> EngineOutput:
    return EngineOutput(
        "r",
        tokens,
        finish_reason=finish,
        num_prompt_tokens=7,
        queued_time_s=queued_time_s,
        prefill_time_s=prefill_time_s,
        decode_time_s=decode_time_s,
    )


def test_a_sequence_is_timed_from_its_outputs_and_the_engine_phases() -> None:
    clock = Clock()
    m = Metrics("m", clock=clock)
    m.observe_engine_info("a:1", INFO)
    seq = m.sequence(7)
    clock.now += 0.5
    seq.observe(_out(5, queued_time_s=0.25, prefill_time_s=0.125), None)
    clock.now += 0.05
    seq.observe(_out(6, 7), None)  # two tokens merged: one inter-token time
    clock.now += 0.02
    seq.observe(
        _out(
            8,
            finish=FinishReason.LENGTH,
            queued_time_s=0.25,
            prefill_time_s=0.125,
            decode_time_s=0.0625,
        ),
        "length",
    )
    one = {"model_name": "m"}
    assert value(m, "vllm:time_to_first_token_seconds_sum", **one) == pytest.approx(0.5)
    assert value(m, "vllm:inter_token_latency_seconds_count", **one) == 2
    assert value(m, "vllm:inter_token_latency_seconds_sum", **one) == pytest.approx(0.07)
    assert value(m, "vllm:time_per_output_token_seconds_sum", **one) == pytest.approx(0.07)
    assert value(m, "vllm:e2e_request_latency_seconds_sum", **one) == pytest.approx(0.57)
    assert value(m, "vllm:request_queue_time_seconds_sum", **one) == 0.25
    assert value(m, "vllm:request_prefill_time_seconds_sum", **one) == 0.125
    assert value(m, "vllm:request_decode_time_seconds_sum", **one) == 0.0625
    assert value(m, "vllm:request_inference_time_seconds_sum", **one) == 0.1875
    assert value(m, "vllm:request_success_total", **one, finished_reason="length") == 1
    assert value(m, "vllm:request_prompt_tokens_sum", **one) == 7
    assert value(m, "vllm:request_generation_tokens_sum", **one) == 4
    for name in ("queue_time", "prefill_time", "decode_time", "inference_time"):
        assert value(m, f"vllm:request_{name}_seconds_count", **one) == 1


def test_a_sequence_ended_by_a_stop_string_is_timed_on_the_gateway() -> None:
    clock = Clock()
    m = Metrics("m", clock=clock)
    seq = m.sequence(7)
    seq.observe(_out(5, queued_time_s=0.5, prefill_time_s=0.25), None)
    clock.now += 0.75
    seq.observe(_out(6), "stop")  # the engine never sent its last output
    one = {"model_name": "m"}
    assert value(m, "vllm:request_success_total", **one, finished_reason="stop") == 1
    assert value(m, "vllm:request_queue_time_seconds_sum", **one) == 0.5
    assert value(m, "vllm:request_decode_time_seconds_sum", **one) == 0.75


def test_an_engine_without_phase_times_leaves_them_out() -> None:
    m = Metrics("m")
    seq = m.sequence(3)
    seq.observe(EngineOutput("r", (5,), finish_reason=FinishReason.STOP), "stop")
    assert value(m, "vllm:request_success_total", model_name="m", finished_reason="stop") == 1
    assert value(m, "vllm:e2e_request_latency_seconds_count", model_name="m") == 1
    assert value(m, "vllm:request_queue_time_seconds_count", model_name="m") is None


def test_length_buckets_are_vllms() -> None:
    assert length_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert length_buckets(4096)[-3:] == [500, 1000, 2000]
