"""The Stream's flow control against the real engine: with a window, the engine holds the steps
a client has not made room for and sends them merged, a request's tokens in order; the tokens a
client receives are the same with or without a window."""

from __future__ import annotations

import queue
import threading
import time
from pathlib import Path

import grpc
import pytest

from protos.tandem.engine.v1 import engine_pb2 as pb
from protos.tandem.engine.v1 import engine_pb2_grpc as pb_grpc
from tests.integration.grpc_util import StreamSession, add_request, generate, tokens_of
from tests.integration.harness import Engine
from tests.integration.inprocess import InProcessEngine, tiny_core

pytestmark = pytest.mark.timeout(90)
PROMPT = [300, 301, 302, 303, 304]
_END = object()


class Reader:
    """Reads a Stream on a thread, so a test can wait for a message with a timeout."""

    def __init__(self, session: StreamSession) -> None:
        self.messages: queue.Queue[object] = queue.Queue()
        self.error: grpc.RpcError | None = None  # how the stream ended, if not with OK
        self._thread = threading.Thread(target=self._run, args=(session,), daemon=True)
        self._thread.start()

    def _run(self, session: StreamSession) -> None:
        try:
            for message in session:
                self.messages.put(message)
        except grpc.RpcError as e:
            self.error = e
        finally:
            self.messages.put(_END)

    def rest(self, timeout: float = 30.0) -> list[pb.EngineCoreOutputs]:
        """Every message until the stream ends."""
        out = []
        while (item := self.messages.get(timeout=timeout)) is not _END:
            assert isinstance(item, pb.EngineCoreOutputs)
            out.append(item)
        return out

    def next(self, timeout: float = 30.0) -> pb.EngineCoreOutputs:
        item = self.messages.get(timeout=timeout)
        assert isinstance(item, pb.EngineCoreOutputs), "the stream ended"
        return item

    def ended(self, timeout: float = 30.0) -> bool:
        return self.messages.get(timeout=timeout) is _END


@pytest.fixture()
def stub(channel: grpc.Channel) -> pb_grpc.EngineStub:
    return pb_grpc.EngineStub(channel)


def _tokens(messages: list[pb.EngineCoreOutputs], rid: str) -> list[int]:
    return [t for m in messages for o in m.outputs if o.request_id == rid for t in o.new_token_ids]


def _per_step_tokens(
    messages: list[pb.EngineCoreOutputs], prompts: dict[str, list[int]]
) -> list[int]:
    """Each engine step's tokens (vLLM's iteration tokens): a merged message lists them; a
    message of one step is its tokens plus the prompts whose first token it carries."""
    steps: list[int] = []
    seen: set[str] = set()
    for m in messages:
        firsts = {o.request_id for o in m.outputs if o.new_token_ids} - seen
        seen |= firsts
        tokens = sum(len(o.new_token_ids) for o in m.outputs)
        steps.extend(m.step_tokens or [tokens + sum(len(prompts[r]) for r in firsts)])
    return steps


def _one_request_under_a_window_of_one(
    stub: pb_grpc.EngineStub, rid: str, max_tokens: int
) -> tuple[list[int], StreamSession, Reader]:
    """The tokens Generate gives for the prompt, and a Stream with window 1 carrying ``rid``."""
    expected = tokens_of(generate(stub, add_request(f"{rid}-ref", PROMPT, max_tokens)))
    session = StreamSession(stub)
    session.flow(window=1)
    session.add(add_request(rid, PROMPT, max_tokens))
    return expected, session, Reader(session)


def test_a_full_window_holds_the_steps_and_sends_them_merged(stub: pb_grpc.EngineStub) -> None:
    expected, session, reader = _one_request_under_a_window_of_one(stub, "flow-1", 24)
    messages = [reader.next()]
    with pytest.raises(queue.Empty):  # one message unread: the engine sends nothing more
        reader.next(timeout=0.5)
    session.flow(messages_read=1)
    messages.append(reader.next())
    # The steps of the half second the window was full came as one message, saying how many
    # tokens each step carried (one: a decode step of the one request).
    held = messages[1].outputs
    assert len(held) == 1 and len(held[0].new_token_ids) > 1
    assert list(messages[1].step_tokens) == [1] * len(held[0].new_token_ids)
    while not messages[-1].outputs[-1].finish_reason:
        session.flow(messages_read=len(messages))
        messages.append(reader.next())
    assert _tokens(messages, "flow-1") == expected
    # Per step, merged or not: the prompt once, with the first token, then a token a step.
    assert _per_step_tokens(messages, {"flow-1": PROMPT}) == [len(PROMPT) + 1] + [1] * 23
    last = messages[-1].outputs[-1]
    assert last.finish_reason == pb.FINISH_REASON_LENGTH and last.num_prompt_tokens == len(PROMPT)
    assert last.HasField("decode_time_s") and messages[-1].HasField("load")
    session.half_close()
    assert reader.ended()


