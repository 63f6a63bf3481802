"""The engine dies, drains or stalls under load; the gateway never hangs a client.

- SIGKILL: every client is answered within 5 s (an SSE error event and [DONE], or a 503 with
  Retry-After); an engine restarted on the same port serves through the same gateway within 1 s
  of its readiness.
- SIGTERM: the requests in flight finish, new ones are refused at once, the engine exits 0.
- Overload: a full waiting queue answers 429 with Retry-After; nothing else fails.
- A stalled engine loop: /health turns 503 and new requests are refused with Retry-After while
  it makes no progress; the requests it held finish once it moves again.
"""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.chaos.clients import (
    HEADERS,
    Outcome,
    async_client,
    body,
    complete,
    stream,
    wait_idle,
)
from tests.integration.harness import MODEL, Engine, Gateway
from tests.integration.inprocess import start_stallable

pytestmark = pytest.mark.timeout(180)


async def _until(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


def _health(url: str) -> int:
    return httpx.get(f"{url}/health", timeout=5).status_code


def test_sigkill_under_load_then_restart(
    pair: Any, record: Any, cache_dir: Path, log_dir: Path
) -> None:
    engine, gateway = pair()

    async def scenario() -> tuple[list[Outcome], float]:
        async with async_client(timeout=30) as http:
            producing = [asyncio.Event() for _ in range(40)]
            tasks = [
                asyncio.create_task(
                    stream(http, gateway.url, body(1500, prompt=f"Kill {i}"), None, producing[i])
                )
                for i in range(40)
            ] + [
                asyncio.create_task(complete(http, gateway.url, body(1500, prompt=f"Wait {i}")))
                for i in range(10)
            ]
            # Killed once every stream produces (a fixed 2 s sleep raced the engine's speed).
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in producing)), 20)
            await asyncio.sleep(0.2)  # the non-streamed requests admitted too
            early = [t.result() for t in tasks if t.done()]
            assert not early, early[:3]
            killed = time.monotonic()
            engine.kill()  # SIGKILL
            outcomes = await asyncio.gather(*tasks)
        return list(outcomes), killed

    outcomes, killed = asyncio.run(scenario())
    answered = [o.ended_at - killed for o in outcomes]
    assert all(o.exception is None for o in outcomes), [o.exception for o in outcomes][:3]
    streams, waits = outcomes[:40], outcomes[40:]
    for o in streams:  # already streaming: an error event, then [DONE]
        assert o.status == 200 and o.done and o.events > 0
        assert o.error is not None and o.error["code"] == "engine_unavailable"
    for o in waits:
        assert o.status == 503 and o.error is not None
        assert o.headers.get("retry-after"), o.headers
    assert max(answered) < 5.0

    down = httpx.post(f"{gateway.url}/v1/completions", json=body(4), headers=HEADERS)
    assert down.status_code == 503 and down.headers.get("retry-after")
    restarted = Engine(cache_dir, log_dir, port=engine.port).wait_ready()
    try:
        ready = time.monotonic()
        while _health(gateway.url) != 200:
            assert time.monotonic() - ready < 5
            time.sleep(0.02)
        back = time.monotonic() - ready
        r = httpx.post(f"{gateway.url}/v1/completions", json=body(4), headers=HEADERS, timeout=20)
        assert r.status_code == 200, r.text
        assert back < 1.0
    finally:
        restarted.stop()
    record(
        "engine_sigkill",
        clients=len(outcomes),
        slowest_answer_after_kill_s=round(max(answered), 2),
        serving_again_after_restart_s=round(back, 2),
    )


