"""The scheduler with LoRA adapters, on CPU without torch: never more adapters in a step than
device slots (pinned ones included), FCFS otherwise unchanged, adapters held from add to finish,
and prefix-cache blocks never shared between adapters."""

from __future__ import annotations

import random

import pytest

from engine_svc.config import SchedulerConfig
from engine_svc.core.kv_cache_manager import KVCacheManager
from engine_svc.core.request import Request
from engine_svc.core.sampling_params import SamplingParams
from engine_svc.core.scheduler import Scheduler
from engine_svc.lora.registry import LoRARegistry

BS = 4


def setup(max_loras: int, names: str = "abcd") -> tuple[Scheduler, LoRARegistry]:
    reg = LoRARegistry(max_loras)
    for name in names:
        reg.add(name, f"/{name}", 8)
    kv = KVCacheManager(64, BS)
    return Scheduler(SchedulerConfig(max_num_seqs=8), kv, 2048, reg), reg  # type: ignore[arg-type]


def req(reg: LoRARegistry, rid: str, lora: str | None, prompt: list[int] | None = None) -> Request:
    """A request holding its adapter, as EngineCore.add_request makes it."""
    lora_id = reg.acquire(lora).lora_id if lora else 0
    tokens = prompt or [100 + sum(map(ord, rid)) + i for i in range(5)]
    return Request(rid, tokens, SamplingParams(max_tokens=4), lora_id=lora_id, lora_name=lora)


def step(sched: Scheduler) -> list[str]:
    """One step; every request that reached its end samples token 7. Returns the scheduled ids."""
    out = sched.schedule()
    sampled = {
        s.request.request_id: 7
        for s in out.scheduled
        if s.request.num_computed_tokens + s.num_tokens >= s.request.num_tokens
    }
    sched.update_from_output(out, sampled)
    return [s.request.request_id for s in out.scheduled]


def test_requests_beyond_the_slots_wait_in_their_place() -> None:
    sched, reg = setup(max_loras=2)
    for rid, lora in [("r1", "a"), ("r2", "b"), ("r3", "c"), ("r4", "a"), ("r5", None)]:
        sched.add_request(req(reg, rid, lora))
    # r3 (a third adapter) is stepped over; r4 (a running adapter) and r5 (base) go ahead
    assert step(sched) == ["r1", "r2", "r4", "r5"]
    assert [r.request_id for r in sched.waiting] == ["r3"]
    sched.add_request(req(reg, "r6", "d"))
    sched.add_request(req(reg, "r7", "b"))
    assert step(sched) == ["r1", "r2", "r4", "r5", "r7"]
    assert [r.request_id for r in sched.waiting] == ["r3", "r6"]  # FCFS among those waiting
    sched.abort_requests(["r2", "r7"])  # b's requests are gone: one slot frees, r3 takes it
    assert step(sched) == ["r1", "r4", "r5", "r3"]
    assert [r.request_id for r in sched.waiting] == ["r6"]


def test_stats_count_the_running_and_waiting_requests_per_adapter() -> None:
    """The load figures behind vllm:lora_requests_info: requests per adapter name, running and
    waiting (base-model requests in neither)."""
    sched, reg = setup(max_loras=2)
    for rid, lora in [("r1", "a"), ("r2", "b"), ("r3", "c"), ("r4", "a"), ("r5", None)]:
        sched.add_request(req(reg, rid, lora))
    stats = sched.stats()
    assert stats.running_lora_adapters == {}  # nothing scheduled yet: all five wait
    assert stats.waiting_lora_adapters == {"a": 2, "b": 1, "c": 1}
    step(sched)  # c is stepped over: only two adapters fit
    stats = sched.stats()
    assert stats.running_lora_adapters == {"a": 2, "b": 1}
    assert stats.waiting_lora_adapters == {"c": 1}
    sched.abort_requests(["r1", "r2", "r3", "r4", "r5"])
    stats = sched.stats()
    assert (stats.running_lora_adapters, stats.waiting_lora_adapters) == ({}, {})


