"""Scheduler on CPU, driven the way ``EngineCore.step`` drives it: schedule -> sample -> update.

Every expectation is exact: which request got how many tokens in which blocks, which request was
preempted, what the free queue looks like afterwards.
"""

from __future__ import annotations

from collections.abc import Mapping

import pytest

from engine_svc.config import SchedulerConfig
from engine_svc.core.kv_cache_manager import KVCacheManager
from engine_svc.core.request import Request, RequestStatus
from engine_svc.core.sampling_params import SamplingParams
from engine_svc.core.scheduler import Scheduler, SchedulerOutput
from protos.types import FinishReason
from tests.unit.model_info import model_info

BS = 4
EOS = 2
TOK = 5  # the token "sampled" unless a test says otherwise: never EOS

Plan = list[tuple[str, int, list[int]]]


def _sched(
    num_blocks: int = 10, caching: bool = True, max_model_len: int = 2048, **config: object
) -> Scheduler:
    kv = KVCacheManager(num_blocks, BS, enable_caching=caching)
    return Scheduler(SchedulerConfig(**config), kv, max_model_len)  # type: ignore[arg-type]


def _req(
    rid: str,
    prompt: list[int] | int,
    arrival: float,
    priority: int = 0,
    **params: object,
) -> Request:
    """A request; an int prompt means that many distinct tokens (no accidental prefix hits)."""
    if isinstance(prompt, int):
        base = 1000 * (1 + sum(map(ord, rid)))
        prompt = [base + i for i in range(prompt)]
    params.setdefault("max_tokens", 16)
    return Request(rid, prompt, SamplingParams(**params), (EOS,), arrival, priority)  # type: ignore[arg-type]


def _step(
    sched: Scheduler, tokens: Mapping[str, int] | None = None
) -> tuple[SchedulerOutput, list[Request]]:
    """One engine step. Like the model runner, only a request whose known tokens are all computed
    after this step samples one (``tokens`` overrides the default per request)."""
    out = sched.schedule()
    for s in out.scheduled:  # the plans below name every block each request holds
        s.block_ids = sched.kv.get_block_ids(s.request.request_id)
    sampled = {
        s.request.request_id: (tokens or {}).get(s.request.request_id, TOK)
        for s in out.scheduled
        if s.request.num_computed_tokens + s.num_tokens >= s.request.num_tokens
    }
    return out, sched.update_from_output(out, sampled)


def _plan(out: SchedulerOutput) -> Plan:
    return [(s.request.request_id, s.num_tokens, s.block_ids) for s in out.scheduled]


def _run_to_completion(sched: Scheduler, max_steps: int = 200) -> int:
    steps = 0
    while sched.has_unfinished():
        _step(sched)
        steps += 1
        assert steps < max_steps, "scheduler made no progress"
    return steps


# ---------------------------------------------------------------------------- config / add


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="policy"):
        SchedulerConfig(policy="lifo")
    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(max_num_batched_tokens=0)
    # max_model_len is found at load time: the scheduler checks the budget against it.
    with pytest.raises(ValueError, match="chunked prefill"):
        _sched(enable_chunked_prefill=False, max_num_batched_tokens=8, max_model_len=16)
    _sched(enable_chunked_prefill=False, max_num_batched_tokens=16, max_model_len=16)


def test_add_request_rejects_prompt_at_max_model_len() -> None:
    """The rule is ModelInfo's, checked where a request enters the engine; the scheduler only
    asserts the invariant it relies on (room for the first token)."""
    info = model_info(max_model_len=16)
    sched = _sched(max_model_len=16)
    with pytest.raises(ValueError, match="context length is 16"):
        info.check_prompt(_req("a", 16, 1.0).prompt_token_ids)
    with pytest.raises(ValueError, match="context length"):
        info.check_prompt(_req("b", 17, 1.0).prompt_token_ids)
    with pytest.raises(RuntimeError, match="max_model_len"):
        sched.add_request(_req("a", 16, 1.0))
    info.check_prompt(_req("c", 15, 1.0).prompt_token_ids)
    sched.add_request(_req("c", 15, 1.0))
    assert list(sched.requests) == ["c"]


