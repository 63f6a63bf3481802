"""/v1/messages and /v1/messages/count_tokens (Anthropic's Messages API) through the real gateway
and the scripted engine, driven by the official ``anthropic`` SDK unchanged: text replies whole
and streamed (the SDK's own accumulator), system prompts, stop sequences, max_tokens, token
counts, ``x-api-key`` auth, Anthropic's error shape for hostile input and engine trouble, and a
disconnect storm that leaves no request running on the engine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anthropic
import httpx
import orjson
import pytest
from tokenizers import Tokenizer

from tests.frontend.conftest import make_engine
from tests.frontend.fake_engine import MODEL_NAME, FakeEngine
from tests.frontend.harness import GatewayServer, wait_for
from tests.frontend.helpers_chat import anthropic_client, prompt_ids, prompt_text, script

pytestmark = pytest.mark.timeout(60)

USER: Any = [{"role": "user", "content": "Hi"}]
TEXT = "Hello world! The quick brown fox jumps over the lazy dog."


@pytest.fixture()
def client(gateway: GatewayServer) -> anthropic.Anthropic:
    return anthropic_client(gateway)


def post(gateway: GatewayServer, body: Any, path: str = "/v1/messages", **kw: Any) -> Any:
    return httpx.post(f"{gateway.url}{path}", json=body, **{"timeout": 10, **kw})


def events(response: httpx.Response) -> list[tuple[str, dict[str, Any]]]:
    """The (event, data) pairs of an SSE body; each data's type is its event's name."""
    out = []
    for block in response.text.split("\n\n"):
        if not block.strip():
            continue
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        data = orjson.loads(lines["data"])
        assert data["type"] == lines["event"], block
        out.append((lines["event"], data))
    return out


def assert_error(r: httpx.Response, status: int, kind: str, *words: str) -> str:
    """An error in Anthropic's shape, and nothing else (no traceback, no OpenAI fields)."""
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert body["type"] == "error" and set(body) == {"type", "error"}, body
    assert set(body["error"]) == {"type", "message"} and body["error"]["type"] == kind, body
    message: str = body["error"]["message"]
    assert "Traceback" not in message
    for word in words:
        assert word in message, message
    return message


# -- whole replies --------------------------------------------------------------------------


def test_text_reply_with_a_system_prompt(
    client: anthropic.Anthropic, engine: FakeEngine, hf_tokenizer: Tokenizer
) -> None:
    ids = script(engine, hf_tokenizer, TEXT)
    m = client.messages.create(model=MODEL_NAME, max_tokens=100, system="Be brief.", messages=USER)
    assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant"
    assert m.model == MODEL_NAME
    assert [(b.type, getattr(b, "text", None)) for b in m.content] == [("text", TEXT)]
    assert (m.stop_reason, m.stop_sequence) == ("end_turn", None)
    prompt, text = prompt_ids(engine, m.id), prompt_text(engine, hf_tokenizer, m.id)
    assert text.startswith("<|bos|><|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi")
    assert text.endswith("<|im_start|>assistant\n")
    assert m.usage.input_tokens == len(prompt)
    assert m.usage.output_tokens == len(ids) + 1  # and the EOS


def test_system_as_text_blocks_and_content_as_blocks(
    client: anthropic.Anthropic, engine: FakeEngine, hf_tokenizer: Tokenizer
) -> None:
    script(engine, hf_tokenizer, "Hello")
    m = client.messages.create(
        model=MODEL_NAME,
        max_tokens=10,
        system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}],
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "Hello"}]},
            {
                "role": "user",
                "content": [{"type": "text", "text": "A"}, {"type": "text", "text": "B"}],
            },
        ],
    )
    text = prompt_text(engine, hf_tokenizer, m.id)
    assert "system\nBe brief.\nBe kind.<|im_end|>" in text
    assert "user\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n" in text
    assert text.endswith("user\nA\nB<|im_end|>\n<|im_start|>assistant\n")


