"""EnginePool against several fake engines: spreading, prefix affinity, failover, DNS, /health.

Most tests drive the pool directly on their own event loop (``asyncio.run``); which engine took a
request is read from ``FakeEngine.added``. The last ones go through the real gateway over HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from tokenizers import Tokenizer

from frontend_svc.config import BackoffConfig, FrontendConfig, RoutingConfig
from frontend_svc.engine.client import EngineClient
from frontend_svc.engine.errors import EngineRequestError, EngineUnavailableError
from frontend_svc.engine.events import EngineEvents
from frontend_svc.engine.pool import EnginePool
from frontend_svc.engine.targets import EngineTarget, parse_engine_targets
from protos.tandem.engine.v1 import engine_pb2 as pb
from protos.types import (
    EngineErrorCode,
    EngineOutput,
    EngineRequest,
    EngineSamplingParams,
    FinishReason,
    LoadFigures,
    ModelInfo,
    TokenizerFiles,
)
from tests.frontend.conftest import make_engine
from tests.frontend.fake_engine import MODEL_NAME, FakeEngine, Sink
from tests.frontend.harness import GatewayServer, free_port, wait_for

pytestmark = pytest.mark.timeout(30)

PREFIX = tuple(range(10, 18))  # two KV blocks of the fake engine (block_size 4)


# -- helpers --------------------------------------------------------------------------------------


class Engines:
    """The fake engines of one test; ``run`` drives a scenario, then stops them all."""

    def __init__(self, tokenizer_dir: Path, hf_tokenizer: Tokenizer) -> None:
        self.tokenizer_dir = tokenizer_dir
        self.hf_tokenizer = hf_tokenizer
        self.started: list[FakeEngine] = []

    def start(self, port: int = 0, **kwargs: object) -> FakeEngine:
        """A fake engine serving on ``port`` (0: any); FakeEngine keywords pass through."""
        e = make_engine(self.tokenizer_dir, self.hf_tokenizer, **kwargs)
        e.start(port)
        self.started.append(e)
        return e

    def run(self, scenario: Coroutine[Any, Any, None]) -> None:
        # Stopped before pytest renders a failure: the engine threads log asyncio errors whose
        # tracebacks (ast.parse) race pytest's own on CPython 3.11.7 and crash the session.
        try:
            asyncio.run(scenario)
        finally:
            self.stop()

    def stop(self) -> None:
        for e in self.started:
            e.stop()


@pytest.fixture()
def engines(tokenizer_dir: Path, hf_tokenizer: Tokenizer) -> Iterator[Engines]:
    fleet = Engines(tokenizer_dir, hf_tokenizer)
    yield fleet
    fleet.stop()


def pool_config(address: str, **routing: Any) -> FrontendConfig:
    return FrontendConfig(
        engine_address=address,
        backoff=BackoffConfig(initial_s=0.05, max_s=0.2),
        engine_rpc_timeout_s=2.0,
        routing=RoutingConfig(**routing),
    )


@contextlib.asynccontextmanager
async def running_pool(
    config: FrontendConfig,
    on_connect: Callable[[ModelInfo, TokenizerFiles], Awaitable[None]] | None = None,
) -> AsyncIterator[EnginePool]:
    pool = EnginePool(config, _Connecting(on_connect) if on_connect else None)
    pool.start()
    try:
        yield pool
    finally:
        await pool.close()


class _Connecting(EngineEvents):
    """Tells ``on_connect`` of every engine the pool accepts."""

    def __init__(self, on_connect: Callable[[ModelInfo, TokenizerFiles], Awaitable[None]]) -> None:
        self.on_connect = on_connect

    async def connected(self, address: str, info: ModelInfo, files: TokenizerFiles) -> None:
        await self.on_connect(info, files)


def request(rid: str, prompt: tuple[int, ...] = (5, 6, 7), max_tokens: int = 3) -> EngineRequest:
    return EngineRequest(rid, prompt, EngineSamplingParams(max_tokens=max_tokens))


async def complete(pool: EnginePool, req: EngineRequest) -> tuple[int, ...]:
    """Run ``req`` to the end; its tokens (the request must end by length)."""
    tokens: list[int] = []
    last: EngineOutput | None = None
    async with contextlib.aclosing(pool.generate(req)) as outputs:
        async for last in outputs:
            tokens.extend(last.new_token_ids)
    assert last is not None and last.finish_reason is FinishReason.LENGTH, last
    return tuple(tokens)


async def until(predicate: Callable[[], bool], what: str, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


def usable(pool: EnginePool) -> set[str]:
    return {str(d["address"]) for d in pool.members.describe() if d["serving"]}


def entry(pool: EnginePool, address: str) -> dict[str, object] | None:
    return next((d for d in pool.members.describe() if d["address"] == address), None)


def on(engine: FakeEngine, rids: list[str]) -> list[str]:
    """The ids among ``rids`` that ``engine`` admitted."""
    return [r for r in rids if r in engine.added]


def record_adds(engine: FakeEngine) -> list[str]:
    """Make ``engine`` note every request id it is asked to add, admitted or not."""
    asked: list[str] = []
    add = engine.add

    def recording(message: pb.AddRequest, sink: Sink) -> str | None:
        asked.append(message.request_id)
        return add(message, sink)

    engine.add = recording  # type: ignore[assignment,method-assign]
    return asked


def refuse_adds(engine: FakeEngine, code: pb.ErrorCode, message: str) -> None:
    """Make ``engine`` answer every new request with a RequestError (e.g. while it drains)."""

    def refusing(add: pb.AddRequest, sink: Sink) -> None:
        err = pb.RequestError(request_id=add.request_id, code=code, message=message)
        sink.put_nowait((pb.EngineCoreOutputs(errors=[err]), 0))

    engine.add = refusing  # type: ignore[assignment,method-assign]


# -- --engine parsing -----------------------------------------------------------------------------


def test_parse_engine_targets_good() -> None:
    assert parse_engine_targets("engine:50051") == [EngineTarget("engine", 50051)]
    assert parse_engine_targets(" a:1 , b:65535,, 10.0.0.7:2 ") == [
        EngineTarget("a", 1),
        EngineTarget("b", 65535),
        EngineTarget("10.0.0.7", 2),
    ]
    [v6] = parse_engine_targets("[::1]:50051")
    assert v6 == EngineTarget("::1", 50051) and v6.address == "[::1]:50051"
    [dns] = parse_engine_targets("dns:///tandem-engine.default.svc:50051")
    assert dns == EngineTarget("tandem-engine.default.svc", 50051, dns=True)
    assert dns.address == "tandem-engine.default.svc:50051"
    assert [t.dns for t in parse_engine_targets("a:1,dns:///b:2")] == [False, True]


@pytest.mark.parametrize(
    ("spec", "named"),
    [
        ("engine", "engine"),
        ("a:1,engine", "engine"),
        ("engine:0", "engine:0"),
        ("engine:70000", "engine:70000"),
        ("engine:-1", "engine:-1"),
        ("engine:http", "engine:http"),
        (":50051", ":50051"),
        ("http://engine:1", "http://engine:1"),
        ("dns:///engine", "dns:///engine"),
        ("dns://engine:1", "dns://engine:1"),
        ("dns:///http://engine:1", "dns:///http://engine:1"),
    ],
)
def test_parse_engine_targets_bad(spec: str, named: str) -> None:
    with pytest.raises(ValueError) as e:
        parse_engine_targets(spec)
    assert repr(named) in str(e.value)


@pytest.mark.parametrize("spec", ["", " ", " , ,"])
def test_parse_engine_targets_empty(spec: str) -> None:
    with pytest.raises(ValueError, match="no engine address"):
        parse_engine_targets(spec)


@pytest.mark.parametrize("spec", ["::1", "fe80::1", "[::1:50051", "::1]:50051"])
def test_parse_engine_targets_rejects_unbracketed_ipv6(spec: str) -> None:
    # "::1" is taken today as host ":" port 1, "[::1:50051" as host "[::1"
    with pytest.raises(ValueError) as e:
        parse_engine_targets(spec)
    assert repr(spec) in str(e.value)


# -- spreading and prefix affinity ---------------------------------------------------------------


def test_a_request_closed_early_is_aborted_and_a_finished_one_is_not(engines: Engines) -> None:
    # Closing the pool's generator mid-stream must abort the request on the engine (through
    # EngineClient.generate, which it runs), and closing it after the last output must not.
    a = engines.start()

    async def scenario() -> None:
        async with running_pool(pool_config(a.address)) as pool:
            await until(lambda: usable(pool) == {a.address}, "the engine")
            early = pool.generate(request("early", max_tokens=200))
            assert (await early.__anext__()).new_token_ids
            await early.aclose()
            await until(lambda: "early" in a.aborted, "the abort")
            assert len(await complete(pool, request("whole", max_tokens=3))) == 3
            kept = pool.generate(request("kept", max_tokens=1))
            last = await kept.__anext__()
            assert last.finish_reason is FinishReason.LENGTH
            await kept.aclose()  # closed after its last output: nothing to abort
            await until(lambda: a.num_in_flight == 0, "the requests to end")
            await asyncio.sleep(0.05)  # an abort, had one been sent, would be in by now
            assert a.abort_requests == ["early"]

    engines.run(scenario())


def test_simultaneous_requests_split_evenly(engines: Engines) -> None:
    a, b = engines.start(), engines.start()

    async def scenario() -> None:
        async with running_pool(pool_config(f"{a.address}, {b.address}")) as pool:
            await until(lambda: usable(pool) == {a.address, b.address}, "both engines")

            async def burst(rids: list[str]) -> None:
                # every pick happens before any engine answers: only the local in-flight
                # count moves, and least-load alone makes the split exact
                results = await asyncio.gather(
                    *(complete(pool, request(r, (5 + i, 6, 7))) for i, r in enumerate(rids))
                )
                assert [len(t) for t in results] == [3] * len(rids)

            rids = [f"r{i}" for i in range(10)]
            await burst(rids)
            assert len(on(a, rids)) == 5 and len(on(b, rids)) == 5
            assert pool.members.num_in_flight == 0

            # one engine already runs a request (and has reported it): 9 more even things out
            held = pool.generate(request("held", max_tokens=200))
            await held.__anext__()
            more = [f"m{i}" for i in range(9)]
            await burst(more)
            await held.aclose()
            assert len(on(a, [*more, "held"])) == 5 and len(on(b, [*more, "held"])) == 5

    engines.run(scenario())


def test_least_loaded_engine_wins_counting_other_gateways_requests(
    engines: Engines,
) -> None:
    a, b = engines.start(), engines.start()

    async def scenario() -> None:
        other_gateway = EngineClient(b.address, BackoffConfig(0.05, 0.2))
        other_gateway.start()
        async with running_pool(pool_config(f"{a.address},{b.address}")) as pool:
            await until(lambda: usable(pool) == {a.address, b.address}, "both engines")
            assert await other_gateway.wait_connected(5)
            held = [pool.generate(request(r, max_tokens=200)) for r in ("h0", "h1")]
            held += [other_gateway.generate(request(r, max_tokens=200)) for r in ("o0", "o1")]
            try:
                await asyncio.gather(*(g.__anext__() for g in held))
                assert len(on(a, ["h0", "h1"])) == 1 and len(on(b, ["h0", "h1"])) == 1
                # b runs 3 (1 from this pool): its load figures outweigh the local count of 1
                await until(lambda: (entry(pool, b.address) or {}).get("load") == 3, "b's load")
                rids = [f"r{k}" for k in range(4)]
                for rid in rids:
                    await complete(pool, request(rid))
                assert on(a, rids) == rids
            finally:
                for g in held:
                    await g.aclose()
        await other_gateway.close()

    engines.run(scenario())


def test_prefix_affinity_keeps_a_shared_prefix_on_one_engine(engines: Engines) -> None:
    a, b = engines.start(), engines.start()

    async def scenario() -> None:
        config = pool_config(f"{a.address},{b.address}", affinity_min_tokens=8)
        async with running_pool(config) as pool:
            await until(lambda: usable(pool) == {a.address, b.address}, "both engines")
            # 8 shared tokens = 2 whole blocks >= min_tokens: one after the other, all on one
            same = [f"same{k}" for k in range(4)]
            for k, rid in enumerate(same):
                await complete(pool, request(rid, PREFIX + (50 + k, 60 + k)))
            assert sorted([len(on(a, same)), len(on(b, same))]) == [0, 4]

            # 7 shared tokens match one whole block only (4 < 8): ties go round-robin
            short = [f"short{k}" for k in range(4)]
            for k, rid in enumerate(short):
                await complete(pool, request(rid, PREFIX[:7] + (70 + k, 80 + k, 90 + k)))
            assert len(on(a, short)) == 2 and len(on(b, short)) == 2

    engines.run(scenario())


def test_prefix_affinity_off_spreads(engines: Engines) -> None:
    a, b = engines.start(), engines.start()

    async def scenario() -> None:
        config = pool_config(f"{a.address},{b.address}", affinity_min_tokens=0)
        async with running_pool(config) as pool:
            await until(lambda: usable(pool) == {a.address, b.address}, "both engines")
            rids = [f"r{k}" for k in range(4)]
            for k, rid in enumerate(rids):
                await complete(pool, request(rid, PREFIX * 2 + (50 + k,)))
            assert len(on(a, rids)) == 2 and len(on(b, rids)) == 2

    engines.run(scenario())


def test_prefix_affinity_yields_past_max_imbalance(engines: Engines) -> None:
    a, b = engines.start(), engines.start()

    async def scenario() -> None:
        config = pool_config(
            f"{a.address},{b.address}", affinity_min_tokens=8, affinity_max_imbalance=2
        )
        async with running_pool(config) as pool:
            await until(lambda: usable(pool) == {a.address, b.address}, "both engines")
            gens = []
            try:
                for k in range(4):  # each one running (first token seen) before the next
                    gen = pool.generate(request(f"r{k}", PREFIX + (50 + k,), max_tokens=200))
                    gens.append(gen)
                    assert (await gen.__anext__()).new_token_ids
                first = a if "r0" in a.added else b
                other = b if first is a else a
                # loads 1-0 and 2-0 are within the imbalance of 2; 3-0 is not
                assert on(first, ["r0", "r1", "r2", "r3"]) == ["r0", "r1", "r2"]
                assert on(other, ["r0", "r1", "r2", "r3"]) == ["r3"]
            finally:
                for gen in gens:
                    await gen.aclose()
            await until(lambda: a.num_in_flight == b.num_in_flight == 0, "the aborts")

    engines.run(scenario())


# -- failover -------------------------------------------------------------------------------------


def test_engine_death_fails_its_streams_and_new_requests_go_elsewhere(
    engines: Engines,
) -> None:
    a, b = engines.start(), engines.start()

    async def scenario() -> None:
        async with running_pool(pool_config(f"{a.address},{b.address}")) as pool:
            await until(lambda: usable(pool) == {a.address, b.address}, "both engines")
            rids = [f"long{k}" for k in range(4)]
            gens = [pool.generate(request(r, max_tokens=200)) for r in rids]
            try:
                firsts = await asyncio.gather(*(g.__anext__() for g in gens))
                assert all(f.new_token_ids for f in firsts)
                assert len(on(a, rids)) == 2 and len(on(b, rids)) == 2

                await asyncio.to_thread(b.stop)
                for rid, gen in zip(rids, gens, strict=True):
                    if rid in b.added:  # had produced tokens: the error is the caller's
                        with pytest.raises(EngineUnavailableError):
                            async for _ in gen:
                                pass
                    else:  # the survivor's streams carry on
                        assert (await gen.__anext__()).new_token_ids
            finally:
                for gen in gens:
                    await gen.aclose()

            assert usable(pool) == {a.address}
            described = entry(pool, b.address)
            assert described is not None and described["error"]
            after = [f"after{k}" for k in range(4)]
            for rid in after:
                assert len(await complete(pool, request(rid))) == 3
            assert on(a, after) == after

    engines.run(scenario())


def test_engine_breaking_before_first_token_is_retried_elsewhere(
    engines: Engines,
) -> None:
    a, slow = engines.start(), engines.start(step_s=30.0)  # slow never produces a token here

    async def scenario() -> None:
        async with running_pool(pool_config(f"{a.address},{slow.address}")) as pool:
            await until(lambda: usable(pool) == {a.address, slow.address}, "both engines")
            tasks = [
                asyncio.create_task(complete(pool, request(r, max_tokens=5))) for r in ("x", "y")
            ]
            await until(lambda: slow.num_in_flight == 1, "a request waiting on the slow engine")
            [moved] = on(slow, ["x", "y"])
            await asyncio.to_thread(slow.stop)
            results = await asyncio.gather(*tasks)
            assert [len(t) for t in results] == [5, 5]
            assert on(a, ["x", "y"]) == ["x", "y"] and moved in a.added

    engines.run(scenario())


def test_engine_aborting_before_first_token_is_retried_elsewhere(
    engines: Engines,
) -> None:
    # A draining engine ends requests still waiting at its deadline with a final ABORT output
    # and no token (engine_svc EngineLoop.drain_and_abort); nothing reached the client yet.
    a, slow = engines.start(), engines.start(step_s=30.0)

    async def scenario() -> None:
        async with running_pool(pool_config(f"{a.address},{slow.address}")) as pool:
            await until(lambda: usable(pool) == {a.address, slow.address}, "both engines")
            tasks = [
                asyncio.create_task(complete(pool, request(r, max_tokens=5))) for r in ("x", "y")
            ]
            await until(lambda: slow.num_in_flight == 1, "a request waiting on the slow engine")
            [moved] = on(slow, ["x", "y"])
            assert slow._loop is not None
            slow._loop.call_soon_threadsafe(slow.abort, [moved])
            results = await asyncio.gather(*tasks)
            assert [len(t) for t in results] == [5, 5]
            assert moved in a.added

    engines.run(scenario())


@pytest.mark.parametrize("refusal", ["queue_full", "draining"])
def test_refused_request_is_served_by_the_other_engine(engines: Engines, refusal: str) -> None:
    if refusal == "queue_full":
        a, full = engines.start(), engines.start(max_requests=0)
        asked = record_adds(full)
    else:
        a, full = engines.start(), engines.start()
        refuse_adds(full, pb.ERROR_CODE_UNAVAILABLE, "draining")
        asked = record_adds(full)

    async def scenario() -> None:
        async with running_pool(pool_config(f"{a.address},{full.address}")) as pool:
            await until(lambda: usable(pool) == {a.address, full.address}, "both engines")
            rids = [f"r{k}" for k in range(4)]
            for rid in rids:
                assert len(await complete(pool, request(rid))) == 3
            assert asked and set(asked) <= set(rids)  # the refusing engine was tried
            assert on(a, rids) == rids
            assert usable(pool) == {a.address, full.address}  # a refusal is not an outage

    engines.run(scenario())


def test_all_engines_full_is_resource_exhausted(engines: Engines) -> None:
    a, b = engines.start(max_requests=0), engines.start(max_requests=0)
    asked_a, asked_b = record_adds(a), record_adds(b)

    async def scenario() -> None:
        async with running_pool(pool_config(f"{a.address},{b.address}")) as pool:
            await until(lambda: usable(pool) == {a.address, b.address}, "both engines")
            with pytest.raises(EngineRequestError) as e:
                await complete(pool, request("r"))
            assert e.value.code is EngineErrorCode.RESOURCE_EXHAUSTED
            assert asked_a == asked_b == ["r"]  # each engine tried once
            assert pool.members.num_in_flight == 0

    engines.run(scenario())


def test_invalid_request_is_not_retried(engines: Engines) -> None:
    a, b = engines.start(), engines.start()
    asked_a, asked_b = record_adds(a), record_adds(b)

    async def scenario() -> None:
        async with running_pool(pool_config(f"{a.address},{b.address}")) as pool:
            await until(lambda: usable(pool) == {a.address, b.address}, "both engines")
            with pytest.raises(EngineRequestError) as e:
                await complete(pool, request("bad", prompt=(10_000,)))
            assert e.value.code is EngineErrorCode.INVALID_ARGUMENT
            assert sorted([len(asked_a), len(asked_b)]) == [0, 1]

    engines.run(scenario())


def test_restarted_engine_rejoins(engines: Engines) -> None:
    a, b = engines.start(), engines.start()

    async def scenario() -> None:
        async with running_pool(pool_config(f"{a.address},{b.address}")) as pool:
            await until(lambda: usable(pool) == {a.address, b.address}, "both engines")
            await asyncio.to_thread(b.stop)
            await until(lambda: usable(pool) == {a.address}, "the stopped engine to leave")
            down = ["d0", "d1"]
            await asyncio.gather(*(complete(pool, request(r)) for r in down))
            assert on(a, down) == down

            await asyncio.to_thread(b.start, b.port)
            await until(lambda: usable(pool) == {a.address, b.address}, "the engine to rejoin")
            back = ["b0", "b1"]
            await asyncio.gather(*(complete(pool, request(r)) for r in back))
            assert len(on(a, back)) == 1 and len(on(b, back)) == 1

    engines.run(scenario())


# -- engines that do not match -------------------------------------------------------------------


def test_engine_with_another_model_is_refused(engines: Engines) -> None:
    a = engines.start()
    port = free_port()
    other = f"127.0.0.1:{port}"

    async def scenario() -> None:
        async with running_pool(pool_config(f"{a.address},{other}")) as pool:
            await until(lambda: usable(pool) == {a.address}, "the first engine")
            wrong = await asyncio.to_thread(engines.start, port, model_name="another-model")

            def refused() -> bool:
                described = entry(pool, other)
                return described is not None and "another-model" in str(described.get("error"))

            await until(refused, "the mismatch to be reported")
            described = entry(pool, other)
            assert described is not None and described["connected"] is False
            assert MODEL_NAME in str(described["error"])
            rids = [f"r{k}" for k in range(4)]
            for rid in rids:
                await complete(pool, request(rid))
            assert on(a, rids) == rids and wrong.added == []
            assert usable(pool) == {a.address}

    engines.run(scenario())


def test_engines_of_different_models_connecting_together_are_not_both_accepted(
    engines: Engines,
) -> None:
    # The gateway's EngineEvents.connected loads the tokenizer (an await); engines connect
    # concurrently.
    a, b = engines.start(), engines.start(model_name="another-model")

    async def slow_tokenizer_load(info: ModelInfo, files: TokenizerFiles) -> None:
        await asyncio.sleep(0.2)

    async def scenario() -> None:
        config = pool_config(f"{a.address},{b.address}")
        async with running_pool(config, on_connect=slow_tokenizer_load) as pool:
            await until(lambda: bool(usable(pool)), "an engine")
            await asyncio.sleep(0.6)  # time for the other one to connect or be refused
            assert len(usable(pool)) == 1, pool.members.describe()

    engines.run(scenario())


def test_shorter_context_engine_tightens_the_limit(engines: Engines) -> None:
    a = engines.start()
    port = free_port()
    seen: list[int] = []

    async def on_connect(info: ModelInfo, files: TokenizerFiles) -> None:
        seen.append(info.max_model_len)

    async def scenario() -> None:
        async with running_pool(pool_config(f"{a.address},127.0.0.1:{port}"), on_connect) as pool:
            await until(lambda: seen == [256], "the first engine")
            short = await asyncio.to_thread(engines.start, port, max_model_len=128)
            await until(lambda: len(usable(pool)) == 2, "the second engine")
            assert seen == [256, 128] and short.added == []
            # the longer one reconnecting still reports the tightest limit
            await asyncio.to_thread(a.stop)
            await until(lambda: len(usable(pool)) == 1, "the first engine to leave")
            await asyncio.to_thread(a.start, a.port)
            await until(lambda: len(usable(pool)) == 2, "the first engine to reconnect")
            assert seen == [256, 128, 128]

    engines.run(scenario())


class _Recorder(EngineEvents):
    """Every event the pool tells its observer, as (kind, address)."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []
        self.generated = 0

    async def connected(self, address: str, info: ModelInfo, files: TokenizerFiles) -> None:
        self.seen.append(("connected", address))

    def accepted(self, address: str, info: ModelInfo) -> None:
        self.seen.append(("accepted", address))

    def disconnected(self, address: str) -> None:
        self.seen.append(("disconnected", address))

    def load(self, address: str, load: LoadFigures) -> None:
        self.seen.append(("load", address))

    def step(self, address: str, prompt: int, generated: int, steps: Sequence[int]) -> None:
        self.seen.append(("step", address))
        self.generated += generated

    def routed(self, address: str, affinity_tokens: int) -> None:
        self.seen.append(("routed", address))


