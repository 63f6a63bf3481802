"""EngineClient against the fake engine: demultiplexing, per-request errors, abort on close, the
events it tells its observer."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence

import pytest

from frontend_svc.config import BackoffConfig
from frontend_svc.engine.client import EngineClient
from frontend_svc.engine.errors import EngineRequestError, EngineUnavailableError
from frontend_svc.engine.events import EngineEvents
from protos.types import (
    EngineErrorCode,
    EngineRequest,
    EngineSamplingParams,
    FinishReason,
    LoadFigures,
    ModelInfo,
    TokenizerFiles,
)
from tests.frontend.fake_engine import FakeEngine
from tests.frontend.harness import wait_for

pytestmark = pytest.mark.timeout(30)


def request(rid: str, prompt: tuple[int, ...] = (5, 6, 7), **params: object) -> EngineRequest:
    return EngineRequest(rid, prompt, EngineSamplingParams(**params))  # type: ignore[arg-type]


async def _collect(client: EngineClient, req: EngineRequest) -> list[int]:
    tokens: list[int] = []
    async with contextlib.aclosing(client.generate(req)) as outputs:
        async for out in outputs:
            tokens.extend(out.new_token_ids)
            last = out
    assert last.finish_reason is FinishReason.LENGTH
    return tokens


def test_demux_errors_and_abort(engine: FakeEngine) -> None:
    async def scenario() -> None:
        client = EngineClient(engine.address, BackoffConfig(0.05, 0.2))
        client.start()
        assert await client.wait_connected(5)
        assert client.model_info is not None and client.model_info.max_model_len == 256

        # a bad request fails alone; the good ones on the same stream carry on
        bad = _collect(client, request("bad", prompt=()))
        results = await asyncio.gather(
            _collect(client, request("a", max_tokens=5)),
            _collect(client, request("b", max_tokens=7, seed=3)),
            bad,
            return_exceptions=True,
        )
        assert [len(r) for r in results[:2]] == [5, 7]  # type: ignore[arg-type]
        assert isinstance(results[2], EngineRequestError)
        assert results[2].code is EngineErrorCode.INVALID_ARGUMENT

        # closing a generator early aborts the request on the engine
        gen = client.generate(request("c", max_tokens=200))
        await gen.__anext__()
        await gen.aclose()
        await asyncio.to_thread(wait_for, lambda: "c" in engine.aborted, 5, "abort of c")
        assert client.num_in_flight == 0

        # closing it right after the last output aborts nothing: the request has ended
        gen = client.generate(request("e", max_tokens=1))
        assert (await gen.__anext__()).finish_reason is FinishReason.LENGTH
        await gen.aclose()
        await asyncio.sleep(0.1)  # an abort, had one been sent, would be in by now
        assert "e" not in engine.abort_requests and "c" in engine.abort_requests

        await client.close()
        with pytest.raises(EngineUnavailableError):
            await client.generate(request("d")).__anext__()

    asyncio.run(scenario())


def test_a_consumer_that_falls_behind_gets_the_steps_merged(engine: FakeEngine) -> None:
    """While the consumer is busy the engine keeps stepping; its next read takes everything
    since the last one as one output, not one queued output per step."""

    async def scenario() -> None:
        client = EngineClient(engine.address, BackoffConfig(0.05, 0.2))
        client.start()
        assert await client.wait_connected(5)
        reports = len(engine.flow)
        gen = client.generate(request("slow", max_tokens=30))
        first = await gen.__anext__()
        assert len(first.new_token_ids) == 1

        def all_read() -> bool:  # this stream's client reported reading all 30 step messages
            return max((read for _, read in engine.flow[reports:]), default=0) >= 30

        # The engine finishes meanwhile and the client takes every message in; a fixed sleep
        # (30 steps + 0.3 s) raced a loaded machine, a window of one being a round trip a step.
        await asyncio.to_thread(wait_for, all_read, 5, "the client reading every message")
        rest = await gen.__anext__()
        assert len(rest.new_token_ids) == 29 and rest.finish_reason is FinishReason.LENGTH
        assert len(rest.logprobs) == 0 and rest.request_id == "slow"
        with pytest.raises(StopAsyncIteration):
            await gen.__anext__()
        await client.close()

    asyncio.run(scenario())


def test_a_report_leaves_after_the_consumer_has_taken_the_message(
    engine: FakeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The progress report for a message queues on the event loop behind the request it woke:
    with a window of one, the engine sends its next message only once the gateway has handed the
    last one on, not merely read it (so an engine outpacing the relaying merges its steps).
    (Best effort: a report can overtake when the loop takes a message and the end of the previous
    report's write in one turn, after a stall longer than a step; the slow steps here keep that
    away.)"""
    import frontend_svc.engine.client as engine_client

    events: list[tuple[str, int]] = []
    drain = engine_client._drain

    async def recording_drain(outbox):  # type: ignore[no-untyped-def]
        async for item in drain(outbox):
            if item.WhichOneof("kind") == "flow" and item.flow.messages_read:
                events.append(("report", item.flow.messages_read))
            yield item

    monkeypatch.setattr(engine_client, "_drain", recording_drain)
    monkeypatch.setattr(engine, "step_s", 0.03)

    async def scenario() -> None:
        client = EngineClient(engine.address, BackoffConfig(0.05, 0.2), window=1)
        client.start()
        assert await client.wait_connected(5)
        taken = 0
        async with contextlib.aclosing(client.generate(request("r", max_tokens=12))) as outputs:
            async for out in outputs:
                taken += len(out.new_token_ids)
                events.append(("taken", taken))
        await asyncio.sleep(0.1)  # the last report is out by now
        await client.close()

    asyncio.run(scenario())
    reports = [n for kind, n in events if kind == "report"]
    assert reports == list(range(1, len(reports) + 1)) and len(reports) >= 6
    taken = 0
    for kind, n in events:  # one token per message: report k comes after token k was taken
        if kind == "taken":
            taken = n
        else:
            assert taken >= n, events


