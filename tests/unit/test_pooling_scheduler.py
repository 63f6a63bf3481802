"""Pooling requests in the scheduler and the KV cache manager, on CPU without torch.

Driven as ``EngineCore.step`` drives them: schedule -> (the runner pools or samples) -> update.
A pooling request is prefill only: same budget, chunks, blocks and prefix cache as a prompt; it
samples nothing and finishes STOPPED in the update of the step that computed its last prompt
token, giving its blocks back. Expectations are exact (block ids, steps, counters).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from engine_svc.config import SchedulerConfig
from engine_svc.core.kv_cache_manager import KVCacheManager
from engine_svc.core.pooling_params import PoolingParams, PoolingType
from engine_svc.core.request import Request, RequestStatus
from engine_svc.core.sampling_params import SamplingParams
from engine_svc.core.scheduler import Scheduler, SchedulerOutput
from protos.types import FinishReason, PoolingTask
from tests.unit.model_info import model_info

BS = 4
TOK = 5

Plan = list[tuple[str, int, list[int]]]


def _sched(num_blocks: int = 10, max_model_len: int = 2048, **config: object) -> Scheduler:
    kv = KVCacheManager(num_blocks, BS, enable_caching=True)
    return Scheduler(SchedulerConfig(**config), kv, max_model_len)  # type: ignore[arg-type]


def _tokens(rid: str, n: int) -> list[int]:
    base = 1000 * (1 + sum(map(ord, rid)))
    return [base + i for i in range(n)]


def _pool(rid: str, prompt: list[int] | int, kind: PoolingType = PoolingType.LAST) -> Request:
    """A pooling request with parameters as ``ModelTasks.check`` resolves them."""
    if isinstance(prompt, int):
        prompt = _tokens(rid, prompt)
    params = PoolingParams(PoolingTask.EMBED, normalize=True, pooling_type=kind)
    return Request(rid, prompt, SamplingParams(max_tokens=1), (), 1.0, pooling_params=params)


def _gen(rid: str, prompt: list[int] | int, max_tokens: int = 16) -> Request:
    if isinstance(prompt, int):
        prompt = _tokens(rid, prompt)
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens), (2,), 1.0)


def _step(sched: Scheduler) -> tuple[SchedulerOutput, list[Request]]:
    """One engine step. Like the model runner: a generation request whose known tokens are all
    computed samples TOK; a pooling request never samples."""
    out = sched.schedule()
    for s in out.scheduled:
        s.block_ids = sched.kv.get_block_ids(s.request.request_id)
    sampled = {
        s.request.request_id: TOK
        for s in out.scheduled
        if not s.request.is_pooling
        and s.request.num_computed_tokens + s.num_tokens >= s.request.num_tokens
    }
    return out, sched.update_from_output(out, sampled)


def _plan(out: SchedulerOutput) -> Plan:
    return [(s.request.request_id, s.num_tokens, s.block_ids) for s in out.scheduled]


def test_pooling_bookkeeping_stays_torch_free() -> None:
    code = (
        "import sys, engine_svc.core.scheduler, engine_svc.core.pooling_params, "
        "engine_svc.models.tasks; assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_pooling_request_is_prefill_only_and_frees_its_blocks() -> None:
    sched = _sched()
    a = _pool("a", 6)
    sched.add_request(a)
    out, touched = _step(sched)
    assert _plan(out) == [("a", 6, [0, 1])]
    assert touched == [a]  # finished in the step that computed its last prompt token
    assert a.status is RequestStatus.FINISHED_STOPPED and a.finish_reason is FinishReason.STOP
    assert a.output_token_ids == [] and a.num_computed_tokens == 6
    assert not sched.has_unfinished() and not sched.running
    assert sched.kv.num_free_blocks == 10 and sched.kv.get_block_ids("a") == []
    out, _ = _step(sched)
    assert out.is_empty and out.finished_ids == ["a"]  # the runner drops its row next step


def test_a_long_pooling_prompt_is_chunked_and_finishes_with_its_last_chunk() -> None:
    sched = _sched(max_num_batched_tokens=4)
    a = _pool("a", 10)
    sched.add_request(a)
    plans, touched = [], []
    while sched.has_unfinished():
        out, t = _step(sched)
        plans.append(_plan(out))
        touched.append([r.request_id for r in t])
    assert plans == [[("a", 4, [0])], [("a", 4, [0, 1])], [("a", 2, [0, 1, 2])]]
    assert touched == [[], [], ["a"]]
    assert sched.kv.num_free_blocks == 10


def test_pooling_and_generation_share_a_step_and_the_budget() -> None:
    sched = _sched(max_num_batched_tokens=10)
    g, p = _gen("g", 3, max_tokens=3), _pool("p", 9)
    sched.add_request(g)
    sched.add_request(p)
    out, touched = _step(sched)
    assert _plan(out) == [("g", 3, [0]), ("p", 7, [1, 2])]
    assert touched == [g] and g.output_token_ids == [TOK]
    out, touched = _step(sched)
    assert _plan(out) == [("g", 1, [0]), ("p", 2, [1, 2, 3])]
    assert touched == [g, p] and p.is_finished and not g.is_finished
    # The pooling request takes no decode slot; its blocks went to the free queue's tail
    # (3, 2, 1: tails first), so g's next block is 4.
    out, touched = _step(sched)
    assert _plan(out) == [("g", 1, [0, 4])] and out.finished_ids == ["p"]
    while sched.has_unfinished():
        _step(sched)
    assert g.output_token_ids == [TOK, TOK, TOK]
    assert sched.kv.num_free_blocks == 10


def test_last_pooling_reads_the_prefix_cache_mean_and_cls_do_not() -> None:
    sched = _sched()
    prompt = list(range(100, 109))  # 9 tokens: two full blocks
    first = _pool("first", prompt)
    sched.add_request(first)
    _step(sched)
    assert first.num_cached_tokens == 0
    free = sched.kv.num_free_blocks
    last = _pool("last", prompt)
    sched.add_request(last)
    out, touched = _step(sched)
    # Both full blocks are hits; the last token is computed (its hidden state is pooled).
    assert last.num_cached_tokens == 8 and _plan(out) == [("last", 1, [0, 1, 3])]
    assert touched == [last]
    for kind in (PoolingType.MEAN, PoolingType.CLS):
        r = _pool(kind.value, prompt, kind)
        sched.add_request(r)
        out, _ = _step(sched)
        assert r.num_cached_tokens == 0 and [(n, k) for n, k, _ in _plan(out)] == [
            (r.request_id, 9)
        ]
    stats = sched.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (18, 8)  # MEAN/CLS: not asked
    assert sched.kv.num_free_blocks == free


def test_pooling_prompt_may_fill_max_model_len() -> None:
    """The rule is ModelInfo's (checked where a request enters the engine); the scheduler takes
    a pooling prompt as long as the context and asserts the invariant it relies on."""
    info = model_info(max_model_len=16)
    sched = _sched(max_model_len=16)
    info.check_prompt(_pool("full", 16).prompt_token_ids, pooling=True)
    sched.add_request(_pool("full", 16))
    with pytest.raises(ValueError, match="context length is 16"):
        info.check_prompt(_pool("over", 17).prompt_token_ids, pooling=True)
    with pytest.raises(ValueError, match="at least one token must be generated"):
        info.check_prompt(_gen("gen", 16).prompt_token_ids)
    with pytest.raises(RuntimeError, match="max_model_len"):
        sched.add_request(_pool("over", 17))
    with pytest.raises(RuntimeError, match="max_model_len"):
        sched.add_request(_gen("gen", 16))
    assert list(sched.requests) == ["full"]


def test_abort_mid_prefill_frees_every_block() -> None:
    sched = _sched(max_num_batched_tokens=4)
    a = _pool("a", 12, PoolingType.MEAN)
    sched.add_request(a)
    _step(sched)
    _step(sched)
    assert sched.kv.get_block_ids("a") == [0, 1] and a.num_computed_tokens == 8
    assert sched.abort_requests(["a"]) == [a]
    assert a.status is RequestStatus.FINISHED_ABORTED and a.finish_reason is FinishReason.ABORT
    assert sched.kv.num_free_blocks == 10 and not sched.has_unfinished()
    out, _ = _step(sched)
    assert out.finished_ids == ["a"]  # the runner drops its partial MEAN sum


def test_a_preempted_pooling_request_computes_its_prompt_again() -> None:
    # 5 blocks of 4 tokens, 4 tokens a step. g (7-token prompt, 4 tokens out) and p (10-token
    # MEAN prompt) need 6 blocks together: when p asks for its third one, p (the newest) is
    # preempted, and computes its whole prompt again once g has finished.
    sched = _sched(num_blocks=5, max_num_batched_tokens=4)
    g, p = _gen("g", 7, max_tokens=4), _pool("p", 10, PoolingType.MEAN)
    sched.add_request(g)
    sched.add_request(p)
    plans = [_plan(_step(sched)[0]) for _ in range(4)]
    assert plans == [
        [("g", 4, [0])],
        [("g", 3, [0, 1]), ("p", 1, [2])],
        [("g", 1, [0, 1]), ("p", 3, [2])],
        [("g", 1, [0, 1, 3]), ("p", 3, [2, 4])],
    ]
    out, touched = _step(sched)
    assert _plan(out) == [("g", 1, [0, 1, 3])] and out.preempted_ids == ["p"]
    assert touched == [g] and g.is_finished and g.output_token_ids == [TOK] * 4
    assert p.status is RequestStatus.PREEMPTED and p.num_computed_tokens == 0
    chunks = []
    while sched.has_unfinished():
        out, _ = _step(sched)
        chunks += [n for _, n, _ in _plan(out)]
    assert chunks == [4, 4, 2]  # from position 0 again: MEAN reads no prefix cache
    assert p.status is RequestStatus.FINISHED_STOPPED and p.num_cached_tokens == 0
    assert sched.kv.num_free_blocks == 5
