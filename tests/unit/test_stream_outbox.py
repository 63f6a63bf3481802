"""StreamOutbox (``protos.stream_outbox``): the steps a Stream has not sent yet are merged per
request, in order, and the client's window bounds the messages in flight. The steps are the
engine's own batches, converted as the engine's Stream converts them (``_batch_to_pb``)."""

from __future__ import annotations

from engine_svc.core.outputs import EngineCoreOutput
from engine_svc.core.request import Logprobs, PhaseTimes
from engine_svc.loop.clients import ClientBatch
from engine_svc.rpc.servicer import _batch_to_pb
from protos.stream_outbox import StreamOutbox
from protos.tandem.engine.v1 import engine_pb2 as pb
from protos.types import FinishReason, LoadFigures


class EngineFedOutbox(StreamOutbox):
    """The outbox fed as the engine's Stream feeds it."""

    def add(self, batch: ClientBatch) -> None:  # type: ignore[override]
        super().add(*_batch_to_pb(batch))


def out(
    rid: str, *tokens: int, finish: FinishReason | None = None, **kw: object
) -> EngineCoreOutput:
    return EngineCoreOutput(rid, list(tokens), finish_reason=finish, **kw)  # type: ignore[arg-type]


def lp(token: int) -> Logprobs:
    return Logprobs(token, -0.5, 1, {token: -0.5})


def test_steps_queued_behind_a_write_merge_per_request_in_order() -> None:
    box = EngineFedOutbox()
    first = out(
        "a",
        1,
        new_logprobs=[lp(1)],
        num_prompt_tokens=5,
        prompt_logprobs=[None],
        num_cached_tokens=2,
    )
    box.add(ClientBatch([first, out("b", 7)], load=LoadFigures(num_running=2)))
    box.add(ClientBatch([out("a", 2, new_logprobs=[lp(2)], num_cached_tokens=2)]))
    times = PhaseTimes(0.1, 0.2, 0.3)
    last = out(
        "a",
        3,
        new_logprobs=[lp(3)],
        finish=FinishReason.LENGTH,
        phase_times=times,
        num_cached_tokens=3,
        num_prompt_tokens=5,
    )
    box.add(ClientBatch([last, out("c", 9)], load=LoadFigures(num_running=1)))
    assert box.ready() and box.steps_merged == 2
    batch = box.take()
    assert box.empty and not box.ready()
    assert [o.request_id for o in batch.outputs] == ["a", "b", "c"]
    a = batch.outputs[0]
    assert a.new_token_ids == [1, 2, 3]
    assert [x.token_id for x in a.logprobs] == [1, 2, 3]
    assert not a.prompt_logprobs  # the first prompt token has none
    assert a.finish_reason == pb.FINISH_REASON_LENGTH
    assert (a.queued_time_s, a.prefill_time_s, a.decode_time_s) == (0.1, 0.2, 0.3)
    assert a.num_cached_tokens == 3 and a.num_prompt_tokens == 5
    assert batch.load.num_running_requests == 1  # the latest step's
    assert batch.timestamp > 0  # stamped when taken
    # The engine's own output objects are left as they were.
    assert first.new_token_ids == [1] and len(first.new_logprobs) == 1
    assert first.finish_reason is None


def test_a_merged_message_counts_each_steps_tokens() -> None:
    """vLLM's iteration tokens per step: the prompts whose first token (or pooled result) the
    step produced plus the tokens it generated, for this client."""
    box = EngineFedOutbox()
    box.add(ClientBatch([out("a", 1, num_prompt_tokens=12, first=True)]))
    assert box.take().step_tokens == []  # one step: its outputs say it all
    box.add(ClientBatch([out("a", 2, num_prompt_tokens=12), out("b", 5, num_prompt_tokens=3)]))
    box.add(ClientBatch([out("a", 3, 4, num_prompt_tokens=12), out("b", 6, num_prompt_tokens=3)]))
    assert box.take().step_tokens == [2, 3]  # b's prompt was done in an earlier message
    box.add(ClientBatch([out("c", 7, num_prompt_tokens=5, first=True), out("a", 8)]))
    box.add(ClientBatch([out("p", num_prompt_tokens=9, first=True, finish=FinishReason.STOP)]))
    box.add(ClientBatch([out("a", finish=FinishReason.ABORT, num_prompt_tokens=12)]))
    box.add(ClientBatch([], errors=[("d", ValueError("no"))]))
    assert box.steps_merged == 1 + 3
    assert box.take().step_tokens == [7, 9]  # pooled p counts its prompt; aborts, errors: none
    box.add(ClientBatch([out("e", 1, num_prompt_tokens=4, first=True)]))
    box.add(ClientBatch([out("e", finish=FinishReason.ABORT)]))
    assert box.steps_merged == 5 and box.take().step_tokens == []  # one step with tokens


