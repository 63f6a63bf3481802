"""LoRA adapters through the gateway, against the scripted engine: /v1/models cards, requests
that name an adapter (routed with AddRequest.lora_name, only to engines that have it),
POST /v1/load_lora_adapter and /v1/unload_lora_adapter on every engine (a load that fails on one
engine is undone on the others), their errors, the API key, the flag, and an engine that
predates the rpcs (501)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from tokenizers import Tokenizer

from frontend_svc.config import BackoffConfig
from frontend_svc.engine.client import EngineClient
from frontend_svc.engine.errors import EngineCallError
from frontend_svc.engine.router import Router
from frontend_svc.server.state import ADAPTER_REFRESH_S
from protos.tandem.engine.v1 import engine_pb2 as pb
from protos.types import EngineErrorCode, EngineRequest, EngineSamplingParams
from tests.frontend.conftest import make_engine
from tests.frontend.fake_engine import MODEL_NAME, FakeEngine
from tests.frontend.harness import GatewayServer, wait_for

pytestmark = pytest.mark.timeout(60)
KEY = "sekret"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = "Hello world"


def adapter_dir(root: Path, name: str) -> Path:
    """A directory the fake engine accepts as a PEFT adapter."""
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "adapter_config.json").write_text(json.dumps({"r": 4, "peft_type": "LORA"}))
    return d


@pytest.fixture(scope="module")
def lora_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("adapters")


@pytest.fixture(scope="module")
def engine(tokenizer_dir: Path, hf_tokenizer: Tokenizer, lora_root: Path) -> Iterator[FakeEngine]:
    e = make_engine(
        tokenizer_dir,
        hf_tokenizer,
        lora_modules={"sql": str(adapter_dir(lora_root, "sql"))},
    )
    e.start()
    yield e
    e.stop()


@pytest.fixture(scope="module")
def gateway(engine: FakeEngine) -> Iterator[GatewayServer]:
    g = GatewayServer(engine.address, api_key=KEY, enable_runtime_lora_updating=True).start()
    g.wait_healthy()
    yield g
    g.stop()


def post(
    g: GatewayServer, path: str, body: object, headers: dict[str, str] = AUTH
) -> httpx.Response:
    return httpx.post(f"{g.url}{path}", json=body, headers=headers, timeout=10)


def get(g: GatewayServer, path: str) -> httpx.Response:
    return httpx.get(f"{g.url}{path}", headers=AUTH, timeout=10)


def complete(g: GatewayServer, model: str, **extra: object) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, **extra}
    return post(g, "/v1/completions", body)


def last_lora(engine: FakeEngine) -> str:
    return engine.add_messages[engine.added[-1]].lora_name


def models(g: GatewayServer) -> dict[str, dict[str, object]]:
    r = get(g, "/v1/models")
    assert r.status_code == 200, r.text
    return {card["id"]: card for card in r.json()["data"]}


# -- the model field, /v1/models -------------------------------------------------------------


def test_models_lists_adapters_with_their_parent_and_directory(
    gateway: GatewayServer, lora_root: Path
) -> None:
    cards = models(gateway)
    assert list(cards) == [MODEL_NAME, "sql"]
    assert cards[MODEL_NAME]["parent"] is None
    assert cards["sql"]["parent"] == MODEL_NAME
    assert cards["sql"]["root"] == str(lora_root / "sql")
    assert cards["sql"]["object"] == "model"
    one = get(gateway, "/v1/models/sql")
    assert one.status_code == 200 and one.json()["parent"] == MODEL_NAME
    missing = get(gateway, "/v1/models/nope")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_a_request_naming_an_adapter_runs_with_it(
    gateway: GatewayServer, engine: FakeEngine
) -> None:
    base = complete(gateway, MODEL_NAME)
    assert base.status_code == 200 and last_lora(engine) == ""
    assert base.json()["model"] == MODEL_NAME
    tuned = complete(gateway, "sql")
    assert tuned.status_code == 200, tuned.text
    assert last_lora(engine) == "sql"
    assert tuned.json()["model"] == "sql"  # vLLM answers with the adapter's name
    # the fake engine's adapter shifts the script: another text than the base model's
    assert tuned.json()["choices"][0]["text"] != base.json()["choices"][0]["text"]

    chat = post(
        gateway,
        "/v1/chat/completions",
        {"model": "sql", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3},
    )
    assert chat.status_code == 200 and chat.json()["model"] == "sql"
    assert last_lora(engine) == "sql"

    with httpx.stream(
        "POST",
        f"{gateway.url}/v1/completions",
        json={"model": "sql", "prompt": PROMPT, "max_tokens": 3, "stream": True, "n": 2},
        headers=AUTH,
        timeout=10,
    ) as r:
        events = [line for line in r.iter_lines() if line.startswith("data: {")]
    assert events and all(json.loads(e[6:])["model"] == "sql" for e in events)
    assert [engine.add_messages[rid].lora_name for rid in engine.added[-2:]] == ["sql", "sql"]


def test_an_unknown_model_is_404_and_reaches_no_engine(
    gateway: GatewayServer, engine: FakeEngine
) -> None:
    before = len(engine.added)
    r = complete(gateway, "no-such-adapter")
    assert r.status_code == 404
    assert r.json()["error"]["param"] == "model"
    assert r.json()["error"]["code"] == "model_not_found"
    assert len(engine.added) == before


def test_an_adapter_loaded_behind_the_gateway_is_found(
    gateway: GatewayServer, engine: FakeEngine, lora_root: Path
) -> None:
    """Loaded through another gateway (or worker): a request naming it makes the gateway read
    the engines' lists again; unloaded behind its back, the engine's NOT_FOUND is a 404."""
    time.sleep(ADAPTER_REFRESH_S)  # past the last read
    path = str(adapter_dir(lora_root, "elsewhere"))
    engine.loras["elsewhere"] = pb.LoraInfo(lora_name="elsewhere", lora_path=path)
    try:
        r = complete(gateway, "elsewhere")
        assert r.status_code == 200, r.text
        assert last_lora(engine) == "elsewhere"
    finally:
        del engine.loras["elsewhere"]
    gone = complete(gateway, "elsewhere")  # the gateway still lists it: the engine refuses
    assert gone.status_code == 404, gone.text
    assert gone.json()["error"]["code"] == "model_not_found"
    assert "elsewhere" in gone.json()["error"]["message"]
    time.sleep(ADAPTER_REFRESH_S)
    assert "elsewhere" not in models(gateway)


# -- load / unload ---------------------------------------------------------------------------


def test_load_use_and_unload(gateway: GatewayServer, engine: FakeEngine, lora_root: Path) -> None:
    path = adapter_dir(lora_root, "math")
    r = post(gateway, "/v1/load_lora_adapter", {"lora_name": "math", "lora_path": str(path)})
    assert r.status_code == 200, r.text
    assert r.text == "Success: LoRA adapter 'math' added successfully."
    assert r.headers["content-type"].startswith("text/plain")
    assert engine.loras["math"].lora_path == str(path)
    assert models(gateway)["math"]["root"] == str(path)
    assert complete(gateway, "math").status_code == 200 and last_lora(engine) == "math"

    again = post(gateway, "/v1/load_lora_adapter", {"lora_name": "math", "lora_path": str(path)})
    assert again.status_code == 400
    assert again.json()["error"]["param"] == "lora_name"
    assert "already been loaded" in again.json()["error"]["message"]

    r = post(gateway, "/v1/unload_lora_adapter", {"lora_name": "math"})
    assert r.status_code == 200, r.text
    assert r.text == "Success: LoRA adapter 'math' removed successfully."
    assert "math" not in engine.loras and "math" not in models(gateway)
    assert complete(gateway, "math").status_code == 404

    r = post(gateway, "/v1/unload_lora_adapter", {"lora_name": "math"})
    assert r.status_code == 404
    assert r.json()["error"]["param"] == "lora_name"
    assert "cannot be found" in r.json()["error"]["message"]


def test_load_inplace_replaces_the_adapter(
    gateway: GatewayServer, engine: FakeEngine, lora_root: Path
) -> None:
    """vLLM's load_inplace: the same name, a new directory; without it the name is taken."""
    old, new = adapter_dir(lora_root, "v1"), adapter_dir(lora_root, "v2")
    assert (
        post(
            gateway, "/v1/load_lora_adapter", {"lora_name": "doc", "lora_path": str(old)}
        ).status_code
        == 200
    )
    try:
        body = {"lora_name": "doc", "lora_path": str(new), "load_inplace": True}
        r = post(gateway, "/v1/load_lora_adapter", body)
        assert r.status_code == 200, r.text
        assert engine.loras["doc"].lora_path == str(new)
        assert models(gateway)["doc"]["root"] == str(new)
        assert complete(gateway, "doc").status_code == 200 and last_lora(engine) == "doc"
    finally:
        post(gateway, "/v1/unload_lora_adapter", {"lora_name": "doc"})