def test_add_request_rejects_duplicate_id() -> None:
    sched = _sched()
    sched.add_request(_req("a", 4, 1.0))
    with pytest.raises(ValueError, match="'a' is already in use"):
        sched.add_request(_req("a", 5, 2.0))
    assert len(sched.waiting) == 1


def test_add_request_rejects_prompt_larger_than_the_cache() -> None:
    """An invariant the scheduler asserts (the engine serves a max_model_len the cache holds,
    and ModelInfo refuses longer prompts before they get here)."""
    sched = _sched(num_blocks=2)
    with pytest.raises(RuntimeError, match="needs 3 KV blocks"):
        sched.add_request(_req("a", 9, 1.0))
    sched.add_request(_req("b", 8, 1.0))


# ---------------------------------------------------------------------------- token budget


def test_long_prompt_is_chunked_by_the_token_budget() -> None:
    sched = _sched(max_num_batched_tokens=4)
    a = _req("a", 10, 1.0)
    sched.add_request(a)

    out, touched = _step(sched)
    assert _plan(out) == [("a", 4, [0])]
    assert out.num_batched_tokens == 4
    assert touched == [] and a.num_computed_tokens == 4 and a.output_token_ids == []

    out, touched = _step(sched)
    assert _plan(out) == [("a", 4, [0, 1])]
    assert touched == [] and a.num_computed_tokens == 8

    out, touched = _step(sched)
    assert _plan(out) == [("a", 2, [0, 1, 2])]
    assert touched == [a] and a.num_computed_tokens == 10 and a.output_token_ids == [TOK]

    out, touched = _step(sched)  # decode
    assert _plan(out) == [("a", 1, [0, 1, 2])]
    assert out.num_batched_tokens == 1
    assert a.num_computed_tokens == 11 and a.output_token_ids == [TOK, TOK]


def test_running_requests_are_scheduled_before_waiting_ones() -> None:
    sched = _sched(max_num_batched_tokens=6)
    sched.add_request(_req("a", 4, 1.0))
    out, _ = _step(sched)
    assert _plan(out) == [("a", 4, [0])]

    sched.add_request(_req("b", 10, 2.0))
    out, _ = _step(sched)
    assert _plan(out) == [("a", 1, [0, 1]), ("b", 5, [2, 3])]
    out, _ = _step(sched)
    assert _plan(out) == [("a", 1, [0, 1]), ("b", 5, [2, 3, 4])]
    out, _ = _step(sched)
    assert _plan(out) == [("a", 1, [0, 1]), ("b", 1, [2, 3, 4])]


def test_budget_left_after_running_requests_goes_to_waiting_ones() -> None:
    sched = _sched(max_num_batched_tokens=8)
    sched.add_request(_req("a", 6, 1.0))
    sched.add_request(_req("b", 6, 2.0))
    out, _ = _step(sched)
    assert _plan(out) == [("a", 6, [0, 1]), ("b", 2, [2])]
    out, _ = _step(sched)
    assert _plan(out) == [("a", 1, [0, 1]), ("b", 4, [2, 3])]


def test_chunked_prefill_disabled_waits_for_a_whole_prompt() -> None:
    sched = _sched(enable_chunked_prefill=False, max_num_batched_tokens=16, max_model_len=16)
    sched.add_request(_req("a", 10, 1.0))
    sched.add_request(_req("b", 10, 2.0))
    out, _ = _step(sched)
    assert _plan(out) == [("a", 10, [0, 1, 2])]
    out, _ = _step(sched)
    assert _plan(out) == [("a", 1, [0, 1, 2]), ("b", 10, [3, 4, 5])]