def test_the_pool_tells_its_observer_about_every_engine(engines: Engines) -> None:
    a = engines.start()
    events = _Recorder()

    async def scenario() -> None:
        pool = EnginePool(pool_config(a.address), events)
        pool.start()
        try:
            await until(lambda: usable(pool) == {a.address}, "the engine")
            assert events.seen[:2] == [("connected", a.address), ("accepted", a.address)]
            del events.seen[:2]
            assert len(await complete(pool, request("r", max_tokens=4))) == 4
            assert events.seen[0] == ("routed", a.address) and events.generated == 4
            assert {kind for kind, _ in events.seen} == {"routed", "load", "step"}
            await asyncio.to_thread(a.stop)
            await until(lambda: ("disconnected", a.address) in events.seen, "the disconnection")
        finally:
            await pool.close()

    engines.run(scenario())


# -- DNS ----------------------------------------------------------------------------------------


def test_dns_localhost_connects(engines: Engines) -> None:
    a = engines.start()

    async def scenario() -> None:
        config = pool_config(f"dns:///localhost:{a.port}", resolve_interval_s=0.05)
        async with running_pool(config) as pool:
            # localhost may also resolve to ::1, where the fake engine does not listen
            await until(lambda: a.address in usable(pool), "the engine behind localhost")
            assert len(await complete(pool, request("r"))) == 3
            assert a.added == ["r"]

    engines.run(scenario())


