"""The per-request collector between the engine-stream reader and the request's consumer."""

from __future__ import annotations

import asyncio

import pytest

from frontend_svc.engine.collector import OutputCollector, merge_outputs
from frontend_svc.engine.errors import EngineRequestError
from protos.types import EngineErrorCode, EngineOutput, FinishReason, TokenLogprob


def _out(ids: tuple[int, ...], **kw: object) -> EngineOutput:
    lps = tuple(TokenLogprob(t, -float(t), 1, ()) for t in ids)
    return EngineOutput("r", ids, lps, **kw)  # type: ignore[arg-type]


def test_a_consumer_that_keeps_up_gets_each_output_as_it_is() -> None:
    asyncio.run(_a_consumer_that_keeps_up_gets_each_output_as_it_is())


async def _a_consumer_that_keeps_up_gets_each_output_as_it_is() -> None:
    c = OutputCollector()
    first = _out((1,), num_prompt_tokens=3)
    c.put(first)
    assert await c.get() is first  # no copy, no merge
    waiting = asyncio.ensure_future(c.get())
    await asyncio.sleep(0)
    assert not waiting.done()
    second = _out((2,))
    c.put(second)
    assert await asyncio.wait_for(waiting, 1) is second


def test_a_slow_consumer_gets_the_backlog_merged_into_one_output() -> None:
    asyncio.run(_a_slow_consumer_gets_the_backlog_merged_into_one_output())


async def _a_slow_consumer_gets_the_backlog_merged_into_one_output() -> None:
    c = OutputCollector()
    prompt_lps = (TokenLogprob(7, -0.5, 1, ()),)
    c.put(_out((1,), prompt_logprobs=prompt_lps, num_cached_tokens=4, num_prompt_tokens=9))
    c.put(_out((2, 3), num_cached_tokens=4, num_prompt_tokens=9))
    c.put(_out((4,), finish_reason=FinishReason.LENGTH, stop_reason=None, num_prompt_tokens=9))
    assert c.num_pending == 3
    merged = await c.get()
    assert c.num_pending == 0
    assert merged.new_token_ids == (1, 2, 3, 4)
    assert [lp.token_id for lp in merged.logprobs] == [1, 2, 3, 4]
    assert merged.prompt_logprobs == prompt_lps
    assert merged.finish_reason is FinishReason.LENGTH and merged.finished
    assert merged.num_cached_tokens == 4 and merged.num_prompt_tokens == 9


def test_merge_keeps_the_last_stop_reason() -> None:
    merged = merge_outputs([_out((5,)), _out((6,), finish_reason=FinishReason.STOP, stop_reason=6)])
    assert merged.finish_reason is FinishReason.STOP and merged.stop_reason == 6


def test_merge_keeps_the_engine_phase_times() -> None:
    first = _out((5,), queued_time_s=0.5, prefill_time_s=0.25)
    assert merge_outputs([first, _out((6,))]).queued_time_s == 0.5  # with the first token
    assert merge_outputs([first, _out((6,))]).decode_time_s is None
    last = _out(
        (7,),
        finish_reason=FinishReason.LENGTH,
        queued_time_s=0.5,
        prefill_time_s=0.25,
        decode_time_s=1.0,
    )
    merged = merge_outputs([_out((6,)), last])
    assert (merged.queued_time_s, merged.prefill_time_s, merged.decode_time_s) == (0.5, 0.25, 1.0)


def test_an_error_comes_after_the_outputs_before_it() -> None:
    asyncio.run(_an_error_comes_after_the_outputs_before_it())


async def _an_error_comes_after_the_outputs_before_it() -> None:
    c = OutputCollector()
    c.put(_out((1,)))
    c.fail(EngineRequestError(EngineErrorCode.INTERNAL, "boom"))
    c.fail(EngineRequestError(EngineErrorCode.INTERNAL, "second: ignored"))
    assert (await c.get()).new_token_ids == (1,)
    with pytest.raises(EngineRequestError, match="boom"):
        await c.get()


def test_a_failure_wakes_a_waiting_consumer() -> None:
    asyncio.run(_a_failure_wakes_a_waiting_consumer())


async def _a_failure_wakes_a_waiting_consumer() -> None:
    c = OutputCollector()
    waiting = asyncio.ensure_future(c.get())
    await asyncio.sleep(0)
    c.fail(EngineRequestError(EngineErrorCode.UNAVAILABLE, "gone"))
    with pytest.raises(EngineRequestError, match="gone"):
        await asyncio.wait_for(waiting, 1)


def test_a_cancelled_consumer_leaves_the_collector_usable() -> None:
    asyncio.run(_a_cancelled_consumer_leaves_the_collector_usable())


async def _a_cancelled_consumer_leaves_the_collector_usable() -> None:
    c = OutputCollector()
    waiting = asyncio.ensure_future(c.get())
    await asyncio.sleep(0)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    c.put(_out((3,)))  # no waiter left to wake: nothing raises
    assert (await c.get()).new_token_ids == (3,)


def test_take_and_wait_are_get_without_a_coroutine() -> None:
    asyncio.run(_take_and_wait_are_get_without_a_coroutine())


async def _take_and_wait_are_get_without_a_coroutine() -> None:
    c = OutputCollector()
    assert c.take() is None
    waiter = c.wait()
    assert not waiter.done() and c.wait() is waiter  # one waiter until it is woken
    first = _out((1,))
    c.put(first)
    assert waiter.done()
    await waiter
    assert c.take() is first and c.take() is None
    c.put(_out((2,)))
    assert c.wait().done()  # an output already there: no waiting
    assert c.take().new_token_ids == (2,)  # type: ignore[union-attr]
    c.put(_out((3,)))
    c.put(_out((4,)))
    c.fail(EngineRequestError(EngineErrorCode.INTERNAL, "boom"))
    assert c.take().new_token_ids == (3, 4)  # type: ignore[union-attr]
    assert c.wait().done()  # the error is there
    with pytest.raises(EngineRequestError, match="boom"):
        c.take()


def test_a_waiter_whose_consumer_was_cancelled_is_replaced() -> None:
    asyncio.run(_a_waiter_whose_consumer_was_cancelled_is_replaced())


async def _a_waiter_whose_consumer_was_cancelled_is_replaced() -> None:
    c = OutputCollector()

    async def consume() -> EngineOutput:
        while (out := c.take()) is None:
            await c.wait()
        return out

    gone = asyncio.ensure_future(consume())
    await asyncio.sleep(0)
    gone.cancel()  # cancels the waiter it was awaiting
    with pytest.raises(asyncio.CancelledError):
        await gone
    again = asyncio.ensure_future(consume())
    await asyncio.sleep(0)
    c.put(_out((5,)))  # must wake the new consumer, not the cancelled waiter
    assert (await asyncio.wait_for(again, 1)).new_token_ids == (5,)


def test_ended_once_the_last_output_or_the_error_is_taken() -> None:
    # What EngineClient's handle reads to decide whether closing a request aborts it.
    done = OutputCollector()
    done.put(_out((1,)))
    done.put(_out((2,), finish_reason=FinishReason.LENGTH))
    assert not done.ended  # arrived, not taken
    assert done.take().new_token_ids == (1, 2) and done.ended  # type: ignore[union-attr]
    running = OutputCollector()
    running.put(_out((1,)))
    running.take()
    assert not running.ended
    failed = OutputCollector()
    failed.fail(EngineRequestError(EngineErrorCode.INTERNAL, "boom"))
    assert not failed.ended
    with pytest.raises(EngineRequestError):
        failed.take()
    assert failed.ended
