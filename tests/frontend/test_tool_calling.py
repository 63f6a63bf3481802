"""Tool calling through the gateway: the scripted engine writes tool-call markup, the gateway's
parsers turn it into ``tool_calls`` (whole, and as streamed pieces) with ``finish_reason``
"tool_calls"; required and named choices become a JSON-schema constraint; tools and tool results
reach the chat template; and the 400s."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest
from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer

from frontend_svc.errors import ApiError
from frontend_svc.protocol import parse_chat, parse_tokenize
from frontend_svc.text.output_processor import OutputProcessor
from frontend_svc.text.tokenizer import SpecialTokens, Tokenizer
from frontend_svc.tool_parsers import get_tool_parser
from protos.types import EngineOutput, StructuredOutput
from tests.chat_templates import QWEN_TOOLS_TEMPLATE
from tests.frontend.fake_engine import MODEL_NAME, FakeEngine
from tests.frontend.harness import GatewayServer
from tests.frontend.helpers_chat import (
    hf_tokenizer_of,
    lazy_gateways,
    openai_client,
    qwen_tokenizer_dir,
    script,
    serve_engine,
)
from tests.frontend.tiny_tokenizer import EOS

pytestmark = pytest.mark.timeout(60)

WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME: dict[str, Any] = {"type": "function", "function": {"name": "get_time"}}
TOOLS: Any = [WEATHER, TIME]
USER: Any = [{"role": "user", "content": "Weather in Paris?"}]
HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


# -- fixtures: a tokenizer holding <tool_call> as special tokens (as Qwen2.5/Qwen3 do) ----------


@pytest.fixture(scope="module")
def tool_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return qwen_tokenizer_dir(tmp_path_factory, "tool_tokenizer", QWEN_TOOLS_TEMPLATE)


@pytest.fixture(scope="module")
def hf_tok(tool_tokenizer_dir: Path) -> HFTokenizer:
    return hf_tokenizer_of(tool_tokenizer_dir)


@pytest.fixture(scope="module")
def engine(tool_tokenizer_dir: Path, hf_tok: HFTokenizer) -> Iterator[FakeEngine]:
    yield from serve_engine(tool_tokenizer_dir, hf_tok, step_s=0.001)


@pytest.fixture(scope="module")
def gateways(engine: FakeEngine) -> Iterator[dict[str | None, GatewayServer]]:
    """A gateway per --tool-call-parser (None: no parser, so no "auto"), started when first used."""
    yield from lazy_gateways(
        engine,
        lambda parser: {"tool_call_parser": parser, "enable_auto_tool_choice": parser is not None},
    )


def client_of(gateways: dict[str | None, GatewayServer], parser: str | None) -> openai.OpenAI:
    return openai_client(gateways[parser])


def chat(client: openai.OpenAI, **fields: Any) -> Any:
    return client.chat.completions.create(
        model=MODEL_NAME, messages=fields.pop("messages", USER), **fields
    )


def streamed(client: openai.OpenAI, **fields: Any) -> tuple[str, list[dict[str, Any]], Any]:
    """Content, calls reassembled from their pieces, and the finish reason of a streamed chat;
    checks the pieces' shape on the way."""
    content, calls, finish = "", [], None
    for chunk in chat(client, stream=True, **fields):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for piece in choice.delta.tool_calls or ():
            if piece.id is not None:  # a call's header: id, type and name, in that order
                assert piece.index == len(calls) and piece.type == "function"
                assert piece.id.startswith("chatcmpl-tool-") and piece.function.name
                calls.append({"id": piece.id, "name": piece.function.name, "arguments": ""})
            else:
                assert piece.index == len(calls) - 1 and piece.function.name is None
            calls[piece.index]["arguments"] += piece.function.arguments or ""
        if choice.finish_reason is not None:
            finish = choice.finish_reason
    return content, calls, finish