def test_requests_stepped_over_for_a_slot_count_as_deferred() -> None:
    """vllm:num_requests_waiting_by_reason: the waiting requests the last step stepped over
    for want of a LoRA slot are "deferred", never more than are waiting."""
    sched, reg = setup(max_loras=2)
    for rid, lora in [("r1", "a"), ("r2", "b"), ("r3", "c"), ("r4", "d"), ("r5", None)]:
        sched.add_request(req(reg, rid, lora))
    assert sched.stats().num_waiting_deferred == 0  # not looked at yet: waiting for capacity
    step(sched)
    assert (sched.stats().num_waiting, sched.stats().num_waiting_deferred) == (2, 2)
    sched.abort_requests(["r3"])
    assert sched.stats().num_waiting_deferred == 1  # capped by those still waiting
    sched.abort_requests(["r2"])  # a slot frees: r4 is admitted at the next step
    step(sched)
    assert (sched.stats().num_waiting, sched.stats().num_waiting_deferred) == (0, 0)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_the_waiting_queues_adapter_counts_stay_exact(policy: str) -> None:
    """The waiting queue counts its requests per adapter as they come and go (added, scheduled,
    stepped over and put back, preempted, aborted, finished); the counts always equal a recount."""
    rng = random.Random(7)
    reg = LoRARegistry(2)
    for name in "abcd":
        reg.add(name, f"/{name}", 8)
    kv = KVCacheManager(16, BS)  # small: long requests get preempted
    sched = Scheduler(SchedulerConfig(max_num_seqs=6, policy=policy), kv, 2048, reg)  # type: ignore[arg-type]
    live: list[str] = []
    preemptions = 0
    for i in range(120):
        if rng.random() < 0.5:
            rid, lora = f"r{i}", rng.choice([None, "a", "b", "c", "d"])
            lora_id = reg.acquire(lora).lora_id if lora else 0
            tokens = [100 + i + j for j in range(rng.randint(2, 9))]
            params = SamplingParams(max_tokens=rng.randint(1, 40))
            sched.add_request(
                Request(rid, tokens, params, lora_id=lora_id, lora_name=lora, priority=i % 3)
            )
            live.append(rid)
        if live and rng.random() < 0.15:
            sched.abort_requests([live.pop(rng.randrange(len(live)))])
        step(sched)
        recount: dict[str, int] = {}
        for r in sched.waiting:
            if r.lora_name is not None:
                recount[r.lora_name] = recount.get(r.lora_name, 0) + 1
        assert sched.waiting.per_adapter == recount
        stats = sched.take_stats()  # this step's counters, as EngineCore.step takes them
        assert stats.waiting_lora_adapters == recount
        preemptions += stats.num_preemptions
    assert preemptions > 0  # the scenario did preempt (requests went back to waiting)


def test_every_step_fits_the_slots() -> None:
    sched, reg = setup(max_loras=2)
    loras = ["a", "b", "c", "d", None, "c", "a", "d", "b", None, "a", "c"]
    for i, lora in enumerate(loras):
        sched.add_request(req(reg, f"r{i}", lora))
    by_id = {f"r{i}": lora for i, lora in enumerate(loras)}
    seen: set[str] = set()
    while sched.has_unfinished():
        ids = step(sched)
        adapters = {by_id[r] for r in ids} - {None}
        assert len(adapters) <= 2, adapters
        seen |= set(ids)
    assert seen == set(by_id)
    # every request gave its adapter back
    assert all(reg.get(n).users == 0 for n in "abcd")


def test_pinned_adapters_count_against_the_slots() -> None:
    sched, reg = setup(max_loras=2)
    reg.pin("d")
    sched.add_request(req(reg, "r1", "a"))
    sched.add_request(req(reg, "r2", "b"))
    sched.add_request(req(reg, "r3", "d"))
    assert step(sched) == ["r1", "r3"]  # a and the pinned d: b must wait


def test_adapters_are_released_however_requests_end() -> None:
    sched, reg = setup(max_loras=2)
    sched.add_request(req(reg, "done", "a"))
    sched.add_request(req(reg, "aborted", "a"))
    sched.add_request(req(reg, "waiting", "b"))
    assert reg.get("a").users == 2 and reg.get("b").users == 1
    step(sched)
    sched.abort_requests(["aborted", "waiting"])
    assert reg.get("a").users == 1 and reg.get("b").users == 0
    while sched.has_unfinished():
        step(sched)
    assert reg.get("a").users == 0


def test_removed_adapter_serves_its_requests_then_goes() -> None:
    sched, reg = setup(max_loras=1)
    sched.add_request(req(reg, "r1", "a"))
    a = reg.get("a").lora_id
    step(sched)
    reg.remove("a")
    while sched.has_unfinished():
        step(sched)
    assert a not in [i.lora_id for i in reg.infos()]
    assert reg.lru_order() == [reg.get(n).lora_id for n in "bcd"]


def test_prefix_cache_blocks_are_per_adapter() -> None:
    sched, reg = setup(max_loras=4)
    prompt = list(range(40, 53))  # 3 full blocks and one token
    first = req(reg, "first", "a", prompt)
    sched.add_request(first)
    while sched.has_unfinished():
        step(sched)
    for rid, lora, hits in [("same", "a", 12), ("other", "b", 0), ("base", None, 0)]:
        r = req(reg, rid, lora, prompt)
        blocks, cached = sched.kv.get_computed_blocks(r)
        assert cached == hits, rid
    # the base model's own blocks are shared among base requests only
    base1 = req(reg, "base1", None, prompt)
    sched.add_request(base1)
    while sched.has_unfinished():
        step(sched)
    assert sched.kv.get_computed_blocks(req(reg, "base2", None, prompt))[1] == 12
    assert sched.kv.get_computed_blocks(req(reg, "c", "c", prompt))[1] == 0