def test_dns_answers_change_engines_join_and_retire(engines: Engines) -> None:
    a = engines.start()
    b = engines.start(a.port, host="127.0.0.2", step_s=0.01)  # another "pod", same port
    name = "engines.test"
    answers: list[str] | None = ["127.0.0.1", "127.0.0.2"]

    async def scenario() -> None:
        nonlocal answers
        loop = asyncio.get_running_loop()
        real_getaddrinfo = loop.getaddrinfo

        async def getaddrinfo(host: str, port: int, **kwargs: Any) -> list[Any]:
            if host != name:
                return await real_getaddrinfo(host, port, **kwargs)
            if answers is None:
                raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port)) for ip in answers]

        loop.getaddrinfo = getaddrinfo  # type: ignore[assignment,method-assign]
        config = pool_config(f"dns:///{name}:{a.port}", resolve_interval_s=0.05)
        async with running_pool(config) as pool:
            await until(lambda: usable(pool) == {a.address, b.address}, "both addresses")

            gens = [pool.generate(request(r, max_tokens=150)) for r in ("l0", "l1")]
            await asyncio.gather(*(g.__anext__() for g in gens))
            [(rid_b, on_b)] = [
                (r, g) for r, g in zip(("l0", "l1"), gens, strict=True) if r in b.added
            ]
            for g in gens:
                if g is not on_b:
                    await g.aclose()

            # a failed lookup keeps the last answer
            answers = None
            await until(lambda: pool.members.last_error is not None, "the failed lookup")
            assert "cannot resolve" in str(pool.members.last_error)
            await asyncio.sleep(0.15)
            assert usable(pool) == {a.address, b.address}

            # b leaves DNS: no new requests, but its request in flight finishes
            answers = ["127.0.0.1"]
            await until(lambda: (entry(pool, b.address) or {}).get("retiring") is True, "retire")
            assert usable(pool) == {a.address}
            during = [f"d{k}" for k in range(3)]
            for rid in during:
                await complete(pool, request(rid))
            assert on(a, during) == during
            rest: list[int] = []
            last: EngineOutput | None = None
            async for out in on_b:
                rest.extend(out.new_token_ids)
                last = out
            assert last is not None and last.finish_reason is FinishReason.LENGTH
            assert len(rest) == 149
            assert rid_b not in b.aborted  # finished, not cut off
            assert entry(pool, b.address) is None  # gone once idle

            # and comes back
            answers = ["127.0.0.1", "127.0.0.2"]
            await until(lambda: usable(pool) == {a.address, b.address}, "b to rejoin")
            back = ["b0", "b1"]
            await asyncio.gather(*(complete(pool, request(r)) for r in back))
            assert len(on(a, back)) == 1 and len(on(b, back)) == 1

    engines.run(scenario())