def test_a_last_assistant_message_is_continued(
    client: anthropic.Anthropic, engine: FakeEngine, hf_tokenizer: Tokenizer
) -> None:
    """Anthropic's prefill: the reply goes on from the last assistant message."""
    script(engine, hf_tokenizer, " world!")
    messages: Any = [*USER, {"role": "assistant", "content": "Hello"}]
    m = client.messages.create(model=MODEL_NAME, max_tokens=10, messages=messages)
    text = prompt_text(engine, hf_tokenizer, m.id)
    assert text.endswith("<|im_start|>assistant\nHello")  # no new turn, no end of the message
    assert m.content[0].type == "text" and m.content[0].text == " world!"


def test_stop_sequences_give_stop_reason_stop_sequence(
    client: anthropic.Anthropic, engine: FakeEngine, hf_tokenizer: Tokenizer
) -> None:
    script(engine, hf_tokenizer, TEXT)
    m = client.messages.create(
        model=MODEL_NAME, max_tokens=100, messages=USER, stop_sequences=["jumps", "fox"]
    )
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", "fox")
    assert m.content[0].type == "text" and m.content[0].text == "Hello world! The quick brown "


def test_max_tokens_gives_stop_reason_max_tokens(
    client: anthropic.Anthropic, engine: FakeEngine, hf_tokenizer: Tokenizer
) -> None:
    ids = script(engine, hf_tokenizer, TEXT)
    m = client.messages.create(model=MODEL_NAME, max_tokens=5, messages=USER)
    assert (m.stop_reason, m.stop_sequence) == ("max_tokens", None)
    assert m.usage.output_tokens == 5
    assert m.content[0].type == "text"
    assert m.content[0].text == hf_tokenizer.decode(ids[:5])
    assert engine.add_messages[f"{m.id}-0"].sampling_params.max_tokens == 5


def test_sampling_fields_reach_the_engine(
    client: anthropic.Anthropic, engine: FakeEngine, hf_tokenizer: Tokenizer
) -> None:
    script(engine, hf_tokenizer, "Hello")
    m = client.messages.create(
        model=MODEL_NAME,
        max_tokens=7,
        messages=USER,
        metadata={"user_id": "u-1"},
        # sent by older SDKs as parameters of their own (this one has dropped them)
        extra_body={"temperature": 0.5, "top_p": 0.75, "top_k": 3},
    )
    p = engine.add_messages[f"{m.id}-0"].sampling_params
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k) == (7, 0.5, 0.75, 3)
    assert not p.HasField("structured_output")


def test_output_config_format_is_a_json_schema_constraint(
    client: anthropic.Anthropic, engine: FakeEngine, hf_tokenizer: Tokenizer
) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    script(engine, hf_tokenizer, '{"a": 1}')
    m = client.messages.create(
        model=MODEL_NAME,
        max_tokens=20,
        messages=USER,
        output_config={"format": {"type": "json_schema", "schema": schema}},
    )
    assert m.content[0].type == "text" and m.content[0].text == '{"a": 1}'
    constraint = engine.add_messages[f"{m.id}-0"].sampling_params.structured_output
    assert orjson.loads(constraint.json_schema) == schema


# -- streaming ------------------------------------------------------------------------------


def test_stream_to_a_final_message(
    client: anthropic.Anthropic, engine: FakeEngine, hf_tokenizer: Tokenizer
) -> None:
    ids = script(engine, hf_tokenizer, TEXT)
    with client.messages.stream(model=MODEL_NAME, max_tokens=100, messages=USER) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert len(pieces) > 5 and "".join(pieces) == TEXT
    assert final.id.startswith("msg_") and final.model == MODEL_NAME
    assert [(b.type, getattr(b, "text", None)) for b in final.content] == [("text", TEXT)]
    assert (final.stop_reason, final.stop_sequence) == ("end_turn", None)
    prompt = prompt_ids(engine, final.id)
    assert final.usage.input_tokens == len(prompt)
    assert final.usage.output_tokens == len(ids) + 1


def test_stream_with_a_stop_sequence(
    client: anthropic.Anthropic, engine: FakeEngine, hf_tokenizer: Tokenizer
) -> None:
    script(engine, hf_tokenizer, TEXT)
    with client.messages.stream(
        model=MODEL_NAME, max_tokens=100, messages=USER, stop_sequences=["lazy"]
    ) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", "lazy")
    assert final.content[0].type == "text"
    assert final.content[0].text == "Hello world! The quick brown fox jumps over the "


