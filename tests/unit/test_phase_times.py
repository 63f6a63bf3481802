"""The engine's phase times of a request (vLLM's queue, prefill and decode times): when they are
stamped, what a preemption does to them, and which outputs carry them."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine_svc import LLM
from engine_svc.config import SchedulerConfig
from engine_svc.core.kv_cache_manager import KVCacheManager
from engine_svc.core.outputs import EngineCoreOutput
from engine_svc.core.request import PhaseTimes, Request
from engine_svc.core.sampling_params import SamplingParams
from engine_svc.core.scheduler import Scheduler
from protos.types import FinishReason


def _request(rid: str, prompt_len: int, max_tokens: int) -> Request:
    prompt = [100 + i for i in range(prompt_len)]
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens), (2,), 0.0)


def test_each_phase_runs_until_the_next_begins() -> None:
    r = _request("a", 4, 4)
    r.queued_ts = 10.0
    assert r.phase_times(12.0) == PhaseTimes(2.0, 0.0, 0.0)  # still waiting
    r.scheduled_ts = 11.0
    assert r.phase_times(12.0) == PhaseTimes(1.0, 1.0, 0.0)  # its prompt is running
    r.first_token_ts = 11.5
    assert r.phase_times(13.0) == PhaseTimes(1.0, 0.5, 1.5)  # decoding


def test_the_first_admission_is_stamped_and_a_preemption_keeps_it() -> None:
    sched = Scheduler(SchedulerConfig(), KVCacheManager(3, 4, enable_caching=False), 2048)
    a, b = _request("a", 4, 5), _request("b", 4, 2)
    sched.add_request(a)
    sched.add_request(b)
    assert a.scheduled_ts is None and b.scheduled_ts is None

    def step() -> list[str]:
        out = sched.schedule()
        sampled = {
            s.request.request_id: 5
            for s in out.scheduled
            if s.request.num_computed_tokens + s.num_tokens >= s.request.num_tokens
        }
        sched.update_from_output(out, sampled)
        return out.preempted_ids

    step()
    admitted = b.scheduled_ts
    assert a.scheduled_ts is not None and admitted is not None
    assert admitted >= b.queued_ts
    assert step() == ["b"]  # both need a second block; b, the newest, gives way
    while sched.has_unfinished():
        step()
    assert b.scheduled_ts == admitted  # readmitted after the preemption: still the first time


@pytest.fixture(scope="module")
def llm(tiny_models: dict[str, Path]) -> LLM:
    return LLM(tiny_models["llama"], dtype="float32", num_kv_blocks=64, device="cpu")


def test_outputs_carry_the_phases_with_the_first_token_and_at_the_end(llm: LLM) -> None:
    core = llm.engine
    core.add_request("a", [5, 6, 7, 8], SamplingParams(max_tokens=4, temperature=0.0))
    outs: list[EngineCoreOutput] = [o for s in core.run_until_idle() for o in s.outputs]
    assert [len(o.new_token_ids) for o in outs] == [1, 1, 1, 1]
    first, *middle, last = outs
    assert [o.phase_times for o in middle] == [None, None]
    assert first.phase_times is not None and last.phase_times is not None
    assert last.finish_reason is FinishReason.LENGTH
    assert first.phase_times.queued_s >= 0
    assert first.phase_times.prefill_s > 0  # a forward pass
    assert first.phase_times.decode_s == 0
    assert (last.phase_times.queued_s, last.phase_times.prefill_s) == (
        first.phase_times.queued_s,
        first.phase_times.prefill_s,
    )
    assert last.phase_times.decode_s > 0  # three more forward passes


def test_an_abort_returns_the_final_output_with_its_phases(llm: LLM) -> None:
    core = llm.engine
    core.add_request("waits", [5, 6, 7], SamplingParams(max_tokens=4))
    [final] = core.abort_requests(["waits", "unknown"])
    assert (final.request_id, final.finish_reason, final.new_token_ids) == (
        "waits",
        FinishReason.ABORT,
        [],
    )
    assert final.num_prompt_tokens == 3
    assert final.phase_times is not None
    assert final.phase_times.queued_s >= 0
    assert (final.phase_times.prefill_s, final.phase_times.decode_s) == (0.0, 0.0)
    assert not core.has_unfinished_requests()
