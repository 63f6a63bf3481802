"""Thinking through /v1/messages with the ``anthropic`` SDK: with ``--reasoning-parser qwen3`` the
engine's ``<think>``…``</think>`` output is a ``thinking`` block before the text (whole and
streamed as ``thinking_delta``), before a tool call too; ``thinking`` disabled reaches the chat
template as ``enable_thinking`` false; a thinking block sent back reaches the template; without
a reasoning parser the tags stay text."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import pytest
from tokenizers import Tokenizer as HFTokenizer

from tests.chat_templates import QWEN3_THINKING_TEMPLATE
from tests.frontend.fake_engine import MODEL_NAME, FakeEngine
from tests.frontend.harness import GatewayServer
from tests.frontend.helpers_chat import (
    anthropic_client,
    hf_tokenizer_of,
    lazy_gateways,
    prompt_text,
    qwen_tokenizer_dir,
    script,
    serve_engine,
)

pytestmark = pytest.mark.timeout(60)

THOUGHT = "\nThe user greets me. I say hello.\n"
ANSWER = "\n\nHello world!"
OUTPUT = f"<think>{THOUGHT}</think>{ANSWER}"  # Qwen3 writes the start tag itself
USER: Any = [{"role": "user", "content": "Hi"}]
WEATHER: Any = {
    "name": "get_weather",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}
PARIS = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CLOSED = "<|im_start|>assistant\n<think>\n\n</think>\n\n"  # the prompt of enable_thinking false


@pytest.fixture(scope="module")
def think_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3's vocabulary shape: think tags plain added tokens, tool-call tags special ones."""
    return qwen_tokenizer_dir(
        tmp_path_factory, "think_tokenizer", QWEN3_THINKING_TEMPLATE, think=True
    )


@pytest.fixture(scope="module")
def hf_tok(think_tokenizer_dir: Path) -> HFTokenizer:
    return hf_tokenizer_of(think_tokenizer_dir)


@pytest.fixture(scope="module")
def engine(think_tokenizer_dir: Path, hf_tok: HFTokenizer) -> Iterator[FakeEngine]:
    yield from serve_engine(think_tokenizer_dir, hf_tok)


@pytest.fixture(scope="module")
def gateways(engine: FakeEngine) -> Iterator[dict[bool, GatewayServer]]:
    """With (True) and without (False) ``--reasoning-parser qwen3``; hermes tool calls both."""
    yield from lazy_gateways(
        engine,
        lambda parsing: {
            "reasoning_parser": "qwen3" if parsing else None,
            "tool_call_parser": "hermes",
            "enable_auto_tool_choice": True,
        },
    )


def client_of(gateways: dict[bool, GatewayServer], parsing: bool = True) -> anthropic.Anthropic:
    return anthropic_client(gateways[parsing])


def blocks(message: Any) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for b in message.content:
        if b.type == "thinking":
            assert b.signature == ""
            out.append(("thinking", b.thinking))
        elif b.type == "tool_use":
            out.append(("tool_use", (b.name, b.input)))
        else:
            out.append((b.type, b.text))
    return out


@pytest.mark.parametrize("thinking", [None, {"type": "enabled", "budget_tokens": 2048}])
def test_reasoning_is_a_thinking_block(
    gateways: dict[bool, GatewayServer],
    engine: FakeEngine,
    hf_tok: HFTokenizer,
    thinking: Any,
) -> None:
    script(engine, hf_tok, OUTPUT)
    extra: Any = {} if thinking is None else {"thinking": thinking}
    m = client_of(gateways).messages.create(
        model=MODEL_NAME, max_tokens=200, messages=USER, **extra
    )
    assert blocks(m) == [("thinking", THOUGHT), ("text", ANSWER)]
    assert m.stop_reason == "end_turn"
    assert CLOSED not in prompt_text(engine, hf_tok, m.id)  # thinking stays on


def test_reasoning_streamed_as_thinking_deltas(
    gateways: dict[bool, GatewayServer], engine: FakeEngine, hf_tok: HFTokenizer
) -> None:
    script(engine, hf_tok, OUTPUT)
    seen: list[tuple[str, int, str]] = []
    with client_of(gateways).messages.stream(
        model=MODEL_NAME, max_tokens=200, messages=USER
    ) as stream:
        for event in stream:
            if event.type == "content_block_start":
                seen.append(("start", event.index, event.content_block.type))
            elif event.type == "content_block_delta":
                seen.append(("delta", event.index, event.delta.type))
        final = stream.get_final_message()
    assert blocks(final) == [("thinking", THOUGHT), ("text", ANSWER)]
    assert seen[0] == ("start", 0, "thinking") and ("start", 1, "text") in seen
    assert {s for s in seen if s[0] == "delta"} == {
        ("delta", 0, "thinking_delta"),
        ("delta", 1, "text_delta"),
    }


def test_thinking_then_a_tool_call(
    gateways: dict[bool, GatewayServer], engine: FakeEngine, hf_tok: HFTokenizer
) -> None:
    script(engine, hf_tok, f"<think>{THOUGHT}</think>{PARIS}")
    fields: Any = {"model": MODEL_NAME, "max_tokens": 200, "messages": USER, "tools": [WEATHER]}
    whole = client_of(gateways).messages.create(**fields)
    with client_of(gateways).messages.stream(**fields) as stream:
        streamed = stream.get_final_message()
    for m in (whole, streamed):
        assert blocks(m) == [
            ("thinking", THOUGHT),
            ("tool_use", ("get_weather", {"city": "Paris"})),
        ]
        assert m.stop_reason == "tool_use"


def test_thinking_disabled_is_enable_thinking_false(
    gateways: dict[bool, GatewayServer], engine: FakeEngine, hf_tok: HFTokenizer
) -> None:
    """The template closes an empty think block; the qwen3 parser then reads it all as text."""
    script(engine, hf_tok, "Hello world!")
    m = client_of(gateways).messages.create(
        model=MODEL_NAME, max_tokens=200, messages=USER, thinking={"type": "disabled"}
    )
    assert prompt_text(engine, hf_tok, m.id).endswith(CLOSED)
    assert blocks(m) == [("text", "Hello world!")]


def test_a_thinking_block_sent_back_reaches_the_template(
    gateways: dict[bool, GatewayServer], engine: FakeEngine, hf_tok: HFTokenizer
) -> None:
    script(engine, hf_tok, OUTPUT)
    client = client_of(gateways)
    first = client.messages.create(model=MODEL_NAME, max_tokens=200, messages=USER)
    messages: Any = [
        *USER,
        {"role": "assistant", "content": first.content},
        {"role": "user", "content": "Again?"},
    ]
    second = client.messages.create(model=MODEL_NAME, max_tokens=200, messages=messages)
    text = prompt_text(engine, hf_tok, second.id)
    assert f"<|im_start|>assistant\n<think>\n{THOUGHT}\n</think>\n\n{ANSWER}<|im_end|>" in text
    # a redacted one is accepted and left out
    messages[1]["content"] = [{"type": "redacted_thinking", "data": "x"}, *messages[1]["content"]]
    third = client.messages.create(model=MODEL_NAME, max_tokens=200, messages=messages)
    assert prompt_text(engine, hf_tok, third.id) == text


def test_without_a_reasoning_parser_the_tags_are_text(
    gateways: dict[bool, GatewayServer], engine: FakeEngine, hf_tok: HFTokenizer
) -> None:
    script(engine, hf_tok, OUTPUT)
    m = client_of(gateways, parsing=False).messages.create(
        model=MODEL_NAME, max_tokens=200, messages=USER
    )
    assert blocks(m) == [("text", OUTPUT)]
