"""Reasoning through the gateway: the scripted engine writes ``<think>``…``</think>`` output, a
gateway with ``--reasoning-parser`` answers ``message.reasoning`` / ``reasoning_content`` apart
from the content (whole and streamed), with tool calling (only the content is read for calls),
``enable_thinking`` false, structured outputs, and the reasoning tokens in the usage."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from tokenizers import Tokenizer as HFTokenizer

from tests.chat_templates import QWEN3_THINKING_TEMPLATE
from tests.frontend.conftest import make_engine
from tests.frontend.fake_engine import MODEL_NAME, FakeEngine
from tests.frontend.harness import GatewayServer
from tests.frontend.helpers_chat import (
    hf_tokenizer_of,
    lazy_gateways,
    qwen_tokenizer_dir,
    script,
    serve_engine,
    token_id,
)
from tests.frontend.tiny_tokenizer import EOS

pytestmark = pytest.mark.timeout(60)

THOUGHT = "\nThe user greets me. I say hello.\n"
ANSWER = "\n\nHello world!"
QWEN3_OUTPUT = f"<think>{THOUGHT}</think>{ANSWER}"  # Qwen3 writes the start tag itself
USER: Any = [{"role": "user", "content": "Hi"}]
WEATHER: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
TIME: Any = {"type": "function", "function": {"name": "get_time"}}
HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TIME_CALL = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'


# -- fixtures: Qwen3's vocabulary shape (think tags as plain added tokens, tool-call tags as
# special ones) and a chat template that thinks as Qwen3's does --------------------------------


@pytest.fixture(scope="module")
def think_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return qwen_tokenizer_dir(
        tmp_path_factory, "think_tokenizer", QWEN3_THINKING_TEMPLATE, think=True
    )


@pytest.fixture(scope="module")
def hf_tok(think_tokenizer_dir: Path) -> HFTokenizer:
    return hf_tokenizer_of(think_tokenizer_dir)


@pytest.fixture(scope="module")
def engine(think_tokenizer_dir: Path, hf_tok: HFTokenizer) -> Iterator[FakeEngine]:
    yield from serve_engine(think_tokenizer_dir, hf_tok, step_s=0.001)


Flags = tuple[str | None, str | None]  # (--reasoning-parser, --tool-call-parser)


@pytest.fixture(scope="module")
def gateways(engine: FakeEngine) -> Iterator[dict[Flags, GatewayServer]]:
    def config(flags: Flags) -> dict[str, Any]:
        reasoning, tools = flags
        return {
            "reasoning_parser": reasoning,
            "tool_call_parser": tools,
            "enable_auto_tool_choice": tools is not None,
        }

    yield from lazy_gateways(engine, config)


def post(gateway: GatewayServer, **body: Any) -> dict[str, Any]:
    body = {"model": MODEL_NAME, "messages": USER, **body}
    r = httpx.post(f"{gateway.url}/v1/chat/completions", json=body, timeout=10)
    assert r.status_code == 200, r.text
    result: dict[str, Any] = r.json()
    return result


def sse(gateway: GatewayServer, **body: Any) -> list[dict[str, Any]]:
    """The chunks of a streamed chat, as sent."""
    body = {"model": MODEL_NAME, "messages": USER, "stream": True, **body}
    chunks = []
    with httpx.stream("POST", f"{gateway.url}/v1/chat/completions", json=body, timeout=10) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: ") :]))
    assert not any("error" in c for c in chunks), chunks
    return chunks


def joined(chunks: list[dict[str, Any]], index: int = 0) -> dict[str, Any]:
    """Choice ``index`` of a stream put back together, checking each delta's shape: reasoning
    and reasoning_content are the same piece; no reasoning once the content has begun."""
    out: dict[str, Any] = {"reasoning": "", "content": "", "calls": [], "finish": None}
    num_reasoning_chunks = 0
    for chunk in chunks:
        for choice in chunk["choices"]:
            if choice["index"] != index:
                continue
            delta = choice["delta"]
            assert delta.get("reasoning") == delta.get("reasoning_content")
            if delta.get("reasoning"):
                assert not out["content"].strip(), "reasoning after the content began"
                out["reasoning"] += delta["reasoning"]
                num_reasoning_chunks += 1
            out["content"] += delta.get("content") or ""
            for piece in delta.get("tool_calls") or ():
                if "id" in piece:
                    out["calls"].append({"name": piece["function"]["name"], "arguments": ""})
                out["calls"][piece["index"]]["arguments"] += piece["function"].get("arguments", "")
            out["finish"] = choice["finish_reason"] or out["finish"]
    out["num_reasoning_chunks"] = num_reasoning_chunks
    return out


def split_of(message: dict[str, Any]) -> tuple[str | None, str | None]:
    return message["reasoning"], message["content"]


def calls_of(message: dict[str, Any]) -> list[tuple[str, Any]]:
    return [
        (c["function"]["name"], json.loads(c["function"]["arguments"]))
        for c in message.get("tool_calls") or ()
    ]


def reasoning_tokens(usage: dict[str, Any]) -> int:
    details: dict[str, int] = usage["completion_tokens_details"]
    return details["reasoning_tokens"]


# -- the split ----------------------------------------------------------------------------------


def test_whole_answer_carries_reasoning_and_content(
    gateways: dict[Flags, GatewayServer], engine: FakeEngine, hf_tok: HFTokenizer
) -> None:
    ids = script(engine, hf_tok, QWEN3_OUTPUT)
    start, end = token_id(hf_tok, "<think>"), token_id(hf_tok, "</think>")
    assert ids[0] == start and ids.count(end) == 1  # the tags are tokens of their own
    body = post(gateways["qwen3", None])
    (choice,) = body["choices"]
    message = choice["message"]
    assert message["reasoning"] == message["reasoning_content"] == THOUGHT
    assert message["content"] == ANSWER
    assert choice["finish_reason"] == "stop"
    usage = body["usage"]
    assert usage["completion_tokens"] == len(ids) + 1  # and EOS
    assert reasoning_tokens(usage) == ids.index(end) - 1  # between the tags


def test_stream_carries_reasoning_then_content(
    gateways: dict[Flags, GatewayServer], engine: FakeEngine, hf_tok: HFTokenizer
) -> None:
    ids = script(engine, hf_tok, QWEN3_OUTPUT)
    end = ids.index(token_id(hf_tok, "</think>"))
    chunks = sse(gateways["qwen3", None], stream_options={"include_usage": True})
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    out = joined(chunks)
    assert (out["reasoning"], out["content"], out["finish"]) == (THOUGHT, ANSWER, "stop")
    # Streamed as it came: a chunk per engine message, one token a step (fewer when the engine
    # merged steps the gateway had not read yet, as a real engine does under load).
    assert 1 < out["num_reasoning_chunks"] <= end - 1
    assert reasoning_tokens(chunks[-1]["usage"]) == end - 1


def test_n_choices_split_and_count_each(
    gateways: dict[Flags, GatewayServer], engine: FakeEngine, hf_tok: HFTokenizer
) -> None:
    ids = script(engine, hf_tok, QWEN3_OUTPUT)
    num = ids.index(token_id(hf_tok, "</think>")) - 1
    gateway = gateways["qwen3", None]
    body = post(gateway, n=2)
    assert [c["message"]["reasoning"] for c in body["choices"]] == [THOUGHT, THOUGHT]
    assert reasoning_tokens(body["usage"]) == 2 * num
    chunks = sse(gateway, n=2, stream_options={"include_usage": True})
    for index in (0, 1):
        out = joined(chunks, index)
        assert (out["reasoning"], out["content"]) == (THOUGHT, ANSWER)
    assert reasoning_tokens(chunks[-1]["usage"]) == 2 * num


def test_deepseek_r1_reasoning_without_start_tag_and_without_end(
    gateways: dict[Flags, GatewayServer], engine: FakeEngine, hf_tok: HFTokenizer
) -> None:
    gateway = gateways["deepseek_r1", None]
    # The template put <think> in the prompt: the output starts inside the reasoning.
    ids = script(engine, hf_tok, "Six times seven.</think>The answer is forty-two.")
    message = post(gateway)["choices"][0]["message"]
    assert split_of(message) == ("Six times seven.", "The answer is forty-two.")
    # No </think> at all: everything is reasoning, content null.
    ids = script(engine, hf_tok, "The answer is forty-two.")
    body = post(gateway)
    message = body["choices"][0]["message"]
    assert message["reasoning"] == "The answer is forty-two." and message["content"] is None
    assert reasoning_tokens(body["usage"]) == len(ids) + 1 == body["usage"]["completion_tokens"]
    out = joined(sse(gateway))
    assert (out["reasoning"], out["content"]) == ("The answer is forty-two.", "")
    # Cut off while thinking.
    body = post(gateway, max_tokens=3)
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["choices"][0]["message"]["reasoning"] == hf_tok.decode(ids[:3])
    assert reasoning_tokens(body["usage"]) == 3


def test_tags_split_across_tokens_stream_the_same(
    tokenizer_dir: Path, hf_tokenizer: HFTokenizer
) -> None:
    """With a vocabulary that has no think tokens the tags arrive in pieces, one per step."""
    text = "<think>The quick brown fox.</think>Hello world!"
    engine = make_engine(tokenizer_dir, hf_tokenizer, step_s=0.001)
    ids = hf_tokenizer.encode(text, add_special_tokens=False).ids
    engine.script = [*ids, token_id(hf_tokenizer, EOS)]
    assert len(hf_tokenizer.encode("</think>", add_special_tokens=False).ids) > 2
    engine.start()
    gateway = GatewayServer(engine.address, reasoning_parser="qwen3").start()
    try:
        gateway.wait_healthy()
        message = post(gateway)["choices"][0]["message"]
        assert split_of(message) == ("The quick brown fox.", "Hello world!")
        out = joined(sse(gateway))
        assert (out["reasoning"], out["content"]) == ("The quick brown fox.", "Hello world!")
    finally:
        gateway.stop()
        engine.stop()


def test_without_a_reasoning_parser_nothing_changes(
    gateways: dict[Flags, GatewayServer], engine: FakeEngine, hf_tok: HFTokenizer
) -> None:
    script(engine, hf_tok, QWEN3_OUTPUT)
    gateway = gateways[None, None]
    body = post(gateway)
    message = body["choices"][0]["message"]
    assert message == {"role": "assistant", "content": QWEN3_OUTPUT}
    assert "completion_tokens_details" not in body["usage"]
    chunks = sse(gateway, stream_options={"include_usage": True})
    assert joined(chunks)["content"] == QWEN3_OUTPUT
    assert not any("reasoning" in c["delta"] for chunk in chunks for c in chunk["choices"])
    assert "completion_tokens_details" not in chunks[-1]["usage"]


# -- tool calling: only the content is read for calls -------------------------------------------


def test_a_call_inside_the_reasoning_is_not_parsed(
    gateways: dict[Flags, GatewayServer], engine: FakeEngine, hf_tok: HFTokenizer
) -> None:
    thought = f"\nI could ask the time: {TIME_CALL} but the weather matters.\n"
    script(engine, hf_tok, f"<think>{thought}</think>\n\n{HERMES_CALL}")
    gateway = gateways["qwen3", "hermes"]
    fields = {"tools": [WEATHER, TIME]}
    choice = post(gateway, **fields)["choices"][0]
    message = choice["message"]
    assert calls_of(message) == [("get_weather", {"city": "Paris"})]
    assert message["reasoning"] == thought  # the <tool_call> markers kept, as text
    assert not (message["content"] or "").strip() and choice["finish_reason"] == "tool_calls"
    out = joined(sse(gateway, **fields))
    assert out["reasoning"] == thought and out["finish"] == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in out["calls"]] == [
        ("get_weather", {"city": "Paris"})
    ]


def test_a_call_in_unfinished_reasoning_is_no_call(
    gateways: dict[Flags, GatewayServer], engine: FakeEngine, hf_tok: HFTokenizer
) -> None:
    text = f"<think>\nMaybe {HERMES_CALL}"
    script(engine, hf_tok, text)
    gateway = gateways["qwen3", "hermes"]
    choice = post(gateway, tools=[WEATHER])["choices"][0]
    assert "tool_calls" not in choice["message"] and choice["finish_reason"] == "stop"
    assert choice["message"]["reasoning"] == f"\nMaybe {HERMES_CALL}"
    out = joined(sse(gateway, tools=[WEATHER]))
    assert out["calls"] == [] and out["finish"] == "stop"
    assert out["reasoning"] == f"\nMaybe {HERMES_CALL}"


# -- enable_thinking and the chat template ------------------------------------------------------


def prompt_text(body: dict[str, Any], hf_tok: HFTokenizer) -> str:
    return hf_tok.decode(body["prompt_token_ids"], skip_special_tokens=False)


@pytest.mark.parametrize("flags", [(None, None), ("qwen3", None)])
def test_chat_template_kwargs_reach_the_template(
    flags: Flags,
    gateways: dict[Flags, GatewayServer],
    engine: FakeEngine,
    hf_tok: HFTokenizer,
) -> None:
    script(engine, hf_tok, "Hello world!")
    gateway = gateways[flags]
    off = post(gateway, chat_template_kwargs={"enable_thinking": False}, return_token_ids=True)
    on = post(gateway, return_token_ids=True)
    assert prompt_text(off, hf_tok).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert prompt_text(on, hf_tok).endswith("<|im_start|>assistant\n")


def test_enable_thinking_false_answers_content_only(
    gateways: dict[Flags, GatewayServer], engine: FakeEngine, hf_tok: HFTokenizer
) -> None:
    text = "No thinking here.</think> Still content."  # even a stray tag is content
    script(engine, hf_tok, text)
    gateway = gateways["qwen3", None]
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    body = post(gateway, **off)
    message = body["choices"][0]["message"]
    assert message["content"] == text
    assert message["reasoning"] is None and message["reasoning_content"] is None
    assert reasoning_tokens(body["usage"]) == 0
    chunks = sse(gateway, stream_options={"include_usage": True}, **off)
    out = joined(chunks)
    assert (out["reasoning"], out["content"]) == ("", text)
    assert reasoning_tokens(chunks[-1]["usage"]) == 0
    # With thinking on, the same text is read as reasoning up to its </think>.
    message = post(gateway)["choices"][0]["message"]
    assert split_of(message) == ("No thinking here.", " Still content.")


def test_an_earlier_turns_reasoning_does_not_end_this_ones(
    gateways: dict[Flags, GatewayServer], engine: FakeEngine, hf_tok: HFTokenizer
) -> None:
    messages = [
        *USER,
        {"role": "assistant", "content": "Hello", "reasoning_content": "They greet me."},
        {"role": "user", "content": "And now?"},
    ]
    script(engine, hf_tok, "Again a greeting.</think>Hello again!")
    body = post(gateways["deepseek_r1", None], messages=messages, return_token_ids=True)
    assert "</think>" in prompt_text(body, hf_tok)  # the earlier turn's, in the prompt
    assert split_of(body["choices"][0]["message"]) == ("Again a greeting.", "Hello again!")


# -- structured outputs -------------------------------------------------------------------------


def sent_constraint(engine: FakeEngine) -> Any:
    """The structured-output constraint of the engine's latest request."""
    return engine.add_messages[engine.added[-1]].sampling_params.structured_output