def test_a_half_closed_stream_gets_its_held_steps_without_a_window(
    stub: pb_grpc.EngineStub,
) -> None:
    """A client that half-closes can report no more progress: the engine drops its window and
    sends what it holds, then ends the stream (it must not wait forever)."""
    expected, session, reader = _one_request_under_a_window_of_one(stub, "flow-hc", 16)
    messages = [reader.next()]
    session.half_close()
    messages += reader.rest()
    assert reader.error is None
    assert _tokens(messages, "flow-hc") == expected
    assert messages[-1].outputs[-1].finish_reason == pb.FINISH_REASON_LENGTH


def test_many_requests_under_a_window_of_one(stub: pb_grpc.EngineStub) -> None:
    """Every request's tokens arrive whole and in order; no message has an id twice."""
    lengths = {f"flow-m{i}": 4 + 5 * i for i in range(5)}
    prompts = {rid: [300 + i, 301, 302 + i] for i, rid in enumerate(lengths)}
    expected = {
        rid: tokens_of(generate(stub, add_request(f"{rid}-ref", prompts[rid], n)))
        for rid, n in lengths.items()
    }
    session = StreamSession(stub)
    session.flow(window=1)
    for rid, n in lengths.items():
        session.add(add_request(rid, prompts[rid], n))
    reader = Reader(session)
    messages: list[pb.EngineCoreOutputs] = []
    finished: set[str] = set()
    while finished != set(lengths):
        message = reader.next()
        messages.append(message)
        ids = [o.request_id for o in message.outputs]
        assert len(ids) == len(set(ids)), ids
        assert not finished & set(ids), "an output after its request finished"
        finished |= {o.request_id for o in message.outputs if o.finish_reason}
        session.flow(messages_read=len(messages))
    assert {rid: _tokens(messages, rid) for rid in lengths} == expected
    session.half_close()
    assert reader.ended()


def test_merged_steps_keep_their_token_counts(stub: pb_grpc.EngineStub) -> None:
    """Requests that start while the client's window is full get their first tokens in a merged
    message; its per-step counts (vLLM's iteration tokens) still hold each prompt once, so over
    the stream they add up to every prompt plus every token generated."""
    prompts = {"it-a": PROMPT, "it-b": [310, 311], "it-c": [320, 321, 322, 323]}
    lengths = {"it-a": 60, "it-b": 6, "it-c": 6}
    session = StreamSession(stub)
    session.flow(window=1)
    session.add(add_request("it-a", prompts["it-a"], lengths["it-a"]))
    reader = Reader(session)
    messages = [reader.next()]  # the window is full from here until the report below
    for rid in ("it-b", "it-c"):
        session.add(add_request(rid, prompts[rid], lengths[rid]))
    time.sleep(1.0)  # (hundreds of steps of the tiny model, on a slow machine tens)
    finished: set[str] = set()
    while True:
        finished |= {o.request_id for o in messages[-1].outputs if o.finish_reason}
        if finished == set(lengths):
            break
        session.flow(messages_read=len(messages))
        messages.append(reader.next())
    in_merged = {o.request_id for m in messages if m.step_tokens for o in m.outputs}
    assert {"it-b", "it-c"} <= in_merged  # their first tokens came while the window was full
    steps = _per_step_tokens(messages, prompts)
    assert sum(steps) == sum(map(len, prompts.values())) + sum(lengths.values())
    assert all(n > 0 for n in steps)
    session.half_close()
    assert reader.ended()


def test_a_refused_duplicate_id_does_not_end_the_running_request(
    stub: pb_grpc.EngineStub,
) -> None:
    """The refusal of an id already running is that id's error; the running request still
    delivers every token, and a half-closed stream waits for it."""
    expected = tokens_of(generate(stub, add_request("flow-dup-ref", PROMPT, 16)))
    session = StreamSession(stub)
    session.flow(window=1)
    session.add(add_request("flow-dup", PROMPT, 16))
    session.add(add_request("flow-dup", PROMPT, 16))
    session.half_close()
    reader = Reader(session)
    messages = reader.rest()
    assert reader.error is None
    errors = [e for m in messages for e in m.errors]
    assert [(e.request_id, e.code) for e in errors] == [
        ("flow-dup", pb.ERROR_CODE_DUPLICATE_REQUEST_ID)
    ]
    assert _tokens(messages, "flow-dup") == expected
    assert messages[-1].outputs[-1].finish_reason == pb.FINISH_REASON_LENGTH