def whole(response: Any) -> tuple[str | None, list[dict[str, Any]], Any]:
    choice = response.choices[0]
    calls = [
        {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
        for c in choice.message.tool_calls or ()
    ]
    assert all(c.type == "function" for c in choice.message.tool_calls or ())
    return choice.message.content, calls, choice.finish_reason


def named(calls: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    return [(c["name"], json.loads(c["arguments"])) for c in calls]


# -- parsers ------------------------------------------------------------------------------------


def test_hermes_markers_held_as_special_tokens_still_reach_the_parser(
    gateways: dict[str | None, GatewayServer], engine: FakeEngine, hf_tok: HFTokenizer
) -> None:
    ids = script(engine, hf_tok, "Let me check.\n" + HERMES_CALL)
    assert hf_tok.token_to_id("<tool_call>") in ids  # one special token, not text
    client = client_of(gateways, "hermes")
    content, calls, finish = whole(chat(client, tools=TOOLS))
    assert content == "Let me check." and finish == "tool_calls"
    assert named(calls) == [("get_weather", {"city": "Paris"})]
    assert calls[0]["id"].startswith("chatcmpl-tool-")
    content, calls, finish = streamed(client, tools=TOOLS)
    assert content == "Let me check." and finish == "tool_calls"
    assert named(calls) == [("get_weather", {"city": "Paris"})]


def test_without_a_parser_special_markers_are_skipped_as_before(
    gateways: dict[str | None, GatewayServer], engine: FakeEngine, hf_tok: HFTokenizer
) -> None:
    script(engine, hf_tok, HERMES_CALL)
    client = client_of(gateways, "hermes")
    content, calls, finish = whole(chat(client, tools=TOOLS, tool_choice="none"))
    assert calls == [] and finish == "stop"
    assert content == '\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    kept = chat(client, tools=TOOLS, tool_choice="none", extra_body={"skip_special_tokens": False})
    assert kept.choices[0].message.content == HERMES_CALL


def test_text_without_calls_is_content(
    gateways: dict[str | None, GatewayServer], engine: FakeEngine, hf_tok: HFTokenizer
) -> None:
    text = "The answer is forty-two."
    script(engine, hf_tok, text)
    client = client_of(gateways, "hermes")
    assert whole(chat(client, tools=TOOLS)) == (text, [], "stop")
    assert streamed(client, tools=TOOLS) == (text, [], "stop")


def test_llama3_json_calls_and_parallel_tool_calls_false(
    gateways: dict[str | None, GatewayServer], engine: FakeEngine, hf_tok: HFTokenizer
) -> None:
    script(
        engine,
        hf_tok,
        '{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
        '{"name": "get_time", "parameters": {}}',
    )
    client = client_of(gateways, "llama3_json")
    expected = [("get_weather", {"city": "Oslo"}), ("get_time", {})]
    for content, calls, finish in (whole(chat(client, tools=TOOLS)), streamed(client, tools=TOOLS)):
        assert not content and finish == "tool_calls" and named(calls) == expected
    one = {"tools": TOOLS, "parallel_tool_calls": False}
    for content, calls, finish in (whole(chat(client, **one)), streamed(client, **one)):
        assert not content and finish == "tool_calls" and named(calls) == expected[:1]


def test_pythonic_calls(
    gateways: dict[str | None, GatewayServer], engine: FakeEngine, hf_tok: HFTokenizer
) -> None:
    script(engine, hf_tok, '[get_weather(city="Rome"), get_time()]')
    client = client_of(gateways, "pythonic")
    expected = [("get_weather", {"city": "Rome"}), ("get_time", {})]
    for content, calls, finish in (whole(chat(client, tools=TOOLS)), streamed(client, tools=TOOLS)):
        assert content in (None, "") and finish == "tool_calls" and named(calls) == expected


def test_a_choice_cut_off_after_its_call_finishes_with_length(
    gateways: dict[str | None, GatewayServer], engine: FakeEngine, hf_tok: HFTokenizer
) -> None:
    ids = script(engine, hf_tok, HERMES_CALL + "\nThe weather is nice, the answer is forty-two.")
    call_len = len(hf_tok.encode(HERMES_CALL, add_special_tokens=False).ids)
    assert len(ids) > call_len + 4
    client = client_of(gateways, "hermes")
    fields = {"tools": TOOLS, "max_tokens": call_len + 3}
    for _, calls, finish in (whole(chat(client, **fields)), streamed(client, **fields)):
        assert finish == "length" and named(calls) == [("get_weather", {"city": "Paris"})]


def test_n2_choices_parse_separately(
    gateways: dict[str | None, GatewayServer], engine: FakeEngine, hf_tok: HFTokenizer
) -> None:
    script(engine, hf_tok, HERMES_CALL)
    client = client_of(gateways, "hermes")
    r = chat(client, tools=TOOLS, n=2)
    assert [c.finish_reason for c in r.choices] == ["tool_calls"] * 2
    ids = {c.message.tool_calls[0].id for c in r.choices}
    assert len(ids) == 2  # every call has its own id
    arguments = ["", ""]
    for chunk in chat(client, tools=TOOLS, n=2, stream=True):
        for choice in chunk.choices:
            for piece in choice.delta.tool_calls or ():
                arguments[choice.index] += piece.function.arguments or ""
    assert [json.loads(a) for a in arguments] == [{"city": "Paris"}] * 2


# -- required and named choices: the output is the calls' JSON ---------------------------------


def test_named_choice_output_is_the_arguments(
    gateways: dict[str | None, GatewayServer], engine: FakeEngine, hf_tok: HFTokenizer
) -> None:
    script(engine, hf_tok, '{"city": "Oslo"}')
    client = client_of(gateways, None)  # no parser needed
    choice = {"type": "function", "function": {"name": "get_weather"}}
    fields: Any = {"tools": TOOLS, "tool_choice": choice}
    for content, calls, finish in (whole(chat(client, **fields)), streamed(client, **fields)):
        assert not content and finish == "tool_calls"
        assert named(calls) == [("get_weather", {"city": "Oslo"})]


def test_required_choice_output_is_a_list_of_calls(
    gateways: dict[str | None, GatewayServer], engine: FakeEngine, hf_tok: HFTokenizer
) -> None:
    script(
        engine,
        hf_tok,
        '[{"name": "get_weather", "parameters": {"city": "Oslo"}}, '
        '{"name": "get_time", "parameters": {}}]',
    )
    client = client_of(gateways, None)
    fields: Any = {"tools": TOOLS, "tool_choice": "required"}
    expected = [("get_weather", {"city": "Oslo"}), ("get_time", {})]
    for content, calls, finish in (whole(chat(client, **fields)), streamed(client, **fields)):
        assert not content and finish == "tool_calls" and named(calls) == expected


def test_constrained_calls_answer_as_vllm_does(
    gateways: dict[str | None, GatewayServer], engine: FakeEngine, hf_tok: HFTokenizer
) -> None:
    """tool_choice required or named: content is "" beside the calls (not null), and a choice
    that max_tokens cut off before a call was whole has tool_calls [] (vLLM's answer)."""
    ids = script(engine, hf_tok, '[{"name": "get_weather", "parameters": {"city": "Oslo"}}]')
    client = client_of(gateways, None)
    required: Any = {"tools": TOOLS, "tool_choice": "required"}
    message = chat(client, **required).choices[0].message
    assert message.content == "" and len(message.tool_calls or ()) == 1
    cut = chat(client, **required, max_tokens=len(ids) // 2).choices[0]
    assert cut.finish_reason == "length"
    assert cut.message.content == "" and cut.message.tool_calls == []
    script(engine, hf_tok, '{"city": "Oslo"}')
    named_choice = {"type": "function", "function": {"name": "get_weather"}}
    message = chat(client, tools=TOOLS, tool_choice=named_choice).choices[0].message
    assert message.content == "" and len(message.tool_calls or ()) == 1


def test_auto_needs_both_server_flags(gateways: dict[str | None, GatewayServer]) -> None:
    client = client_of(gateways, None)
    for fields in ({"tools": TOOLS}, {"tools": TOOLS, "tool_choice": "auto"}):
        with pytest.raises(openai.BadRequestError) as e:
            chat(client, **fields)
        body: Any = e.value.body
        assert body["param"] == "tool_choice"
        assert "--enable-auto-tool-choice and --tool-call-parser" in body["message"]


# -- the chat template: tools, an assistant's calls and tool results ----------------------------

ROUND_TRIP: Any = [
    *USER,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call-1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call-1", "name": "get_weather", "content": "22 C, sunny"},
]


def test_tools_and_tool_results_are_rendered(
    gateways: dict[str | None, GatewayServer], engine: FakeEngine, hf_tok: HFTokenizer
) -> None:
    g = gateways["hermes"]
    r = httpx.post(f"{g.url}/tokenize", json={"messages": ROUND_TRIP, "tools": TOOLS})
    assert r.status_code == 200, r.text
    text = hf_tok.decode(r.json()["tokens"], skip_special_tokens=False)
    assert json.dumps(WEATHER) in text  # the definitions, as sent
    # The call's arguments reached the template as an object (tojson writes it back).
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    assert "<tool_response>\n22 C, sunny\n</tool_response>" in text
    without_tools = httpx.post(f"{g.url}/tokenize", json={"messages": ROUND_TRIP}).json()
    assert without_tools["count"] < r.json()["count"]

    text_answer = "It is sunny."
    script(engine, hf_tok, text_answer)
    client = client_of(gateways, "hermes")
    r2 = chat(client, messages=ROUND_TRIP, tools=TOOLS)
    assert r2.choices[0].message.content == text_answer
    assert r2.usage is not None and r2.usage.prompt_tokens == r.json()["count"]


# -- parsing (no server) -----------------------------------------------------------------------


def _chat_body(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": USER, **fields}


def test_required_and_named_choices_become_the_tool_schema_constraint() -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice, names in (("required", ["get_weather", "get_time"]), (named, None)):
        req = parse_chat(_chat_body(tools=TOOLS, tool_choice=choice), 5)
        schema = req.tools.json_schema()  # its own shape: tests/frontend/test_tools.py
        assert req.sampling.engine.structured_output == StructuredOutput(
            "json_schema", orjson.dumps(schema).decode()
        )
        assert req.sampling.structured_output_param == "tool_choice"
        assert schema is not None
        if names is None:  # named: that function's parameters
            assert schema == WEATHER["function"]["parameters"]
        else:  # required: an array of calls to any of the tools
            branches = schema["items"]["anyOf"]
            assert [b["properties"]["name"]["enum"] for b in branches] == [[n] for n in names]
    for choice in ("none", "auto"):
        req = parse_chat(_chat_body(tools=TOOLS, tool_choice=choice), 5, True)
        assert req.sampling.engine.structured_output is None and req.tools.choice == choice


def _rejected(body: dict[str, Any], param: str | None, match: str) -> None:
    with pytest.raises(ApiError) as e:
        parse_chat(body, 5, True)
    assert e.value.status == 400 and e.value.param == param, e.value.message
    assert match in e.value.message, e.value.message


@pytest.mark.parametrize(
    "constraint",
    [
        {"response_format": {"type": "json_object"}},
        {"structured_outputs": {"regex": "[a-z]+"}},
        {"guided_json": {"type": "object"}},
    ],
)
@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_time"}}]
)
def test_a_tool_choice_and_a_constraint_of_its_own_are_refused(
    constraint: dict[str, Any], choice: Any
) -> None:
    _rejected(
        _chat_body(tools=TOOLS, tool_choice=choice, **constraint),
        next(iter(constraint)),
        "You can only either use constraints for structured outputs or tools, not both.",
    )
    # "auto" and "none" leave the output free, so a constraint of its own is fine.
    req = parse_chat(_chat_body(tools=TOOLS, tool_choice="auto", **constraint), 5, True)
    assert req.sampling.engine.structured_output is not None


def test_a_named_function_without_tools_is_refused() -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    _rejected(_chat_body(tool_choice=choice), "tool_choice", "needs 'tools'")
    _rejected(_chat_body(tool_choice=choice, tools=[TIME]), "tool_choice", "not in 'tools'")


def test_assistant_tool_calls_reach_the_template_with_object_arguments() -> None:
    req = parse_chat(_chat_body(messages=ROUND_TRIP), 5)
    call = req.messages[1]["tool_calls"][0]
    assert call["function"] == {"name": "get_weather", "arguments": {"city": "Paris"}}
    assert req.messages[1]["content"] == ""
    assert req.messages[2]["tool_call_id"] == "call-1"
    assert ROUND_TRIP[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'
    empty = [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": ""}}]}]
    assert (
        parse_chat(_chat_body(messages=empty), 5).messages[0]["tool_calls"][0]["function"][
            "arguments"
        ]
        == {}
    )
    tokenize = parse_tokenize({"messages": ROUND_TRIP, "tools": [TIME]})
    assert tokenize.tools == [TIME]
    assert tokenize.messages is not None and tokenize.messages[1]["tool_calls"][0] == call


@pytest.mark.parametrize(
    ("message", "match"),
    [
        ({"role": "assistant", "tool_calls": {"a": 1}}, "tool_calls' must be a list"),
        ({"role": "assistant", "tool_calls": ["x"]}, "tool_calls[0]' must be an object"),
        ({"role": "assistant", "tool_calls": [{"function": {}}]}, "function.name"),
        (
            {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]},
            "arguments' is not valid JSON",
        ),
        (
            {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 3}}]},
            "arguments' must be a JSON text",
        ),
        ({"role": "tool", "content": "x", "tool_call_id": 7}, "tool_call_id' must be a string"),
    ],
)
def test_malformed_tool_messages_are_refused(message: dict[str, Any], match: str) -> None:
    _rejected(_chat_body(messages=[*USER, message]), "messages", match)


@pytest.mark.parametrize("special", [True, False], ids=["special", "plain_added"])
def test_parser_markers_survive_skip_special_tokens(tokenizer_dir: Path, special: bool) -> None:
    """Qwen2.5/Qwen3 add <tool_call> as a plain (non-special) token, which skip_special_tokens
    never drops; a tokenizer marking it special gets it kept for the parser all the same."""
    hf = HFTokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    hf.add_tokens([AddedToken(t, special=special) for t in ("<tool_call>", "</tool_call>")])
    tokenizer = Tokenizer(hf, SpecialTokens("<|bos|>", EOS), None)
    kept = tokenizer.special_ids_of(get_tool_parser("hermes").markers)
    assert len(kept) == (2 if special else 0)
    ids = hf.encode(HERMES_CALL + "<|im_end|>", add_special_tokens=False).ids
    processor = OutputProcessor(tokenizer, [0], [], False, True, 0, 0, kept_special_ids=kept)
    text = "".join(processor.process(EngineOutput("r", (t,))).text for t in ids)
    assert text == HERMES_CALL  # the markers kept, <|im_end|> still dropped


# -- Kimi-K2's call ids -------------------------------------------------------------------------


def test_kimi_k2_calls_are_named_functions_name_index(
    tool_tokenizer_dir: Path, hf_tok: HFTokenizer
) -> None:
    """vLLM names a kimi_k2 model's calls ``functions.NAME:INDEX`` (config.json's model_type,
    which the engine reports), INDEX counting on from the calls already in the conversation;
    other models' ids stay random."""
    engine = FakeEngine(
        tool_tokenizer_dir,
        [0],
        vocab_size=hf_tok.get_vocab_size(),
        max_model_len=2048,
        step_s=0.001,
        model_type="kimi_k2",
    )
    engine.start()
    gateway = GatewayServer(
        engine.address, tool_call_parser="hermes", enable_auto_tool_choice=True
    ).start()
    try:
        gateway.wait_healthy()
        client = openai.OpenAI(
            base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0, timeout=10
        )
        time_call = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
        script(engine, hf_tok, HERMES_CALL + time_call)
        r = chat(client, tools=TOOLS)
        ids = [c.id for c in r.choices[0].message.tool_calls]
        assert ids == ["functions.get_weather:0", "functions.get_time:1"]
        earlier = {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "functions.get_weather:0",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        }
        result = {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "sun"}
        messages = [*USER, earlier, result]
        r = chat(client, tools=TOOLS, messages=messages)
        assert [c.id for c in r.choices[0].message.tool_calls] == [
            "functions.get_weather:1",
            "functions.get_time:2",
        ]
        pieces = [
            piece.id
            for chunk in chat(client, tools=TOOLS, messages=messages, stream=True)
            for choice in chunk.choices
            for piece in choice.delta.tool_calls or ()
            if piece.id is not None
        ]
        assert pieces == ["functions.get_weather:1", "functions.get_time:2"]
    finally:
        gateway.stop()
        engine.stop()