PERSON: Any = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}


def test_constraint_applies_after_the_reasoning(
    gateways: dict[Flags, GatewayServer], engine: FakeEngine, hf_tok: HFTokenizer
) -> None:
    """As vLLM with a reasoning parser: the engine gets the end tag's ids with the constraint
    (it constrains only what follows), and the gateway splits the reasoning off the JSON."""
    import jsonschema

    end_ids = [token_id(hf_tok, "</think>")]
    script(engine, hf_tok, f'<think>{THOUGHT}</think>{{"city": "Paris"}}')
    gateway = gateways["qwen3", None]
    schema = {"name": "person", "schema": PERSON}
    fields: Any = {"response_format": {"type": "json_schema", "json_schema": schema}}
    body = post(gateway, **fields)
    assert list(sent_constraint(engine).reasoning_end_token_ids) == end_ids
    assert json.loads(sent_constraint(engine).json_schema) == PERSON
    message = body["choices"][0]["message"]
    assert message["reasoning"] == message["reasoning_content"] == THOUGHT
    jsonschema.validate(json.loads(message["content"]), PERSON)
    assert reasoning_tokens(body["usage"]) > 0
    streamed = joined(sse(gateway, **fields))
    assert streamed["reasoning"] == THOUGHT and json.loads(streamed["content"]) == {"city": "Paris"}
    # tool_choice "required" is a constraint too: its calls follow the reasoning.
    call = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}]'
    script(engine, hf_tok, f"<think>{THOUGHT}</think>{call}")
    fields = {"tools": [WEATHER], "tool_choice": "required"}
    choice = post(gateway, **fields)["choices"][0]
    assert list(sent_constraint(engine).reasoning_end_token_ids) == end_ids
    assert calls_of(choice["message"]) == [("get_weather", {"city": "Oslo"})]
    assert choice["message"]["reasoning"] == THOUGHT and choice["finish_reason"] == "tool_calls"