def test_a_path_that_does_not_exist_is_404(
    gateway: GatewayServer, engine: FakeEngine, tmp_path: Path
) -> None:
    body = {"lora_name": "ghost", "lora_path": str(tmp_path / "nowhere")}
    r = post(gateway, "/v1/load_lora_adapter", body)
    assert r.status_code == 404, r.text  # as vLLM answers it
    assert "no such adapter directory" in r.json()["error"]["message"]
    assert "ghost" not in engine.loras and "ghost" not in models(gateway)


def test_load_with_pin_pins_it(gateway: GatewayServer, engine: FakeEngine, lora_root: Path) -> None:
    path = str(adapter_dir(lora_root, "pinned"))
    body = {"lora_name": "pinned", "lora_path": path, "pin": True}
    assert post(gateway, "/v1/load_lora_adapter", body).status_code == 200
    try:
        assert engine.loras["pinned"].pinned
    finally:
        post(gateway, "/v1/unload_lora_adapter", {"lora_name": "pinned"})


def test_a_bad_directory_is_400_naming_the_file_and_the_rest_still_serve(
    gateway: GatewayServer, engine: FakeEngine, tmp_path: Path
) -> None:
    r = post(gateway, "/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": str(tmp_path)})
    assert r.status_code == 400, r.text
    assert "adapter_config.json" in r.json()["error"]["message"]
    assert r.json()["error"]["code"] == "invalid_argument"
    assert "bad" not in models(gateway) and "bad" not in engine.loras
    assert complete(gateway, "sql").status_code == 200  # the others are still served
    assert complete(gateway, MODEL_NAME).status_code == 200


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"lora_path": "/x"}, "lora_name"),
        ({"lora_name": "x"}, "lora_path"),
        ({"lora_name": "", "lora_path": "/x"}, "lora_name"),
        ({"lora_name": 7, "lora_path": "/x"}, "lora_name"),
        ({"lora_name": "x" * 129, "lora_path": "/x"}, "lora_name"),
        ({"lora_name": "x", "lora_path": "/x", "pin": "yes please"}, "pin"),
        ({"lora_name": MODEL_NAME, "lora_path": "/x"}, "lora_name"),
    ],
)
def test_bad_load_bodies_are_400_naming_the_parameter(
    gateway: GatewayServer, engine: FakeEngine, body: dict[str, object], param: str
) -> None:
    calls = len(engine.calls)
    r = post(gateway, "/v1/load_lora_adapter", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert "AddLora" not in engine.calls[calls:]


def test_bad_unload_bodies_and_json(gateway: GatewayServer) -> None:
    r = post(gateway, "/v1/unload_lora_adapter", {})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name"
    r = httpx.post(
        f"{gateway.url}/v1/load_lora_adapter", content=b"{not json", headers=AUTH, timeout=10
    )
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]