def test_an_engine_that_stops_sends_what_it_holds_before_unavailable(
    tiny_models: dict[str, Path],
) -> None:
    """Shutdown with a client's window full: the held tokens and the request's ABORT reach it
    before the stream ends UNAVAILABLE (they were dropped when the stop closed the stream)."""
    server = InProcessEngine(lambda: tiny_core(tiny_models["llama"]), shutdown_timeout_s=0.3)
    server.start()
    stopper = threading.Thread(target=server.stop)
    try:
        with grpc.insecure_channel(server.address) as channel:
            session = StreamSession(pb_grpc.EngineStub(channel))
            session.flow(window=1)
            session.add(add_request("flow-stop", PROMPT, 200))
            reader = Reader(session)
            messages = [reader.next()]  # the window is full from here on: no report is sent
            stopper.start()
            messages += reader.rest()
            assert reader.error is not None
            assert reader.error.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
            # The request's last output came (ABORT at the drain timeout, or LENGTH on a fast
            # machine), with the steps held behind the full window.
            last = [o for m in messages for o in m.outputs][-1]
            assert last.finish_reason in (pb.FINISH_REASON_ABORT, pb.FINISH_REASON_LENGTH)
            assert len(messages) >= 2 and len(_tokens(messages, "flow-stop")) > 1
    finally:
        if stopper.ident is None:
            server.stop()
        stopper.join(30)


@pytest.mark.parametrize("window", [2, 3])
def test_the_gateways_client_under_other_windows_gets_every_token(
    engine: Engine, stub: pb_grpc.EngineStub, window: int
) -> None:
    """The gateway's EngineClient reports progress each time it has read a window's worth; with
    windows other than the default (2: every other message; 3: an odd one) against the real engine,
    concurrent requests get every token Generate gives, and nothing stalls."""
    import asyncio
    import contextlib

    from frontend_svc.config import BackoffConfig
    from frontend_svc.engine.client import EngineClient
    from protos.types import EngineRequest, EngineSamplingParams, FinishReason

    lengths = {f"w{window}-{i}": 20 + 7 * i for i in range(5)}
    expected = {
        rid: tokens_of(generate(stub, add_request(f"{rid}-ref", PROMPT, n)))
        for rid, n in lengths.items()
    }

    async def one(client: EngineClient, rid: str) -> list[int]:
        params = EngineSamplingParams(max_tokens=lengths[rid], temperature=0.0, ignore_eos=True)
        tokens: list[int] = []
        async with contextlib.aclosing(
            client.generate(EngineRequest(rid, tuple(PROMPT), params))
        ) as outputs:
            async for out in outputs:
                tokens.extend(out.new_token_ids)
        assert out.finish_reason is FinishReason.LENGTH
        return tokens

    async def scenario() -> dict[str, list[int]]:
        client = EngineClient(engine.address, BackoffConfig(0.05, 0.2), window=window)
        client.start()
        try:
            assert await client.wait_connected(30)
            got = await asyncio.wait_for(
                asyncio.gather(*(one(client, rid) for rid in lengths)), timeout=60
            )
            return dict(zip(lengths, got, strict=True))
        finally:
            await client.close()

    assert asyncio.run(scenario()) == expected


def test_the_gateways_client_hands_on_each_merged_steps_tokens(engine: Engine) -> None:
    """A gateway whose loop stalls gets the steps merged; what it reports per engine message
    (its step event, behind vllm:iteration_tokens_total) then carries the engine's count of each
    step, and over the run the counts add up to the prompt once plus every token."""
    import asyncio
    import contextlib
    from collections.abc import Sequence

    from frontend_svc.config import BackoffConfig
    from frontend_svc.engine.client import EngineClient
    from frontend_svc.engine.events import EngineEvents
    from protos.types import EngineRequest, EngineSamplingParams

    calls: list[tuple[int, int, list[int]]] = []

    class Steps(EngineEvents):
        def step(self, address: str, prompt: int, generated: int, steps: Sequence[int]) -> None:
            calls.append((prompt, generated, list(steps)))

    async def scenario() -> None:
        client = EngineClient(
            engine.address,
            BackoffConfig(0.05, 0.2),
            window=1,
            events=Steps(),
        )
        client.start()
        try:
            assert await client.wait_connected(30)
            params = EngineSamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
            request = EngineRequest("merged-steps", tuple(PROMPT), params)
            stalled = False
            async with contextlib.aclosing(client.generate(request)) as outputs:
                async for out in outputs:
                    if not stalled:  # the whole loop stalls once: the engine holds its steps
                        stalled = True
                        time.sleep(0.5)
                    if out.finish_reason is not None:
                        break
        finally:
            await client.close()

    asyncio.run(scenario())
    assert any(steps for _, _, steps in calls), calls  # at least one message merged steps
    assert sum(p + g for p, g, _ in calls) == len(PROMPT) + 40
    per_step = [n for p, g, steps in calls for n in (steps or [p + g])]
    assert per_step == [len(PROMPT) + 1] + [1] * 39
