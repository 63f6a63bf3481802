"""The hostile-input catalogue over HTTP, against the real gateway and engine processes: each case
answered with its 4xx in the OpenAI error shape, the gateway still serving, /live answering
within 100 ms while a multi-megabyte prompt is tokenized, and its memory coming back."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from tests.chaos.clients import HEADERS, body, rss_mb, wait_idle
from tests.integration.harness import MODEL

pytestmark = pytest.mark.timeout(180)

Case = tuple[Callable[[str], httpx.Response], int, str | None]  # request, status, param or code


def _post(path: str, payload: object, **kw: Any) -> Callable[[str], httpx.Response]:
    return lambda url: httpx.post(f"{url}{path}", json=payload, headers=HEADERS, timeout=60, **kw)


def _raw(path: str, content: bytes, content_type: str | None = "application/json") -> Any:
    headers = dict(HEADERS, **({"content-type": content_type} if content_type else {}))
    return lambda url: httpx.post(f"{url}{path}", content=content, headers=headers, timeout=60)


def _chunked(size: int) -> Callable[[str], httpx.Response]:
    def chunks() -> Iterator[bytes]:
        yield b'{"model": "m", "prompt": "'
        for _ in range(size // 65536):
            yield b"a" * 65536

    def send(url: str) -> httpx.Response:
        return httpx.post(f"{url}/v1/completions", content=chunks(), headers=HEADERS, timeout=60)

    return send


def _chat(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], **extra}


CATALOGUE: dict[str, Case] = {
    "JSON nested 10,000 deep": (_raw("/v1/completions", b"[" * 10_000 + b"]" * 10_000), 400, None),
    "10 MB body with Content-Length": (_raw("/v1/completions", b" " * 10 * 2**20), 413, None),
    "10 MB chunked body": (_chunked(10 * 2**20), 413, None),
    "Content-Type text/plain": (
        _raw("/v1/completions", json.dumps(body(2)).encode(), "text/plain"),
        415,
        None,
    ),
    "Content-Type form-urlencoded": (
        _raw("/v1/completions", b"a=b", "application/x-www-form-urlencoded"),
        415,
        None,
    ),
    "body not UTF-8": (_raw("/v1/completions", b'{"model": "\xff\xfe"}'), 400, None),
    "body a JSON array": (_raw("/v1/completions", b"[1, 2]"), 400, None),
    "empty body": (_raw("/v1/completions", b""), 400, None),
    "NaN literal": (
        _raw("/v1/completions", b'{"model": "x", "prompt": "a", "temperature": NaN}'),
        400,
        None,
    ),
    "integer of 5,000 digits": (
        _raw(
            "/v1/completions", b'{"model": "x", "prompt": "a", "max_tokens": ' + b"9" * 5000 + b"}"
        ),
        400,
        None,
    ),
    "1,000 stop strings": (
        _post("/v1/completions", body(2, stop=[f"s{i}" for i in range(1000)])),
        400,
        "stop",
    ),
    "1 MB stop string": (_post("/v1/chat/completions", _chat(stop="x" * 2**20)), 400, "stop"),
    "100 KB header": (
        lambda url: httpx.post(
            f"{url}/v1/completions", json=body(2), headers={**HEADERS, "x-junk": "a" * 100_000}
        ),
        431,
        None,
    ),
    "unknown route": (lambda url: httpx.get(f"{url}/v1/nothing-here", headers=HEADERS), 404, None),
    "wrong method": (lambda url: httpx.get(f"{url}/v1/completions", headers=HEADERS), 405, None),
    "prompt over the context": (
        _post("/v1/completions", body(2, prompt="hello " * 5000)),
        400,
        "context_length_exceeded",
    ),
    "prompt + max_tokens over the context": (
        _post("/v1/completions", body(10**6)),
        400,
        "context_length_exceeded",
    ),
    "top_p 1e-46 (0 in float32)": (_post("/v1/completions", body(2, top_p=1e-46)), 400, "top_p"),
    "repetition_penalty 1e-50": (
        _post("/v1/completions", body(2, repetition_penalty=1e-50)),
        400,
        "repetition_penalty",
    ),
    "temperature 1e39 (inf in float32)": (
        _post("/v1/chat/completions", _chat(temperature=1e39)),
        400,
        "temperature",
    ),
    "n 10^9": (_post("/v1/completions", body(2, n=10**9)), 400, "n"),
    "9 prompts x n=128": (
        _post("/v1/completions", {**body(1), "prompt": ["a"] * 9, "n": 128}),
        400,
        "prompt",
    ),
    "token id outside the vocabulary": (
        _post("/v1/completions", {**body(2), "prompt": [10**9]}),
        400,
        "prompt",
    ),
    "logprobs 10^6": (_post("/v1/completions", body(2, logprobs=10**6)), 400, "logprobs"),
    "top_k 2^40": (_post("/v1/completions", body(2, top_k=2**40)), 400, "top_k"),
    "messages not a list": (
        _post("/v1/chat/completions", {"model": MODEL, "messages": "hi"}),
        400,
        "messages",
    ),
    "wrong API key": (
        lambda url: httpx.post(
            f"{url}/v1/completions", json=body(2), headers={"Authorization": "Bearer nope"}
        ),
        401,
        None,
    ),
}


def _check(name: str, r: httpx.Response, status: int, detail: str | None) -> None:
    assert r.status_code == status, f"{name}: {r.status_code} {r.text[:300]}"
    assert r.headers["content-type"].startswith("application/json"), f"{name}: {r.headers}"
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, f"{name}: {error}"
    if detail is not None:
        assert detail in (error["param"], error["code"]), f"{name}: {error}"


def _live_latency_while(url: str, work: Callable[[], Any]) -> tuple[float, Any]:
    """Worst /live latency seen (from another thread of this process) while ``work`` runs."""
    worst = 0.0
    done = threading.Event()

    def poll() -> None:
        nonlocal worst
        with httpx.Client(timeout=10) as http:
            while not done.is_set():
                t = time.perf_counter()
                assert http.get(f"{url}/live").status_code == 200
                worst = max(worst, time.perf_counter() - t)
                time.sleep(0.01)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        result = work()
    finally:
        done.set()
        poller.join()
    return worst, result


# Requests near the 4 MiB body cap that cost the gateway real work: each must leave /live
# answering within 100 ms (polled from another thread of this process) while it is served.
HEAVY: dict[str, tuple[str, dict[str, Any], int]] = {
    "3 MB text prompt (2M tokens)": (
        "/v1/completions",
        body(2, prompt="lorem ipsum dolor " * 170_000),
        400,
    ),
    "3.8 MB token-id prompt (1.9M ids)": (
        "/v1/completions",
        {**body(2), "prompt": [5] * 1_900_000},
        400,
    ),
    "chat of 100,000 empty messages": (
        "/v1/chat/completions",
        {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": ""}] * 100_000},
        400,
    ),
    "/tokenize of a 3 MB prompt": (
        "/tokenize",
        {"model": MODEL, "prompt": "lorem ipsum dolor " * 170_000},
        200,
    ),
    "/detokenize of 1M ids": ("/detokenize", {"model": MODEL, "tokens": [5] * 1_000_000}, 200),
}


# /tokenize of 2M tokens must build and send a 16 MB answer of 2M ids: pieces of that hold the
# GIL for ~15-25 ms each (the id list, its JSON, freeing it), and /live can meet several in a
# row (50-75 ms measured on the 2-core CI machine).
LIVE_BUDGET_MS = {"/tokenize of a 3 MB prompt": 200}


def test_hostile_http_catalogue(pair: Any, record: Any) -> None:
    engine, gateway = pair()
    url = gateway.url
    ok = httpx.post(f"{url}/v1/completions", json=body(4), headers=HEADERS, timeout=30)
    assert ok.status_code == 200
    baseline = rss_mb(gateway.popen.pid)
    answers: dict[str, int] = {}
    live_worst_ms: dict[str, list[float]] = {}  # per round
    after_round: list[float] = []
    heavy = {
        name: (path, json.dumps(payload, separators=(",", ":")).encode(), status)
        for name, (path, payload, status) in HEAVY.items()
    }
    for _ in range(2):  # twice: the second round must not grow the gateway any further
        for name, (send, status, detail) in CATALOGUE.items():
            r = send(url)
            _check(name, r, status, detail)
            answers[name] = r.status_code
        for name, (path, raw, status) in heavy.items():
            worst, r = _live_latency_while(url, _sender(f"{url}{path}", raw))
            assert r.status_code == status, f"{name}: {r.status_code} {r.text[:300]}"
            if status == 400:
                _check(name, r, 400, "context_length_exceeded")
            live_worst_ms.setdefault(name, []).append(round(worst * 1000, 1))
            answers[name] = r.status_code
        after_round.append(_settled_rss(gateway.popen.pid))
    # A request that stalls the event loop stalls it in both rounds; one round over budget alone
    # is the shared 2-core machine descheduling a process (190 ms once in CI, where the same
    # case measures 22-28 ms).
    slow = {k: v for k, v in live_worst_ms.items() if min(v) >= LIVE_BUDGET_MS.get(k, 100)}
    assert not slow, f"/live took too long while serving: {slow}"
    assert httpx.get(f"{url}/health").status_code == 200
    ok = httpx.post(f"{url}/v1/completions", json=body(4), headers=HEADERS, timeout=30)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
    load = wait_idle(engine.address)
    assert (load.num_running_requests, load.kv_cache_usage) == (0, 0.0)
    record(
        "hostile_http",
        cases=len(answers),
        statuses=answers,
        live_worst_ms=live_worst_ms,
        gateway_rss_mb={
            "baseline": round(baseline, 1),
            "round1": round(after_round[0], 1),
            "round2": round(after_round[1], 1),
        },
    )
    # Memory comes back: freed native memory is trimmed after big requests (one 3 MB prompt
    # left ~300 MB behind per tokenizer thread before, 57 -> 513 MB after four; a 10 MB prompt
    # once left 1.3 GB). What stays is allocator slack, 5-50 MB from run to run.
    assert max(after_round) - baseline < 100, (baseline, after_round)


def _settled_rss(pid: int) -> float:
    """The gateway trims its heap just after answering a big request: the lowest RSS over a
    second is what it holds on to."""
    readings = []
    for _ in range(10):
        readings.append(rss_mb(pid))
        time.sleep(0.1)
    return min(readings)


def _sender(url: str, raw: bytes) -> Callable[[], httpx.Response]:
    headers = {**HEADERS, "content-type": "application/json"}
    return lambda: httpx.post(url, content=raw, headers=headers, timeout=60)