def test_engine_refusals_map_to_http_statuses(gateway: GatewayServer, engine: FakeEngine) -> None:
    body = {"lora_name": "x1", "lora_path": "/nowhere"}
    for code, status in [
        (grpc.StatusCode.ALREADY_EXISTS, 400),
        (grpc.StatusCode.FAILED_PRECONDITION, 400),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, 400),
        (grpc.StatusCode.UNAVAILABLE, 503),
        (grpc.StatusCode.INTERNAL, 500),
    ]:
        engine.call_errors["AddLora"] = (code, f"refused with {code.name}")
        r = post(gateway, "/v1/load_lora_adapter", body)
        assert r.status_code == status, (code, r.text)
        assert r.json()["error"]["message"].endswith(f"refused with {code.name}")


def test_the_api_key_guards_load_and_unload(gateway: GatewayServer, lora_root: Path) -> None:
    body = {"lora_name": "k", "lora_path": str(adapter_dir(lora_root, "k"))}
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = post(gateway, path, body, headers)
            assert r.status_code == 401, (path, r.text)
            assert r.json()["error"]["code"] == "invalid_api_key"
    assert "k" not in models(gateway)


def test_the_document_lists_the_routes_when_enabled(gateway: GatewayServer) -> None:
    doc = httpx.get(f"{gateway.url}/openapi.json", timeout=10).json()
    op = doc["paths"]["/v1/load_lora_adapter"]["post"]
    ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    schema = doc["components"]["schemas"][ref.rsplit("/", 1)[1]]
    assert set(schema["required"]) == {"lora_name", "lora_path"}
    assert "401" in op["responses"]
    assert "/v1/unload_lora_adapter" in doc["paths"]