def test_max_num_seqs_is_respected() -> None:
    sched = _sched(max_num_seqs=2)
    sched.add_request(_req("a", 3, 1.0, max_tokens=1))
    sched.add_request(_req("b", 3, 2.0, max_tokens=3))
    sched.add_request(_req("c", 3, 3.0, max_tokens=1))
    out, _ = _step(sched)
    assert _plan(out) == [("a", 3, [0]), ("b", 3, [1])]
    assert [r.request_id for r in sched.waiting] == ["c"]
    out, _ = _step(sched)  # a finished: its slot goes to c; its block joined the queue's tail
    assert _plan(out) == [("b", 1, [1]), ("c", 3, [2])]
    assert out.finished_ids == ["a"]


def test_fcfs_ignores_priority_values() -> None:
    sched = _sched(max_num_seqs=1)
    for rid, arrival, prio in (("a", 1.0, 5), ("b", 2.0, 0), ("c", 3.0, -3)):
        sched.add_request(_req(rid, 3, arrival, priority=prio, max_tokens=1))
    order = []
    while sched.has_unfinished():
        out, _ = _step(sched)
        order += [s.request.request_id for s in out.scheduled]
    assert order == ["a", "b", "c"]


def test_priority_policy_orders_by_priority_then_arrival() -> None:
    sched = _sched(max_num_seqs=1, policy="priority")
    for rid, arrival, prio in (("a", 1.0, 2), ("b", 2.0, 0), ("c", 3.0, 1), ("d", 4.0, 0)):
        sched.add_request(_req(rid, 3, arrival, priority=prio, max_tokens=1))
    order = []
    while sched.has_unfinished():
        out, _ = _step(sched)
        order += [s.request.request_id for s in out.scheduled]
    assert order == ["b", "d", "c", "a"]


def test_prefix_hit_through_the_scheduler() -> None:
    sched = _sched()
    prefix = list(range(100, 108))
    a = _req("a", prefix + [1, 2], 1.0)
    sched.add_request(a)
    out, _ = _step(sched)
    assert _plan(out) == [("a", 10, [0, 1, 2])]
    assert a.num_cached_tokens == 0

    b = _req("b", prefix + [3, 4, 6], 2.0)
    sched.add_request(b)
    out, _ = _step(sched)
    assert _plan(out) == [("a", 1, [0, 1, 2]), ("b", 3, [0, 1, 3])]
    assert b.num_cached_tokens == 8 and b.num_computed_tokens == 11


# ---------------------------------------------------------------------------- preemption


def test_fcfs_preempts_the_newest_running_request() -> None:
    sched = _sched(num_blocks=4)
    a = _req("a", 7, 1.0, max_tokens=3)
    b = _req("b", 4, 2.0, max_tokens=3)
    c = _req("c", 3, 3.0, max_tokens=3)
    for r in (a, b, c):
        sched.add_request(r)
    out, _ = _step(sched)
    assert _plan(out) == [("a", 7, [0, 1]), ("b", 4, [2]), ("c", 3, [3])]
    d = _req("d", 4, 4.0, max_tokens=3)
    sched.add_request(d)

    # b needs a second block and none is free: c (the newest) gives its block back.
    out, _ = _step(sched)
    assert out.preempted_ids == ["c"]
    assert _plan(out) == [("a", 1, [0, 1]), ("b", 1, [2, 3])]
    assert [r.request_id for r in sched.waiting] == ["c", "d"]  # c goes to the front
    assert c.status is RequestStatus.PREEMPTED
    assert c.num_computed_tokens == 0 and c.num_preemptions == 1
    assert c.all_token_ids == c.prompt_token_ids + [TOK]  # its output is kept
    assert [r.request_id for r in sched.running] == ["a", "b"]

    # a needs a third block: b is now the newest running request.
    out, _ = _step(sched)
    assert out.preempted_ids == ["b"]
    assert _plan(out) == [("a", 1, [0, 1, 3])]
    assert [r.request_id for r in sched.waiting] == ["b", "c", "d"]
    assert a.is_finished and a.finish_reason is FinishReason.LENGTH
    assert sched.kv.pool.free_block_ids() == [2, 3, 1, 0]

    # b comes back first, reusing its own cached first block; c and d recompute.
    out, _ = _step(sched)
    assert out.finished_ids == ["a"]
    assert _plan(out) == [("b", 2, [2, 3]), ("c", 4, [1]), ("d", 4, [0])]
    assert b.num_cached_tokens == 0  # first admission found nothing cached

    _run_to_completion(sched)
    for r in (a, b, c, d):
        assert r.finish_reason is FinishReason.LENGTH
        assert r.output_token_ids == [TOK] * 3
    assert (b.num_preemptions, c.num_preemptions, d.num_preemptions) == (1, 1, 0)
    assert sched.kv.num_free_blocks == 4