def test_a_reused_request_id_starts_a_new_message() -> None:
    """Ids may be reused once finished: the new request's output must not fold into the old."""
    box = EngineFedOutbox()
    box.add(ClientBatch([out("a", 1)]))
    box.add(ClientBatch([out("a", 2, finish=FinishReason.STOP), out("b", 5)]))
    box.add(ClientBatch([out("a", 40), out("b", 6)]))  # a new request "a"
    first, second = box.take(), box.take()
    assert [(o.request_id, o.new_token_ids) for o in first.outputs] == [("a", [1, 2]), ("b", [5])]
    assert [(o.request_id, o.new_token_ids) for o in second.outputs] == [("a", [40]), ("b", [6])]
    assert box.empty


def test_an_error_ends_merging_for_its_id() -> None:
    box = EngineFedOutbox()
    box.add(ClientBatch([out("a", 1)]))
    box.add(ClientBatch(errors=[("a", ValueError("grammar"))]))  # same message: output, error
    box.add(ClientBatch(errors=[("x", ValueError("refused"))]))
    box.add(ClientBatch([out("x", 3)]))  # after x's error: not in the same message
    first, second = box.take(), box.take()
    assert [o.request_id for o in first.outputs] == ["a"]
    assert [e.request_id for e in first.errors] == ["a", "x"]
    assert [o.request_id for o in second.outputs] == ["x"] and not second.errors


def test_the_window_bounds_unread_messages() -> None:
    box = EngineFedOutbox()
    box.flow(window=2, messages_read=0)
    for step in range(3):
        box.add(ClientBatch([out("a", step)]))
        if box.ready():
            box.take()
    assert box.sent == 2 and not box.ready()  # two unread: the third step waits, merged
    box.add(ClientBatch([out("a", 3)]))
    assert not box.ready()
    box.flow(window=0, messages_read=1)  # 0 keeps the window; one message read
    assert box.window == 2 and box.ready()
    assert box.take().outputs[0].new_token_ids == [2, 3]
    box.flow(window=0, messages_read=99)  # more than sent: taken as all of them
    assert box.read == box.sent == 3
    box.flow(window=0, messages_read=1)  # counts never go back
    assert box.read == 3


def test_without_a_window_a_message_is_ready_whenever_one_is_pending() -> None:
    box = EngineFedOutbox()
    assert not box.ready()
    for step in range(5):
        box.add(ClientBatch([out("a", step)]))
        assert box.ready()
        box.take()
    assert box.sent == 5 and box.steps_merged == 0


def test_half_closing_drops_the_window() -> None:
    """A half-closed client cannot report progress: what is held must go out without it."""
    box = EngineFedOutbox()
    box.flow(window=1, messages_read=0)
    box.add(ClientBatch([out("a", 1)]))
    box.take()
    box.add(ClientBatch([out("a", 2)]))
    assert not box.ready()
    box.drop_window()
    assert box.ready() and box.take().outputs[0].new_token_ids == [2]


def test_a_dropped_window_stays_dropped() -> None:
    """Once dropped (half-close, or the engine stopping), a window the client sends later does
    not hold back what is left: it all goes out."""
    box = EngineFedOutbox()
    box.flow(window=1, messages_read=0)
    box.add(ClientBatch([out("a", 1)]))
    box.take()
    box.drop_window()
    box.flow(window=1, messages_read=0)  # late
    box.add(ClientBatch([out("b", 2)]))
    assert box.ready() and box.take().outputs[0].new_token_ids == [2]