@pytest.mark.parametrize("window", [4, 0])
def test_the_stream_window_is_sent_and_progress_reported_every_window(
    engine: FakeEngine, window: int
) -> None:
    """The client's FlowControl: its window first, then its count of messages read each time a
    window's worth has been read (the engine then has a whole window of room); none with 0."""

    engine.flow.clear()

    async def scenario() -> None:
        client = EngineClient(engine.address, BackoffConfig(0.05, 0.2), window=window)
        client.start()
        assert await client.wait_connected(5)
        assert len(await _collect(client, request("w", max_tokens=12))) == 12
        await asyncio.sleep(0.1)  # the last report, if any, is in by now
        await client.close()

    asyncio.run(scenario())
    if not window:
        assert engine.flow == []
        return
    assert engine.flow[0] == (window, 0)
    reads = [read for w, read in engine.flow[1:]]
    assert all(w == 0 for w, _ in engine.flow[1:])
    assert len(reads) >= 12 // window  # one message per token at least
    assert reads == list(range(window, window * len(reads) + 1, window))


class _Recorder(EngineEvents):
    """Every event, as (kind, address, detail)."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, int | None]] = []

    async def connected(self, address: str, info: ModelInfo, files: TokenizerFiles) -> None:
        self.seen.append(("connected", address, info.max_model_len))

    def disconnected(self, address: str) -> None:
        self.seen.append(("disconnected", address, None))

    def load(self, address: str, load: LoadFigures) -> None:
        self.seen.append(("load", address, load.num_running))

    def step(self, address: str, prompt: int, generated: int, steps: Sequence[int]) -> None:
        self.seen.append(("step", address, prompt + generated))


def test_the_client_tells_its_observer_about_its_engine(engine: FakeEngine) -> None:
    events = _Recorder()

    async def scenario() -> None:
        client = EngineClient(engine.address, BackoffConfig(0.05, 0.2), events=events)
        client.start()
        assert await client.wait_connected(5)
        assert len(await _collect(client, request("r", max_tokens=6))) == 6
        await client.close()

    asyncio.run(scenario())
    kinds = [kind for kind, _, _ in events.seen]
    assert kinds[0] == "connected" and kinds[-1] == "disconnected" and "load" in kinds
    assert events.seen[0] == ("connected", engine.address, 256)
    assert {address for _, address, _ in events.seen} == {engine.address}
    # every token once, and the prompt once with the first
    assert sum(n or 0 for kind, _, n in events.seen if kind == "step") == 3 + 6


def test_an_abort_before_the_first_output_is_unavailable(
    engine: FakeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A draining engine ends a request still waiting with an ABORT and no token: the request
    never ran there, so the client raises EngineUnavailableError (the pool moves it)."""
    monkeypatch.setattr(engine, "step_s", 30.0)  # no token comes before the abort

    async def scenario() -> None:
        client = EngineClient(engine.address, BackoffConfig(0.05, 0.2))
        client.start()
        assert await client.wait_connected(5)
        gen = client.generate(request("waiting", max_tokens=5))
        first = asyncio.ensure_future(gen.__anext__())
        await asyncio.to_thread(wait_for, lambda: engine.num_in_flight == 1, 5, "the add")
        assert engine._loop is not None
        engine._loop.call_soon_threadsafe(engine.abort, ["waiting"])
        with pytest.raises(EngineUnavailableError, match="aborted the request"):
            await first
        assert client.num_in_flight == 0
        await client.close()

    asyncio.run(scenario())