def test_preempted_request_recomputes_all_its_tokens() -> None:
    sched = _sched(num_blocks=3, caching=False)
    a = _req("a", 4, 1.0, max_tokens=5)
    b = _req("b", 4, 2.0, max_tokens=2)
    sched.add_request(a)
    sched.add_request(b)
    out, _ = _step(sched)
    assert _plan(out) == [("a", 4, [0]), ("b", 4, [1])]
    out, _ = _step(sched)  # both need a second block: a takes the last one, b preempts itself
    assert _plan(out) == [("a", 1, [0, 2])]
    assert out.preempted_ids == ["b"]
    assert b.all_token_ids == b.prompt_token_ids + [TOK] and b.num_computed_tokens == 0
    for _ in range(3):  # b needs two blocks, one is free: it waits until a finishes
        out, _ = _step(sched)
        assert _plan(out) == [("a", 1, [0, 2])]
    assert a.is_finished
    # b recomputes its prompt and its one output token, then samples its second token.
    out, _ = _step(sched)
    assert _plan(out) == [("b", 5, [1, 2])]
    assert out.finished_ids == ["a"]
    assert b.output_token_ids == [TOK, TOK] and b.finish_reason is FinishReason.LENGTH
    assert sched.kv.num_free_blocks == 3


def test_priority_preempts_the_lowest_priority_request() -> None:
    sched = _sched(num_blocks=3, policy="priority")
    high = _req("high", 4, 2.0, priority=0)
    low = _req("low", 7, 1.0, priority=1)  # arrived first, but lower priority
    sched.add_request(low)
    sched.add_request(high)
    out, _ = _step(sched)
    assert _plan(out) == [("high", 4, [0]), ("low", 7, [1, 2])]

    out, _ = _step(sched)
    assert out.preempted_ids == ["low"]
    assert _plan(out) == [("high", 1, [0, 2])]
    assert low.num_computed_tokens == 0 and low.status is RequestStatus.PREEMPTED
    assert list(sched.waiting) == [low]


def test_priority_victim_scheduled_earlier_in_the_step_returns_its_budget() -> None:
    sched = _sched(num_blocks=3, policy="priority", max_num_batched_tokens=8)
    low = _req("low", 6, 1.0, priority=1, max_tokens=4)
    sched.add_request(low)
    out, _ = _step(sched)
    assert _plan(out) == [("low", 6, [0, 1])]

    high = _req("high", 4, 2.0, priority=0, max_tokens=3)
    sched.add_request(high)
    out, _ = _step(sched)  # running: low, high (admitted after it)
    assert _plan(out) == [("low", 1, [0, 1]), ("high", 4, [2])]

    # low is scheduled first (it fits); then high needs a block and low, the lowest priority,
    # is preempted although already scheduled: its entry and its token go back.
    out, _ = _step(sched)
    assert out.preempted_ids == ["low"]
    assert _plan(out) == [("high", 1, [2, 1])]
    assert out.num_batched_tokens == 1
    assert low.num_computed_tokens == 0 and low.status is RequestStatus.PREEMPTED
    assert low.output_token_ids == [TOK, TOK]  # the undone step appended nothing
    assert [r.request_id for r in sched.running] == ["high"]
    assert sched.stats().num_preemptions == 1

    _run_to_completion(sched)
    assert high.output_token_ids == [TOK] * 3
    assert low.output_token_ids == [TOK] * 4 and low.finish_reason is FinishReason.LENGTH
    assert sched.kv.num_free_blocks == 3


