"""The disconnect storm on the agents' APIs: 120 concurrent streams of /v1/responses and
/v1/messages, a third of the clients walking away mid-stream. Every other stream ends with its
API's last event; afterwards the engine holds nothing (no request running or waiting, no KV
block) and the gateway nothing in flight."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.chaos.clients import HEADERS, async_client, gateway_in_flight, storm_plan, wait_idle
from tests.integration.harness import MODEL

pytestmark = pytest.mark.timeout(240)
CLIENTS = 120
DISCONNECT_SHARE = 0.33
# The event each API ends a stream with (Responses: completed, or incomplete at the token limit).
LAST_EVENTS = {"response.completed", "response.incomplete", "message_stop"}


@dataclass
class Seen:
    status: int = 0
    events: int = 0
    last: str | None = None  # the type of the last event
    disconnected: bool = False
    exception: str | None = None


def payload(i: int, max_tokens: int) -> tuple[str, dict[str, Any]]:
    """Every other client on each API."""
    if i % 2:
        return "/v1/responses", {
            "model": MODEL,
            "input": f"Storm {i}",
            "max_output_tokens": max_tokens,
            "stream": True,
        }
    return "/v1/messages", {
        "model": MODEL,
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": f"Storm {i}"}],
        "stream": True,
    }


async def watch(http: httpx.AsyncClient, url: str, i: int, n: int, cut: int | None) -> Seen:
    path, body = payload(i, n)
    seen = Seen()
    try:
        async with http.stream("POST", f"{url}{path}", json=body, headers=HEADERS) as r:
            seen.status = r.status_code
            if r.status_code != 200:
                return seen
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                seen.events += 1
                seen.last = json.loads(line.removeprefix("data: ")).get("type")
                if cut is not None and seen.events >= cut:
                    seen.disconnected = True
                    return seen
    except httpx.HTTPError as e:
        seen.exception = repr(e)
    return seen


async def storm(url: str, seed: int) -> tuple[list[Seen], list[tuple[int, int | None]]]:
    plan = storm_plan(CLIENTS, DISCONNECT_SHARE, seed)
    async with async_client(timeout=120) as http:
        seen = await asyncio.gather(
            *(watch(http, url, i, n, cut) for i, (n, cut) in enumerate(plan))
        )
    return list(seen), plan


def test_disconnect_storm_on_responses_and_messages(pair: Any, record: Any) -> None:
    engine, gateway = pair("--max-num-seqs", "64")
    seen, plan = asyncio.run(storm(gateway.url, 3))
    assert all(s.exception is None for s in seen), [s.exception for s in seen][:5]
    assert all(s.status == 200 for s in seen), {s.status for s in seen}
    stayed = [s for s, (_, cut) in zip(seen, plan, strict=True) if cut is None]
    assert all(s.last in LAST_EVENTS for s in stayed), [s.last for s in stayed][:5]
    load = wait_idle(engine.address, timeout=15)
    assert (load.num_running_requests, load.num_waiting_requests) == (0, 0), load
    assert load.kv_cache_usage == 0.0, load
    assert gateway_in_flight(gateway.url) == 0
    gone = sum(s.disconnected for s, (_, cut) in zip(seen, plan, strict=True) if cut is not None)
    left = sum(cut is not None for _, cut in plan)
    assert gone >= left // 2, (gone, left)
    record(
        "disconnect_storm_agents",
        clients=CLIENTS,
        finished=len(stayed),
        disconnected=gone,
        engine_after={"running": 0, "waiting": 0, "kv_cache_usage": 0.0},
    )
