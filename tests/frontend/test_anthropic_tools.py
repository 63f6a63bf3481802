"""Tool use through /v1/messages with the ``anthropic`` SDK: the scripted engine writes hermes
markup, the reply holds ``tool_use`` blocks with the parsed input (whole and streamed as
``input_json_delta``), a ``tool_result`` turn reaches the chat template, ``tool_choice``
any / tool / none and ``disable_parallel_tool_use`` act as chat's, and count_tokens counts the
tools the template writes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import orjson
import pytest
from tokenizers import Tokenizer as HFTokenizer

from tests.chat_templates import QWEN_TOOLS_TEMPLATE
from tests.frontend.fake_engine import MODEL_NAME, FakeEngine
from tests.frontend.harness import GatewayServer
from tests.frontend.helpers_chat import (
    anthropic_client,
    hf_tokenizer_of,
    prompt_text,
    qwen_tokenizer_dir,
    script,
    serve_engine,
)

pytestmark = pytest.mark.timeout(60)

WEATHER: Any = {
    "name": "get_weather",
    "description": "Current weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
TIME: Any = {"name": "get_time", "input_schema": {"type": "object", "properties": {}}}
TOOLS: Any = [WEATHER, TIME]
USER: Any = [{"role": "user", "content": "Weather in Paris?"}]
PARIS = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
NOW = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'


@pytest.fixture(scope="module")
def tool_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen's shape: <tool_call> tags as special tokens, a template that renders tools."""
    return qwen_tokenizer_dir(tmp_path_factory, "tool_tokenizer", QWEN_TOOLS_TEMPLATE)


@pytest.fixture(scope="module")
def hf_tok(tool_tokenizer_dir: Path) -> HFTokenizer:
    return hf_tokenizer_of(tool_tokenizer_dir)


@pytest.fixture(scope="module")
def engine(tool_tokenizer_dir: Path, hf_tok: HFTokenizer) -> Iterator[FakeEngine]:
    yield from serve_engine(tool_tokenizer_dir, hf_tok)


@pytest.fixture(scope="module")
def gateway(engine: FakeEngine) -> Iterator[GatewayServer]:
    g = GatewayServer(engine.address, tool_call_parser="hermes", enable_auto_tool_choice=True)
    g.start().wait_healthy()
    yield g
    g.stop()


@pytest.fixture()
def client(gateway: GatewayServer) -> anthropic.Anthropic:
    return anthropic_client(gateway)


def blocks(message: Any) -> list[tuple[str, Any]]:
    """Each block as (type, what it says): text, (name, input) of a call, thinking."""
    out: list[tuple[str, Any]] = []
    for b in message.content:
        if b.type == "tool_use":
            assert b.id.startswith("toolu_") and len(b.id) > 20
            out.append(("tool_use", (b.name, b.input)))
        else:
            out.append((b.type, b.text))
    return out


def test_a_call_is_a_tool_use_block(
    client: anthropic.Anthropic, engine: FakeEngine, hf_tok: HFTokenizer
) -> None:
    script(engine, hf_tok, f"Let me check.\n{PARIS}")
    m = client.messages.create(model=MODEL_NAME, max_tokens=100, tools=TOOLS, messages=USER)
    assert blocks(m) == [
        ("text", "Let me check."),
        ("tool_use", ("get_weather", {"city": "Paris"})),
    ]
    assert (m.stop_reason, m.stop_sequence) == ("tool_use", None)
    text = prompt_text(engine, hf_tok, m.id)
    assert '"name": "get_weather"' in text and '"description": "Current weather' in text


def test_a_call_streamed_to_a_final_message(
    client: anthropic.Anthropic, engine: FakeEngine, hf_tok: HFTokenizer
) -> None:
    script(engine, hf_tok, f"Checking.\n{PARIS}\n{NOW}")
    kinds: list[str] = []
    with client.messages.stream(
        model=MODEL_NAME, max_tokens=200, tools=TOOLS, messages=USER
    ) as stream:
        for event in stream:
            if event.type == "content_block_delta":
                kinds.append(event.delta.type)
        final = stream.get_final_message()
    assert blocks(final) == [
        ("text", "Checking."),
        ("tool_use", ("get_weather", {"city": "Paris"})),
        ("tool_use", ("get_time", {})),
    ]
    assert final.stop_reason == "tool_use"
    assert "input_json_delta" in kinds and kinds[0] == "text_delta"
    assert len({b.id for b in final.content if b.type == "tool_use"}) == 2