def test_undone_victim_leaves_no_uncomputed_block_in_the_prefix_cache() -> None:
    """Regression: a victim undone in the step that scheduled it had already published the block
    its (never run) step would have filled; a later request then hit KV that was never written."""
    # 16 slots hold every token of a 17-token sequence that needs KV: nothing outgrows the pool.
    sched = _sched(num_blocks=4, policy="priority", max_num_batched_tokens=10, max_model_len=17)
    a = _req("a", [10, 11], 1.0, priority=0, max_tokens=3)
    v = _req("v", [20, 21], 2.0, priority=2)
    sched.add_request(a)
    sched.add_request(v)
    out, _ = _step(sched, {"a": 12, "v": 22})
    assert _plan(out) == [("a", 2, [0]), ("v", 2, [1])]

    h = _req("h", 16, 3.0, priority=1)
    sched.add_request(h)
    out, _ = _step(sched, {"a": 13, "v": 23})
    assert _plan(out) == [("a", 1, [0]), ("v", 1, [1]), ("h", 8, [2, 3])]
    assert v.all_token_ids == [20, 21, 22, 23] and v.num_computed_tokens == 3

    # v's step would fill block 1 (token 23), but h needs two blocks: v is undone, then h,
    # still short, preempts itself. Only a runs, so token 23 never gets KV.
    out, _ = _step(sched, {"a": 14})
    assert out.preempted_ids == ["v", "h"]
    assert _plan(out) == [("a", 1, [0])]
    assert a.finish_reason is FinishReason.LENGTH

    # A new request whose first block equals v's four tokens must not reuse block 1.
    x = _req("x", [20, 21, 22, 23, 24], 4.0, priority=0)
    sched.add_request(x)
    out, _ = _step(sched)
    assert out.scheduled[0].request is x
    assert out.scheduled[0].num_tokens == 5
    assert x.num_cached_tokens == 0

    _run_to_completion(sched)
    assert sched.kv.num_free_blocks == 4


def test_priority_request_that_is_itself_the_lowest_is_preempted() -> None:
    sched = _sched(num_blocks=3, policy="priority")
    low = _req("low", 7, 1.0, priority=3)
    sched.add_request(low)
    _step(sched)  # low: [0, 1], 8 tokens, 7 computed
    high = _req("high", 4, 2.0, priority=0)
    sched.add_request(high)
    out, _ = _step(sched)
    assert _plan(out) == [("low", 1, [0, 1]), ("high", 4, [2])]
    out, _ = _step(sched)  # low needs a third block; the only candidate below it is itself
    assert out.preempted_ids == ["low"]
    assert list(sched.waiting) == [low]
    assert sched.kv.get_block_ids("low") == []


# ---------------------------------------------------------------------------- abort


def test_abort_waiting_request() -> None:
    sched = _sched(max_num_seqs=1)
    a = _req("a", 6, 1.0)
    b = _req("b", 6, 2.0)
    sched.add_request(a)
    sched.add_request(b)
    _step(sched)
    free_before = sched.kv.num_free_blocks
    assert sched.abort_requests(["b"]) == [b]
    assert b.status is RequestStatus.FINISHED_ABORTED and b.finish_reason is FinishReason.ABORT
    assert len(sched.waiting) == 0 and "b" not in sched.requests
    assert sched.kv.num_free_blocks == free_before
    out, _ = _step(sched)
    assert out.finished_ids == ["b"]
    assert _plan(out) == [("a", 1, [0, 1])]


