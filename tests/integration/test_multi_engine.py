"""One gateway in front of several real engine processes: spreading, prefix affinity, failover."""

from __future__ import annotations

import concurrent.futures
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.integration.harness import MODEL, Engine, Gateway

pytestmark = pytest.mark.timeout(240)

ENGINE_FLAGS = ("--max-num-seqs", "8", "--kv-cache-memory", "32MiB")
_SAMPLE = re.compile(r"^(?P<name>[\w:]+)\{(?P<labels>[^}]*)\} (?P<value>\S+)$")


def per_engine(url: str, name: str, **match: str) -> dict[str, float]:
    """``name`` from /metrics, summed per ``engine`` label, for samples whose labels match."""
    text = httpx.get(f"{url}/metrics", timeout=5).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m or m["name"] != name:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m["labels"]))
        if all(labels.get(k) == v for k, v in match.items()):
            out[labels["engine"]] = out.get(labels["engine"], 0.0) + float(m["value"])
    return out


def complete(g: Gateway, prompt: list[int], max_tokens: int = 8, **extra: object) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    return httpx.post(
        f"{g.url}/v1/completions", headers=g.headers, json={**body, **extra}, timeout=60
    )


@pytest.fixture(scope="module")
def engines(cache_dir: Path, log_dir: Path) -> Iterator[list[Engine]]:
    started = [Engine(cache_dir, log_dir, *ENGINE_FLAGS) for _ in range(2)]
    try:
        yield [e.wait_ready() for e in started]
    finally:
        for e in started:
            e.stop()


def _gateway(engines: list[Engine], cache_dir: Path, log_dir: Path, *flags: str) -> Gateway:
    g = Gateway(",".join(e.address for e in engines), cache_dir, log_dir, *flags)
    g.wait_healthy()
    deadline = time.monotonic() + 30  # healthy = one engine; wait for all of them
    while time.monotonic() < deadline:
        listed = httpx.get(f"{g.url}/health", timeout=5).json()["engines"]
        if all(e["connected"] for e in listed) and len(listed) == len(engines):
            return g
        time.sleep(0.1)
    raise AssertionError(f"not every engine connected: {listed}")


def test_load_spreads_over_engines(engines: list[Engine], cache_dir: Path, log_dir: Path) -> None:
    g = _gateway(engines, cache_dir, log_dir, "--prefix-affinity-min-tokens", "0")
    try:
        prompts = [[7 + i, 8 + i, 9 + i] for i in range(8)]
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            replies = list(pool.map(lambda p: complete(g, p, max_tokens=16), prompts))
        assert [r.status_code for r in replies] == [200] * 8
        routed = per_engine(g.url, "tandem:engine_requests_total")
        assert set(routed) == {e.address for e in engines}
        assert sorted(routed.values()) == [4.0, 4.0], routed  # equal loads, ties alternate
    finally:
        g.stop()


@pytest.mark.parametrize("affinity", [True, False])
def test_shared_prefix_goes_to_one_engine(
    affinity: bool, engines: list[Engine], cache_dir: Path, log_dir: Path
) -> None:
    """Requests sharing a 160-token prefix: with affinity all land on one engine and hit its
    prefix cache; without it they alternate and only half of them can hit."""
    min_tokens = "64" if affinity else "0"
    g = _gateway(engines, cache_dir, log_dir, "--prefix-affinity-min-tokens", min_tokens)
    try:
        for i in range(2):  # one short request each: the gateway learns both engines' totals
            assert complete(g, [5 + i, 6], max_tokens=1).status_code == 200
        before = per_engine(g.url, "vllm:prefix_cache_hits_total")
        assert len(per_engine(g.url, "vllm:prefix_cache_queries_total")) == 2
        shared = [(i * 37 + 11 * affinity) % 250 + 3 for i in range(160)]  # new to both caches
        for i in range(6):  # one after another: loads stay equal, so only affinity decides
            assert complete(g, [*shared, 300 + i]).status_code == 200
        routed = per_engine(g.url, "tandem:engine_requests_total")
        hits = per_engine(g.url, "vllm:prefix_cache_hits_total")
        gained = {a: hits.get(a, 0) - before.get(a, 0) for a in hits}
        if affinity:
            assert sorted(routed.values()) == [1.0, 7.0], routed
            affine = per_engine(g.url, "tandem:engine_requests_total", affinity="true")
            assert sorted(affine.values()) == [5.0]  # all but the first came for the prefix
            assert sum(gained.values()) >= 5 * 160, gained  # 10 blocks of 16 hit, 5 times
        else:
            assert sorted(routed.values()) == [4.0, 4.0], routed
            assert sum(gained.values()) <= 4 * 160, gained  # each engine misses once
    finally:
        g.stop()


def test_killed_engine_leaves_rotation_and_rejoins(cache_dir: Path, log_dir: Path) -> None:
    engines = [Engine(cache_dir, log_dir, *ENGINE_FLAGS) for _ in range(2)]
    for e in engines:
        e.wait_ready()
    g = _gateway(engines, cache_dir, log_dir, "--prefix-affinity-min-tokens", "0",
                 "--reconnect-max-s", "0.5")  # fmt: skip
    victim, survivor = engines
    try:
        # long streams on both engines, then SIGKILL one: every client ends promptly
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            futures = [
                pool.submit(complete, g, [20 + i, 21, 22], 400, ignore_eos=True) for i in range(6)
            ]
            # Killed while it runs requests (a fixed sleep raced the engine's speed: once the
            # engine is fast enough every request has ended before it, and nothing is tested).
            deadline = time.monotonic() + 30
            while per_engine(g.url, "vllm:num_requests_running").get(victim.address, 0.0) < 1:
                assert time.monotonic() < deadline, "the victim never ran a request"
                time.sleep(0.02)
            victim.signal(signal.SIGKILL)
            killed_at = time.monotonic()
            statuses = [f.result(timeout=120).status_code for f in futures]
        assert time.monotonic() - killed_at < 120
        assert statuses.count(200) >= 3, statuses  # the survivor's streams finished
        assert 503 in statuses, statuses  # the victim's requests got an error...
        assert set(statuses) <= {200, 503}, statuses  # ...not a hang, nor anything else

        # the gateway keeps serving on the survivor
        assert httpx.get(f"{g.url}/health", timeout=5).status_code == 200
        before = per_engine(g.url, "tandem:engine_requests_total")
        for i in range(4):
            assert complete(g, [30 + i, 31]).status_code == 200
        after = per_engine(g.url, "tandem:engine_requests_total")
        assert after[survivor.address] - before.get(survivor.address, 0) == 4

        # the engine comes back on its port and gets work again
        victim.kill()
        back = Engine(cache_dir, log_dir, *ENGINE_FLAGS, port=victim.port).wait_ready()
        engines.append(back)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            listed = httpx.get(f"{g.url}/health", timeout=5).json()["engines"]
            if all(e["connected"] for e in listed):
                break
            time.sleep(0.2)
        before = per_engine(g.url, "tandem:engine_requests_total")
        for i in range(4):
            assert complete(g, [40 + i, 41]).status_code == 200
        after = per_engine(g.url, "tandem:engine_requests_total")
        assert after[back.address] - before.get(back.address, 0) == 2, (before, after)
    finally:
        g.stop()
        for e in engines:
            e.stop()