def test_dns_name_that_never_resolves(engines: Engines) -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()

        async def getaddrinfo(host: str, port: int, **kwargs: Any) -> list[Any]:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

        loop.getaddrinfo = getaddrinfo  # type: ignore[assignment,method-assign]
        config = pool_config("dns:///nowhere.test:50051", resolve_interval_s=0.05)
        async with running_pool(config) as pool:
            assert not await pool.members.wait_serving(0.2)
            reason = pool.members.unavailable_reason()
            assert "nowhere.test" in reason and "cannot resolve" in reason
            with pytest.raises(EngineUnavailableError):
                await complete(pool, request("r"))

    engines.run(scenario())


# -- through the gateway -------------------------------------------------------------------------


def health_entry(g: GatewayServer, address: str) -> dict[str, Any]:
    r = httpx.get(f"{g.url}/health", timeout=2)
    assert r.status_code == 200, r.text
    return next(e for e in r.json()["engines"] if e["address"] == address)


def test_gateway_health_and_metrics_per_engine(engines: Engines) -> None:
    a, b = engines.start(), engines.start()
    g = GatewayServer(f"{a.address},{b.address}").start()
    try:
        g.wait_healthy()
        wait_for(
            lambda: all(health_entry(g, e.address)["connected"] for e in (a, b)), 5, "both engines"
        )
        listed = httpx.get(f"{g.url}/health").json()["engines"]
        assert sorted(e["address"] for e in listed) == sorted([a.address, b.address])

        client = openai.OpenAI(base_url=f"{g.url}/v1", api_key="x", max_retries=0, timeout=10)
        for k in range(4):
            client.completions.create(model=MODEL_NAME, prompt=f"Hello {k}", max_tokens=2)
        assert a.added and b.added
        metrics = httpx.get(f"{g.url}/metrics").text
        running = [m for m in metrics.splitlines() if m.startswith("vllm:num_requests_running{")]
        for e in (a, b):
            assert any(f'engine="{e.address}"' in line for line in running), running

        b.stop()
        wait_for(lambda: not health_entry(g, b.address)["connected"], 5, "b shown disconnected")
        assert httpx.get(f"{g.url}/health").status_code == 200
        assert health_entry(g, a.address)["connected"] is True
        before = len(a.added)
        assert client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=2).choices
        assert len(a.added) == before + 1

        a.stop()
        g.wait_healthy(expected=503, timeout=5)
    finally:
        g.stop()
        engines.stop()