def test_abort_running_request_frees_its_blocks() -> None:
    sched = _sched()
    a = _req("a", 10, 1.0)
    b = _req("b", 5, 2.0)
    sched.add_request(a)
    sched.add_request(b)
    _step(sched)
    assert sched.kv.num_free_blocks == 5
    assert sched.abort_requests(["a"]) == [a]
    assert sched.kv.num_free_blocks == 8
    assert [r.request_id for r in sched.running] == ["b"]
    assert sched.kv.pool.free_block_ids() == [5, 6, 7, 8, 9, 2, 1, 0]
    sched.abort_requests(["b"])
    assert sched.kv.num_free_blocks == 10
    assert not sched.has_unfinished()
    out = sched.schedule()
    assert out.is_empty and out.finished_ids == ["a", "b"]


def test_abort_unknown_or_finished_id_is_a_no_op() -> None:
    sched = _sched()
    a = _req("a", 3, 1.0, max_tokens=1)
    sched.add_request(a)
    _step(sched)
    assert a.is_finished
    assert sched.abort_requests(["nope", "a"]) == []
    assert a.finish_reason is FinishReason.LENGTH
    assert sched.kv.num_free_blocks == 10
    out = sched.schedule()
    assert out.finished_ids == ["a"]


def test_abort_same_id_twice_in_one_call() -> None:
    sched = _sched()
    a = _req("a", 6, 1.0)
    sched.add_request(a)
    _step(sched)
    assert sched.abort_requests(["a", "a"]) == [a]
    assert sched.kv.num_free_blocks == 10
    assert sched.schedule().finished_ids == ["a"]


def test_abort_between_schedule_and_update() -> None:
    sched = _sched()
    a = _req("a", 6, 1.0)
    b = _req("b", 6, 2.0)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    sched.abort_requests(["a"])
    touched = sched.update_from_output(out, {"a": TOK, "b": TOK})
    assert touched == [b]
    assert a.output_token_ids == [] and a.status is RequestStatus.FINISHED_ABORTED
    assert sched.kv.num_free_blocks == 8


# ---------------------------------------------------------------------------- stop conditions


def test_eos_stops() -> None:
    sched = _sched()
    a = _req("a", 3, 1.0)
    sched.add_request(a)
    _step(sched)
    _, touched = _step(sched, {"a": EOS})
    assert touched == [a]
    assert a.status is RequestStatus.FINISHED_STOPPED and a.finish_reason is FinishReason.STOP
    assert a.stop_reason is None
    assert a.output_token_ids == [TOK, EOS]
    assert not sched.running and sched.kv.num_free_blocks == 10


def test_ignore_eos_keeps_going_until_max_tokens() -> None:
    sched = _sched()
    a = _req("a", 3, 1.0, ignore_eos=True, max_tokens=3)
    sched.add_request(a)
    for _ in range(3):
        _step(sched, {"a": EOS})
    assert a.output_token_ids == [EOS, EOS, EOS]
    assert a.status is RequestStatus.FINISHED_LENGTH


def test_stop_token_id_stops_with_reason() -> None:
    sched = _sched()
    a = _req("a", 3, 1.0, stop_token_ids=[9, 11])
    sched.add_request(a)
    _step(sched, {"a": 10})
    assert not a.is_finished
    _step(sched, {"a": 11})
    assert a.status is RequestStatus.FINISHED_STOPPED and a.stop_reason == 11


def test_stop_token_id_applies_with_ignore_eos() -> None:
    sched = _sched()
    a = _req("a", 3, 1.0, stop_token_ids=[9], ignore_eos=True)
    sched.add_request(a)
    _step(sched, {"a": 9})
    assert a.status is RequestStatus.FINISHED_STOPPED and a.stop_reason == 9