def test_constraint_without_reasoning_applies_from_the_start(
    gateways: dict[Flags, GatewayServer], engine: FakeEngine, hf_tok: HFTokenizer
) -> None:
    """Thinking off (or no reasoning parser): the constraint covers the whole output, which is
    all content."""
    script(engine, hf_tok, '{"city": "Paris"}')
    fields: Any = {"response_format": {"type": "json_object"}}
    off: Any = {"chat_template_kwargs": {"enable_thinking": False}}
    body = post(gateways["qwen3", None], **fields, **off)
    assert list(sent_constraint(engine).reasoning_end_token_ids) == []
    message = body["choices"][0]["message"]
    assert message["content"] == '{"city": "Paris"}' and message["reasoning"] is None
    assert reasoning_tokens(body["usage"]) == 0
    body = post(gateways[None, None], **fields)
    assert list(sent_constraint(engine).reasoning_end_token_ids) == []
    assert body["choices"][0]["message"]["content"] == '{"city": "Paris"}'


# -- the openai SDK -----------------------------------------------------------------------------


def test_openai_sdk_reads_reasoning(
    gateways: dict[Flags, GatewayServer], engine: FakeEngine, hf_tok: HFTokenizer
) -> None:
    ids = script(engine, hf_tok, QWEN3_OUTPUT)
    url = f"{gateways['qwen3', None].url}/v1"
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=10)
    r = client.chat.completions.create(model=MODEL_NAME, messages=USER)
    message: Any = r.choices[0].message
    assert message.reasoning == message.reasoning_content == THOUGHT
    assert message.content == ANSWER
    assert r.usage is not None and r.usage.completion_tokens_details is not None
    num = ids.index(token_id(hf_tok, "</think>")) - 1
    assert r.usage.completion_tokens_details.reasoning_tokens == num
    reasoning, content = "", ""
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=USER, stream=True, stream_options={"include_usage": True}
    )
    for chunk in stream:
        for choice in chunk.choices:
            delta: Any = choice.delta
            reasoning += getattr(delta, "reasoning", None) or ""
            content += delta.content or ""
        if chunk.usage is not None:
            assert chunk.usage.completion_tokens_details is not None
            assert chunk.usage.completion_tokens_details.reasoning_tokens == num
    assert (reasoning, content) == (THOUGHT, ANSWER)