def test_sigterm_drain_under_load(pair: Any, record: Any) -> None:
    engine, gateway = pair("--shutdown-timeout", "60")

    async def scenario() -> tuple[list[Outcome], list[Outcome], float, int]:
        async with async_client(timeout=60) as http:
            producing = [asyncio.Event() for _ in range(30)]
            tasks = [
                asyncio.create_task(
                    stream(http, gateway.url, body(1000, prompt=f"D {i}"), None, producing[i])
                )
                for i in range(30)
            ]
            # Signalled once every stream produces, with ~1000 steps left to drain (150 tokens
            # and a 0.3 s sleep could leave nothing in flight by the signal).
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in producing)), 20)
            in_flight = sum(not t.done() for t in tasks)
            signalled = time.monotonic()
            engine.signal(signal.SIGTERM)
            await _until(lambda: _health(gateway.url) == 503, 2, "/health 503")
            late = await asyncio.gather(*(complete(http, gateway.url, body(4)) for _ in range(5)))
            outcomes = await asyncio.gather(*tasks)
        return list(outcomes), list(late), time.monotonic() - signalled, in_flight

    outcomes, late, took, in_flight = asyncio.run(scenario())
    assert in_flight == 30
    assert all(o.done and o.finish_reason == "length" and o.error is None for o in outcomes)
    assert all(o.status == 503 and o.headers.get("retry-after") for o in late), late
    assert engine.wait(30) == 0
    record(
        "engine_sigterm_drain",
        in_flight=in_flight,
        finished=sum(o.finish_reason == "length" for o in outcomes),
        refused_while_draining=sum(o.status == 503 for o in late),
        drain_s=round(took, 1),
    )


def test_overload_answers_429(pair: Any, record: Any) -> None:
    engine, gateway = pair("--max-num-seqs", "2", "--max-waiting", "4")

    async def scenario() -> list[Outcome]:
        async with async_client(timeout=60) as http:
            return list(
                await asyncio.gather(
                    # 400 tokens: the 6 slots stay full while the others arrive (40-token
                    # requests end in ~50 ms, as fast as a loaded client sends the rest)
                    *(complete(http, gateway.url, body(400, prompt=f"O {i}")) for i in range(40))
                )
            )

    outcomes = asyncio.run(scenario())
    statuses = sorted({o.status for o in outcomes})
    assert set(statuses) <= {200, 429}, statuses
    refused = [o for o in outcomes if o.status == 429]
    assert refused and all(o.headers.get("retry-after") for o in refused)
    assert all(o.error and o.error["type"] == "rate_limit_error" for o in refused)
    assert all(o.finish_reason == "length" for o in outcomes if o.status == 200)
    load = wait_idle(engine.address)
    assert load.kv_cache_usage == 0.0 and load.num_running_requests == 0
    record("overload", clients=40, ok=40 - len(refused), rejected_429=len(refused))


def test_stalled_engine_under_load(cache_dir: Path, log_dir: Path, record: Any) -> None:
    from engine_svc.default_model import ensure_default_model

    engine, core = start_stallable(ensure_default_model(), MODEL, stall_timeout_s=1.0)
    gateway = Gateway(engine.address, cache_dir, log_dir)
    try:
        gateway.wait_healthy()

        async def scenario() -> tuple[list[Outcome], list[Outcome], float, float]:
            async with async_client(timeout=60) as http:
                started = asyncio.Event()
                tasks = [
                    asyncio.create_task(
                        stream(http, gateway.url, body(600, prompt=f"S {i}"), None, started)
                    )
                    for i in range(10)
                ]
                await asyncio.wait_for(started.wait(), 20)
                core.stall.set()
                # (600 tokens: the streams still run when the stall is asked for; 60 ended
                # within ~0.1 s, and an idle engine has no step to stall)
                assert await asyncio.to_thread(core.stalled.wait, 10), "the engine never stalled"
                stalled = time.monotonic()
                await _until(lambda: _health(gateway.url) == 503, 5, "/health 503")
                noticed = time.monotonic() - stalled
                refused = await asyncio.gather(
                    *(complete(http, gateway.url, body(4)) for _ in range(3))
                )
                core.stall.clear()
                core.release.set()
                released = time.monotonic()
                await _until(lambda: _health(gateway.url) == 200, 5, "/health 200")
                back = time.monotonic() - released
                outcomes = await asyncio.gather(*tasks)
            return list(outcomes), list(refused), noticed, back

        outcomes, refused, noticed, back = asyncio.run(scenario())
        assert all(o.done and o.finish_reason == "length" for o in outcomes)
        assert all(o.status == 503 and o.headers.get("retry-after") for o in refused), refused
        assert noticed < 2.5  # stall timeout 1 s plus the watchdog's period
        record(
            "engine_stalled",
            stall_timeout_s=1.0,
            not_serving_after_s=round(noticed, 2),
            serving_again_after_release_s=round(back, 2),
            held_requests_finished=len(outcomes),
        )
    finally:
        core.release.set()
        gateway.stop()
        engine.stop()
