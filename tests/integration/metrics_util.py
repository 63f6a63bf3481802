"""Reading the gateway's Prometheus gauges (the engine's load figures) in tests."""

from __future__ import annotations

import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

RUNNING = "vllm:num_requests_running"
FINISHED = "vllm:request_success_total"
KV_USAGE = "vllm:kv_cache_usage_perc"


def gauges(base_url: str) -> dict[str, float]:
    r = httpx.get(f"{base_url}/metrics", timeout=5)  # public: no API key
    assert r.status_code == 200
    values: dict[str, float] = {}
    for line in r.text.splitlines():
        if line.startswith((RUNNING + "{", KV_USAGE + "{")):
            name, value = line.split("{", 1)[0], line.rsplit(" ", 1)[1]
            values[name] = float(value)
    return values


def finished(base_url: str) -> dict[str, float]:
    """The gateway's finished-request counters by ``finished_reason`` (stop, length, abort)."""
    r = httpx.get(f"{base_url}/metrics", timeout=5)
    assert r.status_code == 200
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            if s.name == FINISHED:
                reason = s.labels["finished_reason"]
                counts[reason] = counts.get(reason, 0.0) + s.value
    return counts


def wait_for(base_url: str, running: float, timeout: float = 5.0, busy: bool = False) -> dict:
    """Poll until the running gauge equals ``running`` and the KV usage is exactly zero
    (``busy=False``) or above zero (``busy=True``); return the last reading either way."""
    deadline = time.monotonic() + timeout
    while True:
        g = gauges(base_url)
        kv_ok = g.get(KV_USAGE, -1.0) > 0.0 if busy else g.get(KV_USAGE) == 0.0
        if g.get(RUNNING) == running and kv_ok:
            return g
        if time.monotonic() > deadline:
            return g
        time.sleep(0.05)