# -- the flag off, an engine without the rpcs ------------------------------------------------


def test_with_the_flag_off_the_routes_are_404(engine: FakeEngine, lora_root: Path) -> None:
    g = GatewayServer(engine.address).start()
    try:
        g.wait_healthy()
        body = {"lora_name": "off", "lora_path": str(adapter_dir(lora_root, "off"))}
        for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            r = httpx.post(f"{g.url}{path}", json=body, timeout=10)
            assert r.status_code == 404, r.text
            assert r.json()["error"]["message"] == f"Invalid URL (POST {path})."
        assert "off" not in engine.loras
        doc = httpx.get(f"{g.url}/openapi.json", timeout=10).json()
        assert "/v1/load_lora_adapter" not in doc["paths"]
        assert "/v1/unload_lora_adapter" not in doc["paths"]
        # the adapters loaded at engine start are served all the same
        r = httpx.post(
            f"{g.url}/v1/completions",
            json={"model": "sql", "prompt": PROMPT, "max_tokens": 2},
            timeout=10,
        )
        assert r.status_code == 200 and last_lora(engine) == "sql"
    finally:
        g.stop()


def test_an_engine_without_the_rpcs_is_501_and_serves_the_base_model(
    tokenizer_dir: Path, hf_tokenizer: Tokenizer, lora_root: Path
) -> None:
    old = make_engine(tokenizer_dir, hf_tokenizer, utility_rpcs=False)
    old.start()
    g = GatewayServer(old.address, api_key=KEY, enable_runtime_lora_updating=True).start()
    try:
        g.wait_healthy()
        body = {"lora_name": "new", "lora_path": str(adapter_dir(lora_root, "new"))}
        r = post(g, "/v1/load_lora_adapter", body)
        assert r.status_code == 501, r.text
        error = r.json()["error"]
        assert "does not support" in error["message"] and "AddLora" in error["message"]
        assert error["code"] == "not_implemented"
        r = post(g, "/v1/unload_lora_adapter", {"lora_name": "new"})
        assert r.status_code == 404  # it knows no adapter
        assert list(models(g)) == [MODEL_NAME]
        assert complete(g, MODEL_NAME).status_code == 200
        assert old.add_messages[old.added[-1]].lora_name == ""
    finally:
        g.stop()
        old.stop()


# -- two engines -----------------------------------------------------------------------------


@pytest.fixture()
def two_engines(
    tokenizer_dir: Path, hf_tokenizer: Tokenizer, lora_root: Path
) -> Iterator[tuple[FakeEngine, FakeEngine, GatewayServer]]:
    a = make_engine(
        tokenizer_dir, hf_tokenizer, lora_modules={"only-a": str(adapter_dir(lora_root, "a"))}
    )
    b = make_engine(tokenizer_dir, hf_tokenizer)
    a.start()
    b.start()
    g = GatewayServer(
        f"{a.address},{b.address}", api_key=KEY, enable_runtime_lora_updating=True
    ).start()
    try:
        g.wait_healthy()
        wait_for(lambda: len(httpx.get(f"{g.url}/health").json()["engines"]) == 2, 5, "2")
        wait_for(
            lambda: all(e["serving"] for e in httpx.get(f"{g.url}/health").json()["engines"]),
            5,
            "both engines serving",
        )
        yield a, b, g
    finally:
        g.stop()
        a.stop()
        b.stop()