def test_stream_events_in_anthropics_order(
    gateway: GatewayServer, engine: FakeEngine, hf_tokenizer: Tokenizer
) -> None:
    script(engine, hf_tokenizer, TEXT)
    body = {"model": MODEL_NAME, "max_tokens": 4, "messages": USER, "stream": True}
    r = post(gateway, body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    got = events(r)
    names = [name for name, _ in got]
    assert names == [
        "message_start",
        "content_block_start",
        *["content_block_delta"] * (len(names) - 5),
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    start = got[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"]["output_tokens"] == 0 and start["usage"]["input_tokens"] > 0
    assert got[1][1] == {
        "type": "content_block_start",
        "index": 0,
        "content_block": {"type": "text", "text": ""},
    }
    assert all(d["index"] == 0 and d["delta"]["type"] == "text_delta" for _, d in got[2:-3])
    assert got[-3][1] == {"type": "content_block_stop", "index": 0}
    assert got[-2][1] == {
        "type": "message_delta",
        "delta": {"stop_reason": "max_tokens", "stop_sequence": None},
        "usage": {"output_tokens": 4},
    }


# -- count_tokens ---------------------------------------------------------------------------


def test_count_tokens_is_the_prompt_the_engine_gets(
    client: anthropic.Anthropic, engine: FakeEngine, hf_tokenizer: Tokenizer
) -> None:
    script(engine, hf_tokenizer, "Hello")
    fields: Any = {
        "model": MODEL_NAME,
        "system": "Be brief.",
        "messages": [
            *USER,
            {"role": "assistant", "content": "Hi!"},
            {"role": "user", "content": "Bye"},
        ],
    }
    counted = client.messages.count_tokens(**fields).input_tokens
    m = client.messages.create(max_tokens=5, **fields)
    prompt = prompt_ids(engine, m.id)
    assert counted == len(prompt) == m.usage.input_tokens
    assert client.messages.count_tokens(model=MODEL_NAME, messages=USER).input_tokens < counted


# -- auth -----------------------------------------------------------------------------------


def test_x_api_key_and_bearer_are_accepted_a_wrong_key_is_401(engine: FakeEngine) -> None:
    g = GatewayServer(engine.address, api_key="sekret").start()
    try:
        g.wait_healthy()

        def sdk(**auth: str) -> anthropic.Anthropic:
            return anthropic.Anthropic(base_url=g.url, max_retries=0, timeout=10, **auth)

        fields: Any = {"model": MODEL_NAME, "max_tokens": 3, "messages": USER}
        assert sdk(api_key="sekret").messages.create(**fields).stop_reason  # x-api-key
        assert sdk(auth_token="sekret").messages.create(**fields).stop_reason  # Bearer
        assert sdk(api_key="sekret").messages.count_tokens(model=MODEL_NAME, messages=USER)
        with pytest.raises(anthropic.AuthenticationError) as e:
            sdk(api_key="wrong").messages.create(**fields)
        assert e.value.status_code == 401
        assert e.value.body == {
            "type": "error",
            "error": {"type": "authentication_error", "message": e.value.body["error"]["message"]},
        }
        r = post(g, fields, headers={"x-api-key": "wrong"})
        assert_error(r, 401, "authentication_error", "x-api-key")
        assert_error(post(g, fields), 401, "authentication_error")
        # x-api-key works on the OpenAI routes too; their 401 keeps the OpenAI shape
        chat = {"model": MODEL_NAME, "max_tokens": 3, "messages": USER}
        r = post(g, chat, "/v1/chat/completions", headers={"x-api-key": "sekret"})
        assert r.status_code == 200, r.text
        r = post(g, chat, "/v1/chat/completions", headers={"x-api-key": "wrong"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    finally:
        g.stop()


# -- hostile input --------------------------------------------------------------------------

OK: Any = {"model": MODEL_NAME, "max_tokens": 5, "messages": USER}


def _user(*blocks: Any) -> Any:
    return {**OK, "messages": [{"role": "user", "content": list(blocks)}]}


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"model": MODEL_NAME, "messages": USER}, ["'max_tokens' is required"]),
        ({"model": MODEL_NAME, "max_tokens": 5}, ["'messages' is required"]),
        ({"max_tokens": 5, "messages": USER}, ["'model' is required"]),
        ({**OK, "max_tokens": "5"}, ["'max_tokens' must be an integer"]),
        ({**OK, "max_tokens": 0}, ["'max_tokens' must be in [1, 4294967295], got 0"]),
        ({**OK, "messages": "Hi"}, ["'messages' must be a list"]),
        ({**OK, "messages": []}, ["'messages' must not be empty"]),
        ({**OK, "messages": [{"role": "bot", "content": "x"}]}, ["'messages[0]'", "'role'"]),
        ({**OK, "messages": [{"role": "user", "content": 5}]}, ["'messages[0].content' must"]),
        ({**OK, "temperature": "hot"}, ["'temperature' must be a number"]),
        ({**OK, "stream": "sometimes"}, ["'stream' must be a boolean"]),
        ({**OK, "stop_sequences": [1]}, ["'stop_sequences' must be"]),
        ({**OK, "system": 5}, ["'system' must be a string or a list"]),
        ({**OK, "tool_choice": {"type": "any"}}, ["'tool_choice' needs 'tools'"]),
        ({**OK, "thinking": {"type": "enabled"}}, ["'thinking.budget_tokens' is required"]),
        (_user({"type": "bogus"}), ["'messages[0].content[0]'", "'bogus'", "not supported"]),
        (_user({"text": "no type"}), ["'messages[0].content[0]' must be a block"]),
        (_user({"type": "text"}), ["'messages[0].content[0].text' is required"]),
        (
            _user({"type": "image", "source": {"type": "base64", "media_type": "image/png"}}),
            ["'messages[0].content[0]'", "'image' block: not supported"],
        ),
        (
            _user({"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image"}]}),
            ["'messages[0].content[0].content[0]'", "'image' block: not supported"],
        ),
        (
            _user({"type": "tool_use", "id": "t", "name": "f", "input": {}}),
            ["'tool_use' block", "not supported here"],
        ),
        (
            {**OK, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
            ["'tools[0].type' must be 'custom'"],
        ),
        ({**OK, "max_tokens": 100000}, ["maximum context length"]),
        ([OK], ["must be a JSON object"]),
    ],
)
def test_hostile_input_is_a_clear_400(gateway: GatewayServer, body: Any, words: list[str]) -> None:
    assert_error(post(gateway, body), 400, "invalid_request_error", *words)


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"model": MODEL_NAME}, ["'messages' is required"]),
        ({"model": MODEL_NAME, "messages": [{"role": "user"}]}, ["'messages[0].content'"]),
        (_user({"type": "image"}), ["'image' block: not supported"]),
        ({**OK, "tools": [{"name": "f"}]}, ["'tools[0].input_schema' is required"]),
    ],
)
def test_hostile_count_tokens_is_a_clear_400(
    gateway: GatewayServer, body: Any, words: list[str]
) -> None:
    r = post(gateway, body, "/v1/messages/count_tokens")
    assert_error(r, 400, "invalid_request_error", *words)


