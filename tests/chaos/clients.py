"""Load and probes for the chaos suite: many concurrent OpenAI requests, the engine's own load
figures, a process's memory."""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

import grpc
import httpx

from protos.tandem.engine.v1 import engine_pb2 as pb
from protos.tandem.engine.v1 import engine_pb2_grpc as pb_grpc
from tests.integration.harness import API_KEY, MODEL

HEADERS = {"Authorization": f"Bearer {API_KEY}"}


@dataclass
class Outcome:
    """What one client saw."""

    status: int = 0
    events: int = 0  # SSE data events with choices
    finish_reason: str | None = None
    done: bool = False  # the stream ended with [DONE]
    error: dict[str, Any] | None = None  # error body or SSE error event
    disconnected: bool = False  # the client went away on purpose
    exception: str | None = None  # transport failure (never expected)
    headers: dict[str, str] = field(default_factory=dict)
    ended_at: float = 0.0  # monotonic time the client had its answer


def body(max_tokens: int, prompt: str = "Hello", **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, **extra}


async def stream(
    http: httpx.AsyncClient,
    url: str,
    payload: dict[str, Any],
    disconnect_after: int | None = None,
    on_event: asyncio.Event | None = None,
) -> Outcome:
    """A streaming completion; with ``disconnect_after`` the client drops the connection after
    that many events."""
    out = Outcome()
    try:
        async with http.stream(
            "POST", f"{url}/v1/completions", json={**payload, "stream": True}, headers=HEADERS
        ) as r:
            out.status = r.status_code
            out.headers = dict(r.headers)
            if r.status_code != 200:
                out.error = _error_of(await r.aread())
                return out
            if disconnect_after == 0:
                out.disconnected = True
                return out
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line.removeprefix("data: ")
                if data == "[DONE]":
                    out.done = True
                    break
                try:
                    event = json.loads(data)
                except json.JSONDecodeError:
                    out.exception = f"not JSON: {data[:200]!r}"
                    break
                if "error" in event:
                    out.error = event["error"]
                    continue
                for choice in event.get("choices", []):
                    out.events += 1
                    out.finish_reason = choice.get("finish_reason") or out.finish_reason
                if on_event is not None:
                    on_event.set()
                if disconnect_after is not None and out.events >= disconnect_after:
                    out.disconnected = True
                    return out
    except httpx.HTTPError as e:
        out.exception = repr(e)
    finally:
        out.ended_at = time.monotonic()
    return out


async def complete(http: httpx.AsyncClient, url: str, payload: dict[str, Any]) -> Outcome:
    out = Outcome()
    try:
        r = await http.post(f"{url}/v1/completions", json=payload, headers=HEADERS)
        out.status, out.headers = r.status_code, dict(r.headers)
        if r.status_code != 200:
            out.error = _error_of(r.content)
            return out
        out.finish_reason = r.json()["choices"][0]["finish_reason"]
        out.done = True
    except httpx.HTTPError as e:
        out.exception = repr(e)
    finally:
        out.ended_at = time.monotonic()
    return out


def storm_plan(n: int, disconnect_share: float, seed: int) -> list[tuple[int, int | None]]:
    """(max_tokens, disconnect_after or None) per client, reproducible."""
    rng = random.Random(seed)
    return [
        (rng.randint(8, 48), rng.randint(0, 6) if rng.random() < disconnect_share else None)
        for _ in range(n)
    ]


def async_client(timeout: float = 60.0) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=0)
    return httpx.AsyncClient(timeout=timeout, limits=limits)


def engine_load(address: str) -> pb.LoadStats:
    """The engine's own figures after a 1-token probe request (which has finished by then)."""
    with grpc.insecure_channel(address) as ch:
        request = pb.AddRequest(
            prompt_token_ids=[300, 301],
            sampling_params=pb.SamplingParams(max_tokens=1, temperature=0.0),
        )
        replies = list(pb_grpc.EngineStub(ch).Generate(pb.GenerateRequest(request=request)))
    return replies[-1].load


def wait_idle(address: str, timeout: float = 10.0) -> pb.LoadStats:
    """Poll until the engine reports nothing running or waiting and no KV block in use."""
    deadline = time.monotonic() + timeout
    while True:
        load = engine_load(address)
        idle = not (load.num_running_requests or load.num_waiting_requests)
        if (idle and load.kv_cache_usage == 0.0) or time.monotonic() > deadline:
            return load
        time.sleep(0.1)


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def gateway_in_flight(url: str) -> int:
    r = httpx.get(f"{url}/health", timeout=5)
    return sum(int(e.get("in_flight", 0)) for e in r.json().get("engines", []))


def _error_of(body: bytes) -> dict[str, Any]:
    """The OpenAI error object of an error response, or what came instead."""
    try:
        error = json.loads(body).get("error")
    except (json.JSONDecodeError, AttributeError):
        return {"type": "not_json", "message": body[:300].decode("utf-8", "replace")}
    return error if isinstance(error, dict) else {"type": "no_error_object", "message": str(body)}