def test_load_and_unload_go_to_every_engine(
    two_engines: tuple[FakeEngine, FakeEngine, GatewayServer], lora_root: Path
) -> None:
    a, b, g = two_engines
    path = str(adapter_dir(lora_root, "both"))
    r = post(g, "/v1/load_lora_adapter", {"lora_name": "both", "lora_path": path})
    assert r.status_code == 200, r.text
    assert "both" in a.loras and "both" in b.loras
    assert a.calls.count("AddLora") == b.calls.count("AddLora") == 1
    # requests with it spread over both engines (least loaded first)
    for _ in range(6):
        assert complete(g, "both").status_code == 200
    assert any(m.lora_name == "both" for m in a.add_messages.values())
    assert any(m.lora_name == "both" for m in b.add_messages.values())

    r = post(g, "/v1/unload_lora_adapter", {"lora_name": "both"})
    assert r.status_code == 200, r.text
    assert "both" not in a.loras and "both" not in b.loras
    assert "both" not in models(g)


def test_a_load_failing_on_one_engine_is_undone_on_the_other(
    two_engines: tuple[FakeEngine, FakeEngine, GatewayServer], lora_root: Path
) -> None:
    a, b, g = two_engines
    b.call_errors["AddLora"] = (
        grpc.StatusCode.INVALID_ARGUMENT,
        "adapter_model.safetensors: corrupt",
    )
    path = str(adapter_dir(lora_root, "half"))
    r = post(g, "/v1/load_lora_adapter", {"lora_name": "half", "lora_path": path})
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert f"engine {b.address}: adapter_model.safetensors: corrupt" in message
    assert f"unloaded again from {a.address}" in message
    assert "AddLora" in a.calls and "RemoveLora" in a.calls  # loaded, then undone
    assert "half" not in a.loras and "half" not in b.loras
    assert "half" not in models(g)
    assert complete(g, "half").status_code == 404
    # a second try, with both engines willing, works
    r = post(g, "/v1/load_lora_adapter", {"lora_name": "half", "lora_path": path})
    assert r.status_code == 200 and "half" in a.loras and "half" in b.loras


def test_an_adapter_only_one_engine_has_goes_to_that_engine(
    two_engines: tuple[FakeEngine, FakeEngine, GatewayServer],
) -> None:
    a, b, g = two_engines
    assert "only-a" in models(g)
    for _ in range(6):
        assert complete(g, "only-a").status_code == 200
    assert sum(m.lora_name == "only-a" for m in a.add_messages.values()) == 6
    assert not any(m.lora_name for m in b.add_messages.values())
    # the base model still uses both
    for _ in range(6):
        complete(g, MODEL_NAME)
    assert any(m.lora_name == "" for m in b.add_messages.values())
    # unloading it from the one engine that has it is a success
    r = post(g, "/v1/unload_lora_adapter", {"lora_name": "only-a"})
    assert r.status_code == 200, r.text
    assert "only-a" not in a.loras and "RemoveLora" in b.calls


# -- pooling routes --------------------------------------------------------------------------


def test_pooling_and_scoring_routes_run_with_the_adapter(
    tokenizer_dir: Path, hf_tokenizer: Tokenizer, lora_root: Path
) -> None:
    e = make_engine(
        tokenizer_dir,
        hf_tokenizer,
        supported_tasks=("embed",),
        embedding_size=8,
        lora_modules={"emb": str(adapter_dir(lora_root, "emb"))},
    )
    e.start()
    g = GatewayServer(e.address, api_key=KEY).start()
    try:
        g.wait_healthy()
        r = post(g, "/v1/embeddings", {"model": "emb", "input": ["a b", "c"]})
        assert r.status_code == 200, r.text
        assert r.json()["model"] == "emb"
        assert [e.add_messages[rid].lora_name for rid in e.added[-2:]] == ["emb", "emb"]
        r = post(g, "/v1/embeddings", {"model": MODEL_NAME, "input": "a b"})
        assert r.status_code == 200 and e.add_messages[e.added[-1]].lora_name == ""
        r = post(g, "/pooling", {"model": "emb", "input": "a b"})
        assert r.status_code == 200 and r.json()["model"] == "emb"
        assert e.add_messages[e.added[-1]].lora_name == "emb"
        r = post(g, "/score", {"model": "emb", "text_1": "a", "text_2": ["b", "c"]})
        assert r.status_code == 200, r.text
        assert r.json()["model"] == "emb"
        assert {e.add_messages[rid].lora_name for rid in e.added[-3:]} == {"emb"}
        r = post(g, "/rerank", {"model": "emb", "query": "a", "documents": ["b"]})
        assert r.status_code == 200 and e.add_messages[e.added[-1]].lora_name == "emb"
        assert post(g, "/v1/embeddings", {"model": "nope", "input": "a"}).status_code == 404
    finally:
        g.stop()
        e.stop()


