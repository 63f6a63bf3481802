"""The engines' utility calls through the gateway, against the scripted engine: /reset_prefix_cache,
/sleep?level=, /wake_up, /is_sleeping, /start_profile, /stop_profile (vLLM's dev-mode routes) on
every engine, with their answers combined; a sleeping engine out of rotation (503 naming it) and
back after /wake_up; the API key, the flag, and an engine that predates the rpcs (501)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from tokenizers import Tokenizer

from frontend_svc.config import config_from_args, config_from_json, config_to_json
from tests.frontend.conftest import make_engine
from tests.frontend.fake_engine import MODEL_NAME, FakeEngine
from tests.frontend.harness import GatewayServer, wait_for

pytestmark = pytest.mark.timeout(60)
KEY = "sekret"
AUTH = {"Authorization": f"Bearer {KEY}"}
ROUTES = [
    ("POST", "/reset_prefix_cache"),
    ("POST", "/sleep"),
    ("POST", "/wake_up"),
    ("GET", "/is_sleeping"),
    ("POST", "/start_profile"),
    ("POST", "/stop_profile"),
]


@pytest.fixture()
def engine(tokenizer_dir: Path, hf_tokenizer: Tokenizer, tmp_path: Path) -> Iterator[FakeEngine]:
    e = make_engine(tokenizer_dir, hf_tokenizer, health=True, profile_dir=str(tmp_path))
    e.start()
    yield e
    e.stop()


@pytest.fixture()
def gateway(engine: FakeEngine) -> Iterator[GatewayServer]:
    g = GatewayServer(
        engine.address,
        api_key=KEY,
        enable_utility_endpoints=True,
        enable_prompt_tokens_details=True,
    ).start()
    g.wait_healthy()
    yield g
    g.stop()


def call(
    g: GatewayServer, method: str, path: str, headers: dict[str, str] = AUTH
) -> httpx.Response:
    return httpx.request(method, f"{g.url}{path}", headers=headers, timeout=10)


def complete(g: GatewayServer, prompt: str = "Hello world", max_tokens: int = 3) -> httpx.Response:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens}
    return httpx.post(f"{g.url}/v1/completions", json=body, headers=AUTH, timeout=10)


def cached_tokens(r: httpx.Response) -> int:
    assert r.status_code == 200, r.text
    details = r.json()["usage"]["prompt_tokens_details"]  # null when none were cached (vLLM)
    return int(details["cached_tokens"]) if details is not None else 0


def health(g: GatewayServer) -> httpx.Response:
    return httpx.get(f"{g.url}/health", timeout=10)


def test_reset_prefix_cache(gateway: GatewayServer, engine: FakeEngine) -> None:
    prompt = "Hello world! The quick brown fox jumps over the lazy dog."
    cached_tokens(complete(gateway, prompt))
    assert cached_tokens(complete(gateway, prompt)) > 0  # the second time it is cached
    r = call(gateway, "POST", "/reset_prefix_cache")
    assert r.status_code == 200, r.text
    assert r.json() == {"success": True}
    assert engine.calls.count("ResetPrefixCache") == 1
    assert cached_tokens(complete(gateway, prompt)) == 0  # gone
    # with a request running, its blocks keep their entries: success is false
    streaming = threading.Thread(target=complete, args=(gateway, "Hi", 150))
    streaming.start()
    wait_for(lambda: engine.num_in_flight > 0, 5, "a running request")
    r = call(gateway, "POST", "/reset_prefix_cache")
    assert r.json() == {"success": False}
    streaming.join(10)


def test_sleep_refuses_requests_until_wake_up(gateway: GatewayServer, engine: FakeEngine) -> None:
    assert call(gateway, "GET", "/is_sleeping").json() == {"is_sleeping": False}
    r = call(gateway, "POST", "/sleep?level=2")
    assert r.status_code == 200 and r.content == b""
    assert engine.sleeping and engine.sleep_levels == [2]
    assert call(gateway, "GET", "/is_sleeping").json() == {"is_sleeping": True}
    wait_for(lambda: health(gateway).status_code == 503, 5, "/health 503")
    body = health(gateway).json()
    assert "asleep" in body["error"]["message"]
    r = complete(gateway)
    assert r.status_code == 503, r.text
    assert "asleep" in r.json()["error"]["message"]
    before = len(engine.added)

    assert call(gateway, "POST", "/sleep").status_code == 200  # again: a no-op, level 1
    assert engine.sleep_levels == [2, 1]
    r = call(gateway, "POST", "/wake_up")
    assert r.status_code == 200 and r.content == b""
    assert not engine.sleeping
    assert call(gateway, "GET", "/is_sleeping").json() == {"is_sleeping": False}
    gateway.wait_healthy(5)
    assert complete(gateway).status_code == 200
    assert len(engine.added) == before + 1


def test_sleep_waits_for_the_running_requests(gateway: GatewayServer, engine: FakeEngine) -> None:
    results: list[httpx.Response] = []
    running = threading.Thread(target=lambda: results.append(complete(gateway, "Hi", 100)))
    running.start()
    wait_for(lambda: engine.num_in_flight > 0, 5, "a running request")
    r = call(gateway, "POST", "/sleep")
    assert r.status_code == 200
    running.join(10)
    assert results[0].status_code == 200, results[0].text
    choice = results[0].json()["choices"][0]
    assert choice["finish_reason"] == "length"
    assert results[0].json()["usage"]["completion_tokens"] == 100  # not cut short
    assert call(gateway, "POST", "/wake_up").status_code == 200


@pytest.mark.parametrize(
    ("path", "param"),
    [
        ("/sleep?level=3", "level"),
        ("/sleep?level=0", "level"),
        ("/sleep?level=one", "level"),
        ("/sleep?mode=abort", "mode"),
        ("/wake_up?tags=weights", "tags"),
    ],
)
def test_bad_query_parameters_are_400(
    gateway: GatewayServer, engine: FakeEngine, path: str, param: str
) -> None:
    r = call(gateway, "POST", path)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert not {"Sleep", "WakeUp"} & set(engine.calls)


def test_profiling(gateway: GatewayServer, engine: FakeEngine, tmp_path: Path) -> None:
    r = call(gateway, "POST", "/stop_profile")
    assert r.status_code == 400 and "no profile is running" in r.json()["error"]["message"]
    assert call(gateway, "POST", "/start_profile").status_code == 200
    assert engine.profiling
    again = call(gateway, "POST", "/start_profile")
    assert again.status_code == 400
    assert again.json()["error"]["code"] == "failed_precondition"
    r = call(gateway, "POST", "/stop_profile")
    assert r.status_code == 200, r.text
    assert r.json() == {"trace_paths": [f"{tmp_path}/trace-0.json"]}
    assert not engine.profiling


def test_profiling_without_a_profile_directory_is_400(
    tokenizer_dir: Path, hf_tokenizer: Tokenizer
) -> None:
    e = make_engine(tokenizer_dir, hf_tokenizer)
    e.start()
    g = GatewayServer(e.address, enable_utility_endpoints=True).start()
    try:
        g.wait_healthy()
        r = call(g, "POST", "/start_profile", {})
        assert r.status_code == 400
        assert "--profile-dir" in r.json()["error"]["message"]
    finally:
        g.stop()
        e.stop()


def test_the_api_key_guards_every_route(gateway: GatewayServer, engine: FakeEngine) -> None:
    before = list(engine.calls)  # the gateway's own reads when it connected
    for method, path in ROUTES:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = call(gateway, method, path, headers)
            assert r.status_code == 401, (path, r.text)
    assert engine.calls == before  # none reached the engine


def test_wrong_methods_are_405(gateway: GatewayServer) -> None:
    assert call(gateway, "GET", "/sleep").status_code == 405
    assert call(gateway, "POST", "/is_sleeping").status_code == 405


def test_with_the_flag_off_the_routes_are_404(engine: FakeEngine) -> None:
    g = GatewayServer(engine.address, api_key=KEY).start()
    try:
        g.wait_healthy()
        for method, path in ROUTES:
            r = call(g, method, path)
            assert r.status_code == 404, (path, r.text)
            assert r.json()["error"]["message"] == f"Invalid URL ({method} {path})."
        assert not engine.sleeping and not engine.profiling
        doc = httpx.get(f"{g.url}/openapi.json", timeout=10).json()
        assert not {path for _, path in ROUTES} & set(doc["paths"])
    finally:
        g.stop()


def test_the_document_lists_the_routes_when_enabled(gateway: GatewayServer) -> None:
    doc = httpx.get(f"{gateway.url}/openapi.json", timeout=10).json()
    for method, path in ROUTES:
        responses = doc["paths"][path][method.lower()]["responses"]
        # an engine without the rpc (501, tested below), one that fails it (500), none (503)
        assert {"401", "500", "501", "503"} <= set(responses), (path, sorted(responses))
    (level,) = doc["paths"]["/sleep"]["post"]["parameters"]
    assert (level["name"], level["in"], level["schema"]["enum"]) == ("level", "query", ["1", "2"])


def test_an_engine_without_the_rpcs_is_501(tokenizer_dir: Path, hf_tokenizer: Tokenizer) -> None:
    old = make_engine(tokenizer_dir, hf_tokenizer, utility_rpcs=False)
    old.start()
    g = GatewayServer(old.address, api_key=KEY, enable_utility_endpoints=True).start()
    try:
        g.wait_healthy()
        for method, path in ROUTES:
            r = call(g, method, path)
            assert r.status_code == 501, (path, r.text)
            error = r.json()["error"]
            assert "does not support" in error["message"], error
            assert error["type"] == "not_implemented_error"
        assert complete(g).status_code == 200  # it serves all the same
    finally:
        g.stop()
        old.stop()


def test_no_engine_is_503() -> None:
    g = GatewayServer("127.0.0.1:1", api_key=KEY, enable_utility_endpoints=True).start()
    try:
        for method, path in ROUTES:
            r = call(g, method, path)
            assert r.status_code == 503, (path, r.text)
    finally:
        g.stop()


# -- two engines -----------------------------------------------------------------------------


@pytest.fixture()
def two(
    tokenizer_dir: Path, hf_tokenizer: Tokenizer, tmp_path: Path
) -> Iterator[tuple[FakeEngine, FakeEngine, GatewayServer]]:
    a = make_engine(tokenizer_dir, hf_tokenizer, health=True, profile_dir=str(tmp_path / "a"))
    b = make_engine(tokenizer_dir, hf_tokenizer, health=True)
    a.start()
    b.start()
    g = GatewayServer(f"{a.address},{b.address}", api_key=KEY, enable_utility_endpoints=True)
    g.start()
    try:
        g.wait_healthy()
        wait_for(
            lambda: sum(e["serving"] for e in health(g).json().get("engines", [])) == 2,
            5,
            "both engines serving",
        )
        yield a, b, g
    finally:
        g.stop()
        a.stop()
        b.stop()


def test_calls_go_to_every_engine_and_combine(
    two: tuple[FakeEngine, FakeEngine, GatewayServer],
) -> None:
    a, b, g = two
    assert call(g, "POST", "/reset_prefix_cache").json() == {"success": True}
    assert a.calls.count("ResetPrefixCache") == b.calls.count("ResetPrefixCache") == 1

    b.sleeping = True  # put to sleep by someone else: not every engine sleeps
    assert call(g, "GET", "/is_sleeping").json() == {"is_sleeping": False}
    b.sleeping = False
    assert call(g, "POST", "/sleep?level=1").status_code == 200
    assert a.sleep_levels == b.sleep_levels == [1]
    assert call(g, "GET", "/is_sleeping").json() == {"is_sleeping": True}
    wait_for(lambda: health(g).status_code == 503, 5, "/health 503")
    r = complete(g)
    assert r.status_code == 503
    assert f"{a.address}: asleep" in r.json()["error"]["message"]
    assert f"{b.address}: asleep" in r.json()["error"]["message"]

    a.sleeping = False  # woken by someone else
    assert call(g, "GET", "/is_sleeping").json() == {"is_sleeping": False}
    assert call(g, "POST", "/wake_up").status_code == 200
    assert not a.sleeping and not b.sleeping
    assert a.calls.count("WakeUp") == b.calls.count("WakeUp") == 1


def test_a_failure_on_one_engine_names_it(
    two: tuple[FakeEngine, FakeEngine, GatewayServer],
) -> None:
    a, b, g = two
    r = call(g, "POST", "/start_profile")  # only engine a has a profile directory
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert f"engine {b.address}: no profile directory" in message
    assert a.address not in message
    assert a.profiling and not b.profiling  # a started: stopping it works on a, fails on b
    r = call(g, "POST", "/stop_profile")
    assert r.status_code == 400 and f"engine {b.address}" in r.json()["error"]["message"]
    assert not a.profiling and len(a.traces) == 1


def test_the_flags_and_their_environment_variables() -> None:
    off = config_from_args([], {})
    assert (off.enable_runtime_lora_updating, off.enable_utility_endpoints) == (False, False)
    on = config_from_args(["--enable-runtime-lora-updating", "--enable-utility-endpoints"], {})
    assert (on.enable_runtime_lora_updating, on.enable_utility_endpoints) == (True, True)
    env = {"TANDEM_ENABLE_RUNTIME_LORA_UPDATING": "true", "TANDEM_ENABLE_UTILITY_ENDPOINTS": "1"}
    from_env = config_from_args([], env)
    assert (from_env.enable_runtime_lora_updating, from_env.enable_utility_endpoints) == (
        True,
        True,
    )
    assert config_from_json(config_to_json(on)) == on


def test_a_sleep_failing_on_one_engine_leaves_the_other_asleep(
    two: tuple[FakeEngine, FakeEngine, GatewayServer],
) -> None:
    a, b, g = two
    b.call_errors["Sleep"] = (grpc.StatusCode.INTERNAL, "cannot free the KV cache")
    r = call(g, "POST", "/sleep")
    assert r.status_code == 500, r.text
    assert f"engine {b.address}: cannot free the KV cache" in r.json()["error"]["message"]
    assert a.sleeping and not b.sleeping
    assert call(g, "GET", "/is_sleeping").json() == {"is_sleeping": False}

    def marked() -> dict[str, bool]:
        return {e["address"]: e.get("sleeping", False) for e in health(g).json()["engines"]}

    wait_for(lambda: marked() == {a.address: True, b.address: False}, 5, "a marked asleep")
    for _ in range(3):  # the awake engine serves everything
        assert complete(g).status_code == 200
    assert not a.add_messages
    assert call(g, "POST", "/wake_up").status_code == 200
    assert not a.sleeping