def test_other_refusals_in_anthropics_shape(gateway: GatewayServer) -> None:
    r = httpx.post(
        f"{gateway.url}/v1/messages",
        content=b"{not json",
        timeout=10,
        headers={"content-type": "application/json"},
    )
    assert_error(r, 400, "invalid_request_error", "not valid JSON")
    assert_error(post(gateway, {**OK, "model": "claude-x"}), 404, "not_found_error", "claude-x")
    r = post(gateway, {"model": "claude-x", "messages": USER}, "/v1/messages/count_tokens")
    assert_error(r, 404, "not_found_error", "claude-x")
    r = httpx.get(f"{gateway.url}/v1/messages", timeout=10)
    assert_error(r, 405, "invalid_request_error", "POST")
    r = httpx.post(
        f"{gateway.url}/v1/messages",
        content=b"x",
        timeout=10,
        headers={"content-type": "text/plain"},
    )
    assert_error(r, 415, "invalid_request_error")
    # tools with the default tool_choice (auto) need a server that reads calls
    tools = [{"name": "f", "input_schema": {"type": "object"}}]
    assert_error(post(gateway, {**OK, "tools": tools}), 400, "invalid_request_error", "auto")
    assert post(gateway, {**OK, "tools": tools, "tool_choice": {"type": "none"}}).status_code == 200