def test_a_tool_round_trip(
    client: anthropic.Anthropic, engine: FakeEngine, hf_tok: HFTokenizer
) -> None:
    """The reply's tool_use goes back as the assistant's call, the result as a tool message."""
    script(engine, hf_tok, PARIS)
    first = client.messages.create(model=MODEL_NAME, max_tokens=100, tools=TOOLS, messages=USER)
    call = first.content[0]
    assert call.type == "tool_use"
    script(engine, hf_tok, "It is sunny in Paris.")
    messages: Any = [
        *USER,
        {"role": "assistant", "content": first.content},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": call.id, "content": "18 C, sunny"},
                {"type": "text", "text": "And tomorrow?"},
            ],
        },
    ]
    second = client.messages.create(
        model=MODEL_NAME, max_tokens=100, tools=TOOLS, messages=messages
    )
    assert blocks(second) == [("text", "It is sunny in Paris.")]
    assert second.stop_reason == "end_turn"
    text = prompt_text(engine, hf_tok, second.id)
    expected = (
        "<|im_start|>assistant\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n18 C, sunny\n</tool_response><|im_end|>\n"
        "<|im_start|>user\nAnd tomorrow?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert text.endswith(expected), text
    # the result as text blocks, flagged as an error: the same text reaches the template
    messages[2]["content"] = [
        {
            "type": "tool_result",
            "tool_use_id": call.id,
            "content": [{"type": "text", "text": "no"}, {"type": "text", "text": "network"}],
            "is_error": True,
        }
    ]
    third = client.messages.create(model=MODEL_NAME, max_tokens=100, tools=TOOLS, messages=messages)
    assert "<tool_response>\nno\nnetwork\n</tool_response>" in prompt_text(engine, hf_tok, third.id)


def test_tool_choice_any_is_a_required_call(
    client: anthropic.Anthropic, engine: FakeEngine, hf_tok: HFTokenizer
) -> None:
    script(engine, hf_tok, '[{"name": "get_weather", "parameters": {"city": "Rome"}}]')
    m = client.messages.create(
        model=MODEL_NAME,
        max_tokens=100,
        tools=TOOLS,
        tool_choice={"type": "any"},
        messages=USER,
    )
    assert blocks(m) == [("tool_use", ("get_weather", {"city": "Rome"}))]
    assert m.stop_reason == "tool_use"
    schema = orjson.loads(
        engine.add_messages[f"{m.id}-0"].sampling_params.structured_output.json_schema
    )
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema


def test_tool_choice_tool_is_a_named_call(
    client: anthropic.Anthropic, engine: FakeEngine, hf_tok: HFTokenizer
) -> None:
    script(engine, hf_tok, '{"city": "Oslo"}')
    with client.messages.stream(
        model=MODEL_NAME,
        max_tokens=100,
        tools=TOOLS,
        tool_choice={"type": "tool", "name": "get_weather"},
        messages=USER,
    ) as stream:
        final = stream.get_final_message()
    assert blocks(final) == [("tool_use", ("get_weather", {"city": "Oslo"}))]
    assert final.stop_reason == "tool_use"
    schema = orjson.loads(
        engine.add_messages[f"{final.id}-0"].sampling_params.structured_output.json_schema
    )
    assert schema == WEATHER["input_schema"]


def test_disable_parallel_tool_use_keeps_one_call(
    client: anthropic.Anthropic, engine: FakeEngine, hf_tok: HFTokenizer
) -> None:
    script(engine, hf_tok, f"{PARIS}\n{NOW}")
    choice: Any = {"type": "auto", "disable_parallel_tool_use": True}
    m = client.messages.create(
        model=MODEL_NAME, max_tokens=200, tools=TOOLS, tool_choice=choice, messages=USER
    )
    assert blocks(m) == [("tool_use", ("get_weather", {"city": "Paris"}))]
    with client.messages.stream(
        model=MODEL_NAME, max_tokens=200, tools=TOOLS, tool_choice=choice, messages=USER
    ) as stream:
        assert blocks(stream.get_final_message()) == blocks(m)


def test_tool_choice_none_reads_no_calls(
    client: anthropic.Anthropic, engine: FakeEngine, hf_tok: HFTokenizer
) -> None:
    script(engine, hf_tok, 'I would call {"name": "get_time"}.')
    m = client.messages.create(
        model=MODEL_NAME,
        max_tokens=100,
        tools=TOOLS,
        tool_choice={"type": "none"},
        messages=USER,
    )
    assert blocks(m) == [("text", 'I would call {"name": "get_time"}.')]
    assert m.stop_reason == "end_turn"
    assert '"name": "get_weather"' in prompt_text(engine, hf_tok, m.id)  # the tools are shown


def test_a_call_cut_off_by_max_tokens_is_max_tokens(
    client: anthropic.Anthropic, engine: FakeEngine, hf_tok: HFTokenizer
) -> None:
    script(engine, hf_tok, PARIS, eos=False)
    m = client.messages.create(model=MODEL_NAME, max_tokens=12, tools=TOOLS, messages=USER)
    assert m.stop_reason == "max_tokens"
    assert all(b.type != "tool_use" for b in m.content)


def test_count_tokens_counts_the_tools(
    client: anthropic.Anthropic, engine: FakeEngine, hf_tok: HFTokenizer
) -> None:
    script(engine, hf_tok, "Fine.")
    with_tools = client.messages.count_tokens(model=MODEL_NAME, tools=TOOLS, messages=USER)
    without = client.messages.count_tokens(model=MODEL_NAME, messages=USER)
    m = client.messages.create(model=MODEL_NAME, max_tokens=10, tools=TOOLS, messages=USER)
    sent = engine.add_messages[f"{m.id}-0"].prompt_token_ids
    assert with_tools.input_tokens == len(sent) == m.usage.input_tokens
    assert without.input_tokens < with_tools.input_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_a_required_call_cut_off_is_no_text(
    client: anthropic.Anthropic, engine: FakeEngine, hf_tok: HFTokenizer, stream: bool
) -> None:
    """tool_choice any: the output is the calls' JSON; cut off, it is no call and no text."""
    script(engine, hf_tok, '[{"name": "get_weather", "parameters": {"city": "Rome"}}]', eos=False)
    fields: Any = {
        "model": MODEL_NAME,
        "max_tokens": 6,
        "tools": TOOLS,
        "tool_choice": {"type": "any"},
        "messages": USER,
    }
    if stream:
        with client.messages.stream(**fields) as s:
            m = s.get_final_message()
    else:
        m = client.messages.create(**fields)
    assert m.stop_reason == "max_tokens"
    assert m.content == []