def test_max_tokens_finishes_with_length() -> None:
    sched = _sched()
    a = _req("a", 3, 1.0, max_tokens=3)
    sched.add_request(a)
    for _ in range(3):
        assert not a.is_finished
        _step(sched)
    assert a.output_token_ids == [TOK] * 3
    assert a.status is RequestStatus.FINISHED_LENGTH and a.finish_reason is FinishReason.LENGTH


def test_min_tokens_suppresses_stops_until_reached() -> None:
    sched = _sched()
    a = _req("a", 3, 1.0, min_tokens=3, stop_token_ids=[9])
    sched.add_request(a)
    _step(sched, {"a": EOS})
    _step(sched, {"a": 9})
    assert not a.is_finished and a.stop_reason is None
    _step(sched, {"a": EOS})  # third token: min_tokens reached
    assert a.output_token_ids == [EOS, 9, EOS]
    assert a.status is RequestStatus.FINISHED_STOPPED


def test_min_tokens_does_not_extend_past_max_tokens() -> None:
    sched = _sched()
    a = _req("a", 3, 1.0, min_tokens=2, max_tokens=2)
    sched.add_request(a)
    _step(sched, {"a": EOS})
    _step(sched)
    assert a.status is RequestStatus.FINISHED_LENGTH and a.num_output_tokens == 2


def test_max_model_len_finishes_with_length() -> None:
    sched = _sched(max_model_len=8)
    a = _req("a", 6, 1.0, max_tokens=100)
    sched.add_request(a)
    _step(sched)
    assert not a.is_finished
    _step(sched)
    assert a.num_tokens == 8
    assert a.status is RequestStatus.FINISHED_LENGTH


def test_partial_prefill_chunk_samples_nothing() -> None:
    sched = _sched(max_num_batched_tokens=4)
    a = _req("a", 6, 1.0)
    sched.add_request(a)
    out = sched.schedule()
    touched = sched.update_from_output(out, {})
    assert touched == [] and a.num_computed_tokens == 4 and a.output_token_ids == []


# ---------------------------------------------------------------------------- outputs, stats


def test_finished_ids_are_reported_once_in_the_next_output() -> None:
    sched = _sched()
    sched.add_request(_req("a", 3, 1.0, max_tokens=1))
    sched.add_request(_req("b", 3, 2.0, max_tokens=2))
    out, _ = _step(sched)
    assert out.finished_ids == []
    out, _ = _step(sched)
    assert out.finished_ids == ["a"]
    assert _plan(out) == [("b", 1, [1])]
    out = sched.schedule()
    assert out.finished_ids == ["b"] and out.is_empty and out.num_batched_tokens == 0
    assert sched.schedule().finished_ids == []


def test_stats() -> None:
    """``take_stats`` ends an interval (as ``EngineCore.step`` does once per step): the
    counters after it are the next interval's."""
    sched = _sched(max_num_seqs=1)
    prefix = list(range(100, 108))
    sched.add_request(_req("a", prefix + [1, 2], 1.0, max_tokens=1))
    sched.add_request(_req("b", prefix + [3, 4], 2.0, max_tokens=1))
    _step(sched)
    st = sched.take_stats()
    assert (st.num_running, st.num_waiting) == (0, 1)
    assert st.kv_cache_usage == 0.0  # a finished and gave its three blocks back
    assert (st.prefix_cache_queries, st.prefix_cache_hits) == (10, 0)

    sched.schedule()  # b admitted with an 8-token hit; left running (no update)
    st = sched.take_stats()
    assert (st.num_running, st.num_waiting) == (1, 0)
    assert st.kv_cache_usage == pytest.approx(0.3)
    assert (st.prefix_cache_queries, st.prefix_cache_hits) == (10, 8)
    st = sched.take_stats()
    assert (st.prefix_cache_queries, st.prefix_cache_hits) == (0, 0)