def test_engine_trouble_in_anthropics_shape(
    gateway: GatewayServer, engine: FakeEngine, hf_tokenizer: Tokenizer
) -> None:
    script(engine, hf_tokenizer, TEXT)
    engine.max_requests = 0  # every request refused: queue full
    try:
        r = post(gateway, OK)
        assert_error(r, 429, "rate_limit_error", "queue")
        assert r.headers["retry-after"] == "2"
        r = post(gateway, {**OK, "stream": True})  # before the stream began: a real status
        assert_error(r, 429, "rate_limit_error")
    finally:
        engine.max_requests = 64
    down = GatewayServer("127.0.0.1:1").start()  # no engine there
    try:
        sdk = anthropic.Anthropic(base_url=down.url, api_key="x", max_retries=0, timeout=10)
        with pytest.raises(anthropic.OverloadedError) as e:
            sdk.messages.create(model=MODEL_NAME, max_tokens=3, messages=USER)
        assert e.value.status_code == 529
        assert e.value.body["error"]["type"] == "overloaded_error"  # type: ignore[index]
        assert e.value.response.headers["retry-after"] == "2"
    finally:
        down.stop()


def test_an_engine_failure_mid_stream_is_an_error_event(
    tokenizer_dir: Path, hf_tokenizer: Tokenizer
) -> None:
    """The SDK raises on Anthropic's ``error`` event."""
    e = make_engine(tokenizer_dir, hf_tokenizer, step_s=0.02)
    e.start()
    g = GatewayServer(e.address).start()
    try:
        g.wait_healthy()
        sdk = anthropic.Anthropic(base_url=g.url, api_key="x", max_retries=0, timeout=10)
        with pytest.raises(anthropic.APIStatusError) as raised:  # noqa: PT012
            with sdk.messages.stream(model=MODEL_NAME, max_tokens=200, messages=USER) as s:
                for i, _ in enumerate(s.text_stream):
                    if i == 2:
                        e.stop()  # the engine dies mid-stream
        assert raised.value.body["type"] == "error"  # type: ignore[index]
        assert raised.value.body["error"]["type"] == "overloaded_error"  # type: ignore[index]
    finally:
        g.stop()
        e.stop()


# -- disconnects ----------------------------------------------------------------------------


def test_a_disconnect_storm_leaves_no_request_in_flight(
    gateway: GatewayServer, engine: FakeEngine, hf_tokenizer: Tokenizer
) -> None:
    """Clients that leave mid-stream (and one mid non-streamed reply) abort their engine
    requests: none is left running."""
    script(engine, hf_tokenizer, TEXT, eos=False)
    body = {"model": MODEL_NAME, "max_tokens": 200, "messages": USER, "stream": True}
    before = set(engine.added)
    engine.step_s = 0.05  # 10 s a reply: none ends by itself here
    try:
        _storm(gateway, engine, body, 24)
        with pytest.raises(httpx.ReadTimeout):  # a non-streamed reply whose client gives up
            post(gateway, {**body, "stream": False}, timeout=0.5)
        wait_for(lambda: engine.num_in_flight == 0, 10, "every request aborted")
    finally:
        engine.step_s = 0.004
    started = set(engine.added) - before
    assert len(started) == 25 and started <= set(engine.aborted)


def _storm(gateway: GatewayServer, engine: FakeEngine, body: dict[str, Any], n: int) -> None:
    """``n`` streams, each read to its first text, then all closed at once."""
    clients = [httpx.Client(timeout=10) for _ in range(n)]
    streams = [c.stream("POST", f"{gateway.url}/v1/messages", json=body) for c in clients]
    readers = []  # kept: a reader closed early closes its connection
    for s in streams:
        response = s.__enter__()
        assert response.status_code == 200
        readers.append(response.iter_lines())
        while "content_block_delta" not in next(readers[-1]):
            pass
    assert engine.num_in_flight == n
    for s, c in zip(streams, clients, strict=True):
        s.__exit__(None, None, None)
        c.close()
