"""Tool calling end to end: the official ``openai`` client, the real gateway (``--tool-call-parser
hermes --enable-auto-tool-choice``), the real engine serving the embedded random-weight model
with a tool-aware (Qwen-style) chat template.

With random weights, ``tool_choice`` "required" and named functions must still give calls whose
arguments parse and validate against the tool's parameters: structured outputs enforce them.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.chat_templates import QWEN_TOOLS_TEMPLATE
from tests.conftest import SESSION_ENGINE_FLAGS
from tests.integration.harness import API_KEY, Engine, Gateway

pytestmark = pytest.mark.timeout(180)

MODEL = "tandem-tiny-tools"
# Parameters bounded so that a random model ends every value within max_tokens (it pads JSON with
# whitespace, up to the engine's limit per run: a "required" call list can take ~600 tokens).
TOOLS: Any = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"enum": ["Paris", "Oslo", "Rome"]},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "minimum": 0, "maximum": 99},
                    "b": {"type": "integer", "minimum": -9, "maximum": 9},
                },
                "required": ["a", "b"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "note",
            "parameters": {
                "type": "object",
                "properties": {
                    # Not maxLength: xgrammar lets a random model end a string inside a
                    # multi-byte character, which decodes to more characters than it counted.
                    "text": {"type": "string", "pattern": "^[a-z ]{1,6}$"},
                    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
                },
                "required": ["text", "tags"],
                "additionalProperties": False,
            },
        },
    },
]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES: Any = [{"role": "user", "content": "What is the weather in Paris?"}]
SAMPLINGS: Any = [{"temperature": 0.0}, {"temperature": 1.0, "seed": 7, "n": 2}]


@pytest.fixture(scope="module")
def tools_model(cache_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded model with a chat template that renders tools and tool results."""
    from engine_svc.default_model import default_model_dir

    target = tmp_path_factory.mktemp("tools_model") / "model"
    shutil.copytree(default_model_dir(), target)
    (target / "chat_template.jinja").write_text(QWEN_TOOLS_TEMPLATE)
    return target


@pytest.fixture(scope="module")
def tools_gateway(tools_model: Path, cache_dir: Path, log_dir: Path) -> Iterator[Gateway]:
    engine = Engine(
        cache_dir,
        log_dir,
        "--model",
        str(tools_model),
        "--served-model-name",
        MODEL,
        *SESSION_ENGINE_FLAGS,
    )
    gateway = None
    try:
        engine.wait_ready()
        gateway = Gateway(
            engine.address,
            cache_dir,
            log_dir,
            "--tool-call-parser",
            "hermes",
            "--enable-auto-tool-choice",
        )
        yield gateway.wait_healthy()
    finally:
        if gateway is not None:
            gateway.stop()
        engine.stop()


@pytest.fixture()
def client(tools_gateway: Gateway) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{tools_gateway.url}/v1", api_key=API_KEY, max_retries=0, timeout=60
    )


def _create(client: openai.OpenAI, **fields: Any) -> Any:
    fields.setdefault("max_tokens", 300)
    return client.chat.completions.create(
        model=MODEL, messages=fields.pop("messages", MESSAGES), **fields
    )


def _check_calls(calls: list[tuple[str, str]], names: set[str]) -> None:
    assert calls
    for name, arguments in calls:
        assert name in names
        jsonschema.validate(json.loads(arguments), PARAMETERS[name])


def _whole_calls(choice: Any) -> list[tuple[str, str]]:
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content == ""  # required or named: the output was the calls (vLLM)
    calls = choice.message.tool_calls or []
    assert all(c.type == "function" and c.id.startswith("chatcmpl-tool-") for c in calls)
    return [(c.function.name, c.function.arguments) for c in calls]


def _streamed_calls(stream: Any) -> list[tuple[str, str]]:
    names: list[str] = []
    arguments: list[str] = []
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            assert not choice.delta.content
            for piece in choice.delta.tool_calls or ():
                if piece.id is not None:
                    assert piece.index == len(names) and piece.type == "function"
                    names.append(piece.function.name)
                    arguments.append("")
                arguments[piece.index] += piece.function.arguments or ""
            finish = choice.finish_reason or finish
    assert finish == "tool_calls"
    return list(zip(names, arguments, strict=True))