def test_stats_is_a_pure_read() -> None:
    """Reading the figures changes nothing: twice in a row they are the same, counters
    included; only ``take_stats`` starts the counters again."""
    sched = _sched(num_blocks=2)
    prefix = list(range(100, 104))
    sched.add_request(_req("a", prefix, 1.0))
    sched.add_request(_req("b", prefix, 2.0))
    _step(sched)
    _step(sched)  # b needs a block: the pool is full, b is preempted
    first, second = sched.stats(), sched.stats()
    assert first == second
    assert first.num_preemptions == 1 and first.prefix_cache_queries == 8
    assert sched.kv.stats.queries == 8  # the KV manager's counters untouched too
    assert sched.take_stats() == first
    assert sched.stats().num_preemptions == 0 and sched.stats().prefix_cache_queries == 0


def test_stats_preemption_count_resets_when_taken() -> None:
    sched = _sched(num_blocks=2)
    sched.add_request(_req("a", 4, 1.0))
    sched.add_request(_req("b", 4, 2.0))
    _step(sched)
    out, _ = _step(sched)
    assert out.preempted_ids == ["b"]
    assert sched.take_stats().num_preemptions == 1
    assert sched.take_stats().num_preemptions == 0


def test_full_run_returns_every_block() -> None:
    sched = _sched(num_blocks=10, max_num_batched_tokens=8, max_num_seqs=3)
    shared = list(range(300, 308))
    reqs = [
        _req("a", 9, 1.0, max_tokens=5),
        _req("b", shared + [1], 2.0, max_tokens=7),
        _req("c", shared + [2, 3], 3.0, max_tokens=4),
        _req("d", 13, 4.0, max_tokens=6),
        _req("e", 2, 5.0, max_tokens=9),
    ]
    for r in reqs:
        sched.add_request(r)
    _run_to_completion(sched)
    for r in reqs:
        assert r.finish_reason is FinishReason.LENGTH
        assert r.num_output_tokens == r.sampling_params.max_tokens
    assert sched.kv.num_free_blocks == 10
    assert not sched.running and len(sched.waiting) == 0 and not sched.requests


def test_a_step_names_only_new_blocks_except_for_admitted_requests() -> None:
    """The runner keeps each request's block table; a step sends only what changed (O(new
    blocks)), and everything again when a request is (re)admitted, e.g. after a preemption."""
    sched = _sched(num_blocks=6, max_num_batched_tokens=64, max_model_len=24)  # 6 x BS 4
    sched.add_request(_req("a", 6, 0.0, max_tokens=40))  # BS 4: blocks for 6 tokens
    out = sched.schedule()
    [s] = out.scheduled
    assert (s.admitted, s.block_ids) == (True, [0, 1])
    for _ in range(2):  # positions 6 and 7 still fit block 1
        sched.update_from_output(out, {"a": TOK})
        out = sched.schedule()
        assert [(s.admitted, s.block_ids) for s in out.scheduled] == [(False, [])]
    sched.update_from_output(out, {"a": TOK})  # position 8 needs block 2
    out = sched.schedule()
    assert [(s.admitted, s.block_ids) for s in out.scheduled] == [(False, [2])]
    sched.update_from_output(out, {"a": TOK})
    # b arrives; one of them is preempted when blocks run out and comes back with its table.
    sched.add_request(_req("b", 11, 1.0, max_tokens=40))
    steps = 0
    seen_readmission = False
    while sched.has_unfinished():
        assert steps < 100, "no progress"
        out = sched.schedule()
        for s in out.scheduled:
            if s.request.num_preemptions and s.admitted:
                assert s.block_ids == sched.kv.get_block_ids(s.request.request_id)
                seen_readmission = True
            elif not s.admitted:
                assert len(s.block_ids) <= 1
        _tokens = {
            s.request.request_id: TOK
            for s in out.scheduled
            if s.request.num_computed_tokens + s.num_tokens >= s.request.num_tokens
        }
        sched.update_from_output(out, _tokens)
        steps += 1
    assert seen_readmission
