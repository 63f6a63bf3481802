"""POST /v1/responses refusing what it cannot do, in OpenAI's error shape with the right status
(400 naming the field, 404 for an unknown response), never a traceback; the store's bounds
(entries and bytes, the oldest evicted first), exactly on the store and through the gateway;
input items as chat messages; the output items the same however the text is split; the route
in /openapi.json; the store's flags."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from tokenizers import Tokenizer

from frontend_svc.config import config_from_args
from frontend_svc.errors import ApiError
from frontend_svc.protocol.responses import parse_responses
from frontend_svc.protocol.responses_items import chat_messages
from frontend_svc.reasoning import RequestReasoning, get_reasoning_parser
from frontend_svc.responses_store import ResponseStore, StoredResponse
from frontend_svc.routes.responses_output import OutputItems
from frontend_svc.tool_parsers import get_tool_parser
from tests.frontend.conftest import make_engine
from tests.frontend.fake_engine import MODEL_NAME, FakeEngine
from tests.frontend.harness import GatewayServer

pytestmark = pytest.mark.timeout(60)

BASE: dict[str, Any] = {"model": MODEL_NAME, "input": "Hi", "max_output_tokens": 2}
WEATHER: Any = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}


def post(gateway: GatewayServer, body: Any, path: str = "/v1/responses") -> httpx.Response:
    return httpx.post(f"{gateway.url}{path}", json=body, timeout=10)


def error_of(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    assert "Traceback" not in r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    error: dict[str, Any] = body["error"]
    return error


# -- hostile input -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        ({"input": None}, "input", "'input' is required"),
        ({"input": 42}, "input", "'input' must be a string or a list"),
        ({"input": []}, "input", "non-empty list"),
        ({"input": [{"type": "input_image", "image_url": "x"}]}, "input", "got 'input_image'"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input", "'input[0]'"),
        ({"input": ["Hi"]}, "input", "'input[0]' must be an input item"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input", "'input[0].role'"),
        ({"input": [{"role": "user"}]}, "input", "'input[0].content' is required"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
            "input",
            "no input but text",
        ),
        (
            {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]},
            "input",
            "'input[0].arguments' is not valid JSON",
        ),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input", "call_id"),
        ({"model": None}, "model", "'model' is required"),
        ({"instructions": ["a"]}, "instructions", "must be a string"),
        ({"max_output_tokens": 0}, "max_output_tokens", "must be in [1, inf)"),
        ({"max_output_tokens": "9"}, "max_output_tokens", "must be an integer"),
        ({"temperature": -1}, "temperature", "must be in"),
        ({"top_p": 0}, "top_p", "must be in"),
        ({"store": "always"}, "store", "must be a boolean"),
        ({"stream": 2}, "stream", "must be a boolean"),
        ({"background": True}, "background", "not run responses in the background"),
        ({"background": "yes"}, "background", "not run responses in the background"),
        ({"background": "later"}, "background", "must be a boolean"),
        ({"conversation": "conv_1"}, "conversation", "use previous_response_id"),
        ({"metadata": {"k": "v" * 513}}, "metadata", "at most 512 characters"),
        ({"metadata": {str(i): "v" for i in range(17)}}, "metadata", "at most 16"),
        ({"tools": [{"type": "web_search"}]}, "tools", "this server runs no built-in tools"),
        ({"tools": [{"type": "function"}]}, "tools", "'tools[0].name' is required"),
        ({"tools": [WEATHER, WEATHER], "tool_choice": "none"}, "tools", "two functions named"),
        ({"tool_choice": "required"}, "tool_choice", "'tool_choice' needs 'tools'"),
        (
            {"tool_choice": {"type": "file_search"}},
            "tool_choice",
            "'tool_choice.type' must be 'function': this server runs no built-in tools",
        ),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}},
            "tool_choice",
            "which is not in 'tools'",
        ),
        ({"tools": [WEATHER]}, "tool_choice", "--enable-auto-tool-choice"),  # auto: no parser
        ({"text": {"format": {"type": "xml"}}}, "text", "'text.format.type'"),
        ({"text": {"format": {"type": "json_schema"}}}, "text", "'text.format.schema'"),
        ({"text": {"format": {"type": "json_schema", "schema": 5}}}, "text", "JSON Schema"),
        (
            {
                "tools": [WEATHER],
                "tool_choice": "required",
                "text": {"format": {"type": "json_object"}},
            },
            "text",
            "not both",
        ),
        ({"reasoning": {"effort": "extreme"}}, "reasoning", "'reasoning.effort'"),
        ({"parallel_tool_calls": "never"}, "parallel_tool_calls", "must be a boolean"),
    ],
)
def test_bad_fields_are_400s_naming_them(
    gateway: GatewayServer, fields: dict[str, Any], param: str, says: str
) -> None:
    body = {k: v for k, v in {**BASE, **fields}.items() if v is not None}
    error = error_of(post(gateway, body), 400)
    assert (error["param"], error["type"]) == (param, "invalid_request_error")
    assert says in error["message"]


def test_bodies_that_are_not_requests(gateway: GatewayServer) -> None:
    url = f"{gateway.url}/v1/responses"
    error = error_of(httpx.post(url, content=b"{not json", timeout=10), 400)
    assert "not valid JSON" in error["message"]
    error = error_of(post(gateway, ["Hi"]), 400)
    assert error["message"] == "The request body must be a JSON object."
    r = httpx.post(url, content=b"x", headers={"content-type": "text/plain"}, timeout=10)
    error_of(r, 415)
    error_of(httpx.get(url, timeout=10), 405)


def test_the_sdk_sees_the_same_errors(gateway: GatewayServer) -> None:
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0, timeout=10)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL_NAME, input="Hi", background=True)
    assert e.value.body["param"] == "background"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError) as nf:
        client.responses.create(model=MODEL_NAME, input="Hi", previous_response_id="resp_nope")
    body: Any = nf.value.body
    assert (body["param"], body["code"]) == ("previous_response_id", "previous_response_not_found")
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="other-model", input="Hi")


def test_unknown_ids_are_404s(gateway: GatewayServer) -> None:
    for method, path in (
        ("GET", "/v1/responses/resp_nope"),
        ("DELETE", "/v1/responses/resp_nope"),
        ("GET", "/v1/responses/resp_nope/input_items"),
    ):
        r = httpx.request(method, f"{gateway.url}{path}", timeout=10)
        error = error_of(r, 404)
        assert (error["param"], error["code"]) == ("response_id", "not_found")
        assert "resp_nope" in error["message"]
    error = error_of(post(gateway, {**BASE, "previous_response_id": "resp_nope"}), 404)
    assert error["param"] == "previous_response_id"


def test_a_conversation_the_template_refuses_names_the_input(gateway: GatewayServer) -> None:
    """The tiny template refuses a conversation that opens with a tool result."""
    result = {"type": "function_call_output", "call_id": "c1", "output": "22 C"}
    error = error_of(post(gateway, {**BASE, "input": [result]}), 400)
    assert error["param"] == "input" and "cannot start with a tool message" in error["message"]


def test_an_engine_refusal_before_the_stream_keeps_its_status(gateway: GatewayServer) -> None:
    body = {**BASE, "max_output_tokens": 10_000, "stream": True}
    error = error_of(post(gateway, body), 400)
    assert error["code"] == "context_length_exceeded" and error["param"] == "max_output_tokens"


def test_bad_input_items_queries(gateway: GatewayServer) -> None:
    r = post(gateway, BASE)
    assert r.status_code == 200, r.text
    path = f"{gateway.url}/v1/responses/{r.json()['id']}"
    for query, param in (
        ("limit=0", "limit"),
        ("limit=101", "limit"),
        ("limit=ten", "limit"),
        ("order=up", "order"),
        ("after=msg_nope", "after"),
    ):
        error = error_of(httpx.get(f"{path}/input_items?{query}", timeout=10), 400)
        assert error["param"] == param
    error = error_of(httpx.get(f"{path}?stream=true", timeout=10), 400)
    assert error["param"] == "stream"
    assert httpx.get(f"{path}?stream=false", timeout=10).status_code == 200


def test_an_engine_dying_mid_stream_fails_the_response(
    tokenizer_dir: Path, hf_tokenizer: Tokenizer
) -> None:
    engine = make_engine(tokenizer_dir, hf_tokenizer)
    engine.start()
    g = GatewayServer(engine.address).start()
    try:
        g.wait_healthy()
        body = {"model": MODEL_NAME, "input": "Hi", "stream": True, "max_output_tokens": 200}
        with httpx.stream("POST", f"{g.url}/v1/responses", json=body, timeout=10) as r:
            lines = (line for line in r.iter_lines() if line.startswith("data: "))
            kinds = [json.loads(next(lines)[6:])["type"] for _ in range(5)]
            engine.stop()
            rest = [json.loads(line[6:]) for line in lines]
        assert kinds[-1] == "response.output_text.delta"
        last = rest[-1]
        assert last["type"] == "response.failed" and last["response"]["status"] == "failed"
        error = last["response"]["error"]
        assert error["code"] == "server_error" and "engine is unavailable" in error["message"]
        stored = httpx.get(f"{g.url}/v1/responses/{last['response']['id']}", timeout=10).json()
        assert stored["status"] == "failed"
    finally:
        g.stop()
        engine.stop()


# -- the store -----------------------------------------------------------------------------------


def entry(size: int) -> StoredResponse:
    """An entry of exactly ``size`` bytes."""
    return StoredResponse(b"r" * (size - 4), b"[]", b"[]")


def test_store_evicts_the_oldest_past_its_entries() -> None:
    store = ResponseStore(max_entries=2, max_bytes=10_000)
    for name in "abc":
        assert store.put(name, entry(100))
    assert [store.get(n) is not None for n in "abc"] == [False, True, True]
    assert (len(store), store.num_bytes) == (2, 200)
    assert store.put("b", entry(50))  # put again: now the newest
    assert store.put("d", entry(50))
    assert [store.get(n) is not None for n in "bcd"] == [True, False, True]
    assert store.delete("b") and not store.delete("b")
    assert (len(store), store.num_bytes) == (1, 50)


def test_store_evicts_the_oldest_past_its_bytes() -> None:
    store = ResponseStore(max_entries=100, max_bytes=1000)
    for name, size in (("a", 400), ("b", 400), ("c", 150)):
        assert store.put(name, entry(size))
    assert store.num_bytes == 950
    assert store.put("d", entry(460))  # a and b must go: b + c + d is 1010
    assert [store.get(n) is not None for n in "abcd"] == [False, False, True, True]
    assert store.num_bytes == 610
    assert not store.put("huge", entry(1001))  # alone past the budget: not kept, nothing evicted
    assert store.get("huge") is None and store.num_bytes == 610
    assert not ResponseStore(0, 1000).put("a", entry(10))  # 0 entries: the store is off


def test_a_stored_conversation_continues_from_context_input_and_output() -> None:
    context = [{"type": "message", "id": "m0", "role": "user", "content": []}]
    items = [{"type": "message", "id": "m1", "role": "user", "content": []}]
    output = [{"type": "message", "id": "m2", "role": "assistant", "content": []}]
    stored = StoredResponse.of({"output": output}, items, context)
    assert [i["id"] for i in stored.conversation()] == ["m0", "m1", "m2"]


@pytest.fixture()
def small_store(engine: FakeEngine) -> Iterator[GatewayServer]:
    g = GatewayServer(
        engine.address, responses_store_max_entries=3, responses_store_max_bytes=12_000
    ).start()
    g.wait_healthy()
    yield g
    g.stop()


def test_the_gateway_store_is_bounded(small_store: GatewayServer) -> None:
    """3 entries, 12 kB: the fourth small response evicts the first; responses of ~5 kB (the
    metadata they echo) evict by bytes with only two kept; one past 12 kB is not kept."""

    def create(**fields: Any) -> str:
        r = post(small_store, {**BASE, **fields})
        assert r.status_code == 200, r.text
        return str(r.json()["id"])

    def kept(response_id: str) -> bool:
        return httpx.get(f"{small_store.url}/v1/responses/{response_id}").status_code == 200

    small = [create() for _ in range(4)]
    assert [kept(i) for i in small] == [False, True, True, True]
    metadata = {str(i): "v" * 500 for i in range(9)}
    big = [create(metadata=metadata) for _ in range(3)]
    assert [kept(i) for i in big] == [False, True, True]
    assert not any(kept(i) for i in small)
    huge_tool = {"type": "function", "name": "f", "description": "d" * 13_000}
    too_big = create(tools=[huge_tool], tool_choice="none")  # the tools are echoed
    assert not kept(too_big)  # answered, but past the whole budget: not kept
    assert [kept(i) for i in big] == [False, True, True]


# -- input items as chat messages ----------------------------------------------------------------


def test_items_become_chat_messages() -> None:
    body: Any = {
        "model": "m",
        "input": [
            {"role": "developer", "content": "Rules."},
            {"role": "user", "content": "Weather?"},
            {
                "type": "reasoning",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": "T"}],
            },
            {"role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
            {
                "type": "function_call",
                "call_id": "c1",
                "name": "get_weather",
                "arguments": '{"a": 1}',
            },
            {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": ""},
            {"type": "function_call_output", "call_id": "c1", "output": "22 C"},
            {
                "type": "function_call_output",
                "call_id": "c2",
                "output": [{"type": "input_text", "text": "noon"}],
            },
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "S"}]},
            {"type": "function_call", "call_id": "c3", "name": "get_time", "arguments": "{}"},
        ],
        "instructions": "Be brief.",
    }
    req = parse_responses(body)
    messages = list(req.chat_request([]).messages)
    assert messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "system", "content": "Rules."},
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "reasoning_content": "T",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"a": 1}},
                },
                {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": {}}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "22 C", "name": "get_weather"},
        {"role": "tool", "tool_call_id": "c2", "content": "noon", "name": "get_time"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c3", "type": "function", "function": {"name": "get_time", "arguments": {}}}
            ],
            "reasoning_content": "S",
        },
    ]
    items = list(req.input_items)
    assert [i["type"] for i in items] == [
        "message",
        "message",
        "reasoning",
        "message",
        "function_call",
        "function_call",
        "function_call_output",
        "function_call_output",
        "reasoning",
        "function_call",
    ]
    assert items[3]["content"] == [{"type": "output_text", "text": "Checking.", "annotations": []}]
    assert items[7]["output"] == "noon" and items[5]["arguments"] == ""
    assert len({i["id"] for i in items}) == len(items)


def test_reasoning_before_a_user_message_is_dropped() -> None:
    body = {
        "model": "m",
        "input": [
            {"type": "reasoning", "id": "rs_1", "summary": [{"text": "old"}]},
            {"role": "user", "content": "Hi", "id": "msg_1"},
        ],
    }
    items = list(parse_responses(body).input_items)
    assert [i["id"] for i in items] == ["rs_1", "msg_1"]  # the client's ids are kept
    assert chat_messages(items) == [{"role": "user", "content": "Hi"}]


# -- output items, however the text comes ---------------------------------------------------------


TEXT = (
    '<think>I need the weather.</think>Let me check.\n<tool_call>\n{"name": "get_weather", '
    '"arguments": {"city": "Paris"}}\n</tool_call>'
)


def built(pieces: list[str], strict: bool) -> tuple[list[Any], list[dict[str, Any]]]:
    """The items (ids left out) and events of ``pieces`` fed one after another."""
    parser = get_tool_parser("hermes")
    request = RequestReasoning(get_reasoning_parser("qwen3"), True, (), ())
    out = OutputItems(parser, request, strict=strict)
    events: list[dict[str, Any]] = []
    for i, piece in enumerate(pieces):
        events += out.feed(piece, final=i == len(pieces) - 1)
    events += out.close()
    items = [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in out.items]
    return items, events


def test_output_items_do_not_depend_on_the_split() -> None:
    whole, _ = built([TEXT], strict=True)
    assert whole == [
        {
            "type": "reasoning",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": "I need the weather."}],
            "status": "completed",
        },
        {
            "type": "message",
            "role": "assistant",
            "status": "completed",
            "content": [
                {"type": "output_text", "text": "Let me check.", "annotations": [], "logprobs": []}
            ],
        },
        {
            "type": "function_call",
            "name": "get_weather",
            "arguments": '{"city": "Paris"}',
            "status": "completed",
        },
    ]
    for at in range(1, len(TEXT)):
        for strict in (True, False):
            items, events = built([TEXT[:at], TEXT[at:]], strict)
            assert items == whole, (at, strict)
            # every item is added, then done, in order; its deltas add up to its text
            added = [e["output_index"] for e in events if e["type"].endswith("item.added")]
            done = [e["output_index"] for e in events if e["type"].endswith("item.done")]
            assert added == done == [0, 1, 2]
    items, events = built(list(TEXT), strict=False)  # one character at a time
    assert items == whole
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert deltas == "Let me check."


def test_an_empty_output_is_one_empty_message() -> None:
    out = OutputItems(None, None)
    events = out.feed("  ", final=True) + out.close()
    assert [e["type"] for e in events] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert out.items[0]["content"][0]["text"] == "  "


# -- documented, configured ----------------------------------------------------------------------


def test_the_routes_are_in_openapi(gateway: GatewayServer) -> None:
    doc = httpx.get(f"{gateway.url}/openapi.json", timeout=10).json()
    create = doc["paths"]["/v1/responses"]["post"]
    ref = create["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    body = doc["components"]["schemas"][ref.rsplit("/", 1)[1]]
    assert body["required"] == ["model", "input"]
    assert {"tools", "tool_choice", "text", "reasoning", "previous_response_id"} <= set(
        body["properties"]
    )
    assert "text/event-stream" in create["responses"]["200"]["content"]
    stored = doc["paths"]["/v1/responses/{response_id}"]
    assert set(stored) == {"get", "delete"} and "404" in stored["get"]["responses"]
    items = doc["paths"]["/v1/responses/{response_id}/input_items"]["get"]
    assert {p["name"] for p in items["parameters"]} == {"response_id", "limit", "order", "after"}


def test_store_flags() -> None:
    config = config_from_args(
        ["--responses-store-max-entries", "5", "--responses-store-max-bytes", "1000"], {}
    )
    assert (config.responses_store_max_entries, config.responses_store_max_bytes) == (5, 1000)
    env = {"TANDEM_RESPONSES_STORE_MAX_ENTRIES": "7"}
    assert config_from_args([], env).responses_store_max_entries == 7
    with pytest.raises(SystemExit):
        config_from_args(["--responses-store-max-bytes", "-1"], {})


def test_parse_errors_are_api_errors() -> None:
    with pytest.raises(ApiError) as e:
        parse_responses({"model": "m", "input": "x", "tools": [WEATHER]}, auto_tools=False)
    assert e.value.param == "tool_choice"
    req = parse_responses({"model": "m", "input": "x", "tools": [WEATHER]}, auto_tools=True)
    assert req.tools.choice == "auto" and json.loads(json.dumps(req.echo))["tool_choice"] == "auto"