@pytest.mark.parametrize("parallel", [True, False], ids=["parallel", "one_call"])
def test_required_gives_valid_calls(client: openai.OpenAI, parallel: bool) -> None:
    def create(sampling: dict[str, Any]) -> Any:
        return _create(
            client,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=parallel,
            max_tokens=1000,
            **sampling,
        )

    with ThreadPoolExecutor(2) as pool:  # greedy and two seeded samples, batched by the engine
        responses = list(pool.map(create, SAMPLINGS))
    choices = [c for r in responses for c in r.choices]
    assert len(choices) == 3
    for choice in choices:
        calls = _whole_calls(choice)
        _check_calls(calls, set(PARAMETERS))
        assert parallel or len(calls) == 1

    streamed = _streamed_calls(
        _create(
            client,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=parallel,
            max_tokens=1000,
            temperature=1.0,
            seed=5,
            stream=True,
        )
    )
    _check_calls(streamed, set(PARAMETERS))
    assert parallel or len(streamed) == 1


@pytest.mark.parametrize("name", list(PARAMETERS))
def test_a_named_function_gives_one_valid_call(client: openai.OpenAI, name: str) -> None:
    choice: Any = {"type": "function", "function": {"name": name}}
    r = _create(client, tools=TOOLS, tool_choice=choice, temperature=1.0, seed=3, n=2)
    for c in r.choices:
        calls = _whole_calls(c)
        assert len(calls) == 1
        _check_calls(calls, {name})
    streamed = _streamed_calls(
        _create(client, tools=TOOLS, tool_choice=choice, temperature=0.0, stream=True)
    )
    assert len(streamed) == 1
    _check_calls(streamed, {name})


def test_none_and_auto_leave_the_output_free(client: openai.OpenAI) -> None:
    r = _create(client, tools=TOOLS, tool_choice="none", max_tokens=12, temperature=0.0)
    choice = r.choices[0]
    assert choice.message.content and not choice.message.tool_calls
    assert choice.finish_reason in ("stop", "length")
    # "auto": this model writes no <tool_call> blocks, so its text comes back as content.
    auto = _create(client, tools=TOOLS, max_tokens=12, temperature=0.0)
    assert auto.choices[0].message.content == choice.message.content


@pytest.mark.parametrize(
    ("fields", "param", "match"),
    [
        (
            {"tool_choice": {"type": "function", "function": {"name": "add"}}},
            "tool_choice",
            "needs 'tools'",
        ),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "'nope', which is not in 'tools'",
        ),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
            "You can only either use constraints for structured outputs or tools, not both.",
        ),
        (
            {
                "tools": TOOLS,
                "tool_choice": {"type": "function", "function": {"name": "add"}},
                "extra_body": {"structured_outputs": {"regex": "[a-z]+"}},
            },
            "structured_outputs",
            "You can only either use constraints for structured outputs or tools, not both.",
        ),
    ],
)
def test_refused_tool_requests(
    client: openai.OpenAI, fields: dict[str, Any], param: str, match: str
) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        _create(client, **fields)
    body: Any = e.value.body
    assert body["param"] == param and match in body["message"], body


def test_a_tool_result_round_trip_is_rendered(
    client: openai.OpenAI, tools_gateway: Gateway
) -> None:
    choice: Any = {"type": "function", "function": {"name": "add"}}
    first = _create(client, tools=TOOLS, tool_choice=choice, temperature=0.0)
    call = first.choices[0].message.tool_calls[0]
    history: Any = [
        *MESSAGES,
        first.choices[0].message.model_dump(exclude_none=True),  # content None: left out
        {"role": "tool", "tool_call_id": call.id, "name": call.function.name, "content": "22 C"},
    ]
    r = httpx.post(
        f"{tools_gateway.url}/tokenize",
        json={"model": MODEL, "messages": history, "tools": TOOLS},
        headers=tools_gateway.headers,
    )
    assert r.status_code == 200, r.text
    text = httpx.post(
        f"{tools_gateway.url}/detokenize",
        json={"model": MODEL, "tokens": r.json()["tokens"]},
        headers=tools_gateway.headers,
    ).json()["prompt"]
    arguments = json.dumps(json.loads(call.function.arguments), ensure_ascii=False)  # tojson
    assert f'{{"name": "{call.function.name}", "arguments": {arguments}}}' in text
    assert "<tool_response>\n22 C\n</tool_response>" in text
    assert '"name": "get_weather"' in text  # the tool definitions

    answer = _create(client, messages=history, tools=TOOLS, max_tokens=8, temperature=0.0)
    assert answer.choices[0].message.content
    assert answer.usage is not None and answer.usage.prompt_tokens == r.json()["count"]
