"""The engine loop's state, one concern at a time, on CPU without a thread or an engine: the
sleep state machine (``loop/sleep.py``) and the clients with their request ids
(``loop/clients.py``)."""

from __future__ import annotations

import pytest

from engine_svc.core.outputs import EngineCoreOutput
from engine_svc.core.scheduler import SchedulerStats
from engine_svc.loop.clients import ClientBatch, Clients, internal_id, load_after, load_with_gauges
from engine_svc.loop.errors import SleepCancelled
from engine_svc.loop.sleep import SleepMode, settle
from protos.types import FinishReason, LoadFigures


def test_sleep_goes_pending_then_asleep_at_the_deepest_level_asked() -> None:
    mode = SleepMode()
    assert not mode.requested
    first, second = mode.ask(1), mode.ask(2)
    assert mode.pending and mode.requested and not mode.asleep
    level, waiters = mode.take()
    assert level == 2 and waiters == [first, second]
    mode.went_to_sleep(True)
    settle(waiters)
    assert first.result() is None and second.result() is None
    assert mode.asleep and not mode.pending and mode.requested
    assert mode.ask(1).done()  # asleep already: a no-op, resolved at once
    mode.woke_up()
    assert not mode.requested


def test_a_wake_up_cancels_a_pending_sleep() -> None:
    mode = SleepMode()
    future = mode.ask(1)
    settle(mode.cancel(), lambda: SleepCancelled("woken up"))
    assert not mode.requested
    with pytest.raises(SleepCancelled):
        future.result()


def test_a_failed_sleep_leaves_the_engine_awake() -> None:
    mode = SleepMode()
    future = mode.ask(1)
    _, waiters = mode.take()
    mode.went_to_sleep(False)
    error = RuntimeError("out of memory")
    settle(waiters, lambda: error)
    assert not mode.requested
    with pytest.raises(RuntimeError, match="out of memory"):
        future.result()


def test_request_ids_are_scoped_per_client_and_go_back_under_the_clients_own() -> None:
    clients = Clients()
    got: dict[str, list[ClientBatch]] = {"a": [], "b": []}
    for name in got:
        clients.register(name, got[name].append)
        clients.add(internal_id(name, "r1"), name, "r1")  # both clients use "r1"
    assert len(clients) == 2
    assert clients.find("a", ["r1", "zz"]) == ["a/r1"]
    assert sorted(clients.find(None, ["r1"])) == ["a/r1", "b/r1"]  # the unary Abort

    done = EngineCoreOutput("a/r1", [7], finish_reason=FinishReason.STOP)
    batches = clients.route([done, EngineCoreOutput("b/r1", [8])], [])
    load = LoadFigures(num_running=1)
    clients.deliver(batches, load)
    assert [o.request_id for o in got["a"][0].outputs] == ["r1"] and got["a"][0].load is load
    assert "a/r1" not in clients and "b/r1" in clients  # a finished request is forgotten

    assert clients.unregister("b") == ["b/r1"]  # still in flight: the loop aborts it
    final = clients.aborted(["b/r1"], {})
    assert [(o.request_id, o.finish_reason) for o in final["b"].outputs] == [
        ("r1", FinishReason.ABORT)
    ]
    clients.deliver(final, load)  # b is gone: nothing delivered
    assert len(got["b"]) == 1 and len(clients) == 0


def test_load_figures_add_a_steps_counters_but_only_take_gauges_between_steps() -> None:
    step = SchedulerStats(
        num_running=2, num_waiting=3, num_waiting_deferred=1, kv_cache_usage=0.5,
        prefix_cache_queries=10,
    )  # fmt: skip
    load = load_after(load_after(LoadFigures(), step), step)
    assert (load.num_running, load.prefix_cache_queries) == (2, 20)
    assert (load.num_waiting, load.num_waiting_deferred) == (3, 1)  # gauges: taken, not added
    spec = SchedulerStats(spec_num_drafts=2, spec_num_draft_tokens=8,
                          spec_num_accepted_tokens=5, spec_accepted_per_pos=[2, 2, 1])  # fmt: skip
    after = load_after(load_after(load, spec), SchedulerStats(spec_accepted_per_pos=[1, 0, 0, 1]))
    assert (after.spec_num_drafts, after.spec_num_draft_tokens) == (2, 8)  # counters: added
    assert after.spec_num_accepted_tokens == 5
    assert after.spec_accepted_per_pos == (3, 2, 1, 1)  # position by position, the longer kept
    assert load_with_gauges(after, SchedulerStats()).spec_accepted_per_pos == (3, 2, 1, 1)
    idle = SchedulerStats(num_running=0, prefix_cache_queries=10)
    refreshed = load_with_gauges(load, idle)
    assert (refreshed.num_running, refreshed.kv_cache_usage) == (0, 0.0)
    assert refreshed.num_waiting_deferred == 0
    assert refreshed.prefix_cache_queries == 20  # counted by the next step, not here