# -- the pieces ------------------------------------------------------------------------------


def test_prefix_affinity_keys_include_the_adapter() -> None:
    router = Router(affinity_min_tokens=4, affinity_max_imbalance=8)
    router.set_block_size(4)
    assert router.affinity is not None
    prompt = list(range(16))
    keys = router.affinity.keys(prompt)
    assert router.affinity.keys(prompt, "sql") != keys
    assert router.affinity.keys(prompt, "sql") == router.affinity.keys(prompt, "sql")
    assert router.affinity.keys(prompt, "") == keys
    home = router.choose(prompt, {"a": 0, "b": 0}, "sql").address
    # the same prompt under the adapter goes home; under the base model it has no home yet
    assert router.choose(prompt, {"a": 0, "b": 0}, "sql").affinity_tokens == 16
    assert router.choose(prompt, {"a": 0, "b": 0}, "sql").address == home
    assert router.choose(prompt, {"a": 0, "b": 0}).affinity_tokens == 0


def test_engine_requests_name_the_base_model_unless_given_an_adapter() -> None:
    assert EngineRequest("r", (1,), EngineSamplingParams()).lora_name == ""
    assert EngineRequest("r", (1,), EngineSamplingParams(), lora_name="sql").lora_name == "sql"


def test_engine_client_calls_and_their_errors(engine: FakeEngine, lora_root: Path) -> None:
    async def scenario() -> None:
        client = EngineClient(engine.address, BackoffConfig(0.05, 0.2))
        client.start()
        assert await client.wait_connected(5)
        path = str(adapter_dir(lora_root, "c1"))
        added = await client.add_lora("c1", path)
        assert (added.name, added.path, added.rank, added.pinned) == ("c1", path, 4, False)
        assert "c1" in [a.name for a in await client.list_loras()]
        await client.pin_lora("c1")
        assert [a.pinned for a in await client.list_loras() if a.name == "c1"] == [True]
        with pytest.raises(EngineCallError) as info:
            await client.add_lora("c1", path)
        assert info.value.code is EngineErrorCode.ALREADY_EXISTS and info.value.rpc == "AddLora"
        await client.remove_lora("c1")
        for call in (client.remove_lora("c1"), client.pin_lora("c1")):
            with pytest.raises(EngineCallError) as info:
                await call
            assert info.value.code is EngineErrorCode.NOT_FOUND
            assert info.value.address == engine.address
        with pytest.raises(EngineCallError) as info:
            await client.add_lora("c2", str(lora_root / "missing"))
        assert info.value.code is EngineErrorCode.NOT_FOUND  # no such path
        (lora_root / "empty").mkdir(exist_ok=True)
        with pytest.raises(EngineCallError) as info:
            await client.add_lora("c2", str(lora_root / "empty"))
        assert info.value.code is EngineErrorCode.INVALID_ARGUMENT  # a path, but no adapter
        assert "adapter_config.json" in info.value.message
        await client.close()

    asyncio.run(scenario())


def test_an_engine_that_fails_to_list_its_adapters_still_serves(
    tokenizer_dir: Path, hf_tokenizer: Tokenizer, lora_root: Path
) -> None:
    """ListLoras failing while the engine connects (a stalled loop, say) does not keep the base
    model waiting; the adapters are read at the first request that names one."""
    e = make_engine(
        tokenizer_dir, hf_tokenizer, lora_modules={"late": str(adapter_dir(lora_root, "late"))}
    )
    e.call_errors["ListLoras"] = (grpc.StatusCode.DEADLINE_EXCEEDED, "the loop is stalled")
    e.start()
    g = GatewayServer(e.address, api_key=KEY).start()
    try:
        g.wait_healthy()
        assert complete(g, MODEL_NAME).status_code == 200
        assert e.calls.count("ListLoras") == 1
        r = complete(g, "late")
        assert r.status_code == 200, r.text
        assert last_lora(e) == "late" and e.calls.count("ListLoras") == 2
    finally:
        g.stop()
        e.stop()
