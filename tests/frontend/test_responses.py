"""POST /v1/responses end to end, with the ``openai`` SDK unchanged, against the scripted engine:
create (string and list input, instructions), the SDK's ``responses.stream`` helper reaching its
final response, retrieve / delete / input_items, a ``previous_response_id`` chain, a function-call
round trip, structured output, max_output_tokens, reasoning items, and a client that leaves."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pydantic
import pytest
from tokenizers import Tokenizer as HFTokenizer

from tests.frontend.fake_engine import MODEL_NAME, FakeEngine
from tests.frontend.harness import GatewayServer, wait_for
from tests.frontend.helpers_chat import (
    hf_tokenizer_of,
    lazy_gateways,
    openai_client,
    prompt_text,
    qwen_tokenizer_dir,
    script,
    serve_engine,
)

pytestmark = pytest.mark.timeout(60)

# A reduced Qwen-style template that shows everything a Responses call gives it: the reasoning
# effort, tools, an assistant's reasoning and calls (arguments written back with tojson, so they
# must arrive as objects), tool results.
TEMPLATE = """\
{%- if reasoning_effort is defined %}
<|im_start|>system
Reasoning: {{ reasoning_effort }}<|im_end|>
{% endif %}
{%- if tools %}
<|im_start|>system
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "tool" %}
<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% elif message.role == "assistant" %}
<|im_start|>assistant
{% if message.reasoning_content %}<think>{{ message.reasoning_content }}</think>
{% endif %}
{{ message.content }}
{%- for call in message.tool_calls or [] %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% else %}
<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""

ANSWER = "The answer is forty-two."
WEATHER: Any = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
SCHEMA: Any = {
    "type": "object",
    "properties": {"answer": {"type": "integer"}},
    "required": ["answer"],
    "additionalProperties": False,
}


# -- fixtures: a vocabulary with think tags (plain tokens) and tool-call tags (special ones) ----


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return qwen_tokenizer_dir(tmp_path_factory, "responses_tokenizer", TEMPLATE, think=True)


@pytest.fixture(scope="module")
def hf_tok(tokenizer_dir: Path) -> HFTokenizer:
    return hf_tokenizer_of(tokenizer_dir)


@pytest.fixture(scope="module")
def engine(tokenizer_dir: Path, hf_tok: HFTokenizer) -> Iterator[FakeEngine]:
    yield from serve_engine(tokenizer_dir, hf_tok, step_s=0.001)


Flags = tuple[tuple[str, Any], ...]  # GatewayServer config fields


@pytest.fixture(scope="module")
def gateways(engine: FakeEngine) -> Iterator[dict[Flags, GatewayServer]]:
    """A gateway per set of flags, started when first used."""
    yield from lazy_gateways(engine, dict)


PLAIN: Flags = ()
HERMES: Flags = (("tool_call_parser", "hermes"), ("enable_auto_tool_choice", True))
QWEN3: Flags = (("reasoning_parser", "qwen3"),)
BOTH: Flags = (*HERMES, *QWEN3)


def client_of(gateways: dict[Flags, GatewayServer], flags: Flags = PLAIN) -> openai.OpenAI:
    return openai_client(gateways[flags])


def create(client: openai.OpenAI, **fields: Any) -> Any:
    return client.responses.create(model=MODEL_NAME, **fields)


def events_of(client: openai.OpenAI, **fields: Any) -> tuple[list[Any], Any]:
    """Every event of the SDK's stream helper, and its final response."""
    with client.responses.stream(model=MODEL_NAME, **fields) as stream:
        events = list(stream)
        final = stream.get_final_response()
    return events, final


def shape(output: list[Any]) -> list[tuple[Any, ...]]:
    """The output items without their random ids."""
    out: list[tuple[Any, ...]] = []
    for item in output:
        if item.type == "message":
            texts = [(c.type, c.text, c.annotations) for c in item.content]
            out.append(("message", item.role, item.status, texts))
        elif item.type == "function_call":
            out.append(("function_call", item.name, json.loads(item.arguments), item.status))
        else:
            out.append(("reasoning", [(c.type, c.text) for c in item.content], item.status))
    return out


# -- create --------------------------------------------------------------------------------------


def test_string_input_with_instructions(
    gateways: dict[Flags, GatewayServer], engine: FakeEngine, hf_tok: HFTokenizer
) -> None:
    ids = script(engine, hf_tok, ANSWER)
    r = create(client_of(gateways), input="What is the answer?", instructions="Be brief.")
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL_NAME
    assert (r.status, r.error, r.incomplete_details) == ("completed", None, None)
    assert r.output_text == ANSWER
    assert shape(r.output) == [("message", "assistant", "completed", [("output_text", ANSWER, [])])]
    assert r.output[0].id.startswith("msg_")
    prompt = prompt_text(engine, hf_tok, r.id)
    assert prompt.index("<|im_start|>system\nBe brief.<|im_end|>") < prompt.index(
        "<|im_start|>user\nWhat is the answer?<|im_end|>"
    )
    num_prompt = len(engine.add_messages[f"{r.id}-0"].prompt_token_ids)
    assert r.usage is not None
    assert (r.usage.input_tokens, r.usage.output_tokens) == (num_prompt, len(ids) + 1)  # + EOS
    assert r.usage.total_tokens == num_prompt + len(ids) + 1
    assert r.usage.input_tokens_details.cached_tokens == 0
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    assert (r.instructions, r.store, r.tools, r.tool_choice) == ("Be brief.", True, [], "none")


def test_list_input_of_messages_and_parts(
    gateways: dict[Flags, GatewayServer], engine: FakeEngine, hf_tok: HFTokenizer
) -> None:
    script(engine, hf_tok, ANSWER)
    items: Any = [
        {"role": "developer", "content": "Answer in English."},
        {
            "role": "user",
            "content": [
                {"type": "input_text", "text": "Part one."},
                {"type": "input_text", "text": "Part two."},
            ],
        },
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Hm?"}],
        },
        {"type": "message", "role": "user", "content": "Go on."},
    ]
    r = create(client_of(gateways), input=items)
    assert r.output_text == ANSWER
    prompt = prompt_text(engine, hf_tok, r.id)
    turns = [
        "<|im_start|>system\nAnswer in English.<|im_end|>",  # developer: the system role
        "<|im_start|>user\nPart one.\nPart two.<|im_end|>",
        "<|im_start|>assistant\nHm?<|im_end|>",
        "<|im_start|>user\nGo on.<|im_end|>",
    ]
    at = [prompt.index(t) for t in turns]
    assert at == sorted(at)


def test_sampling_fields_reach_the_engine_and_are_echoed(
    gateways: dict[Flags, GatewayServer], engine: FakeEngine, hf_tok: HFTokenizer
) -> None:
    script(engine, hf_tok, ANSWER)
    r = create(
        client_of(gateways),
        input="Hi",
        temperature=0.5,
        top_p=0.25,
        max_output_tokens=100,
        metadata={"trace": "t-1"},
        user="u-7",
        parallel_tool_calls=False,
    )
    params = engine.add_messages[f"{r.id}-0"].sampling_params
    assert (params.temperature, params.top_p, params.max_tokens) == (0.5, 0.25, 100)
    assert not params.HasField("structured_output")
    assert (r.temperature, r.top_p, r.max_output_tokens) == (0.5, 0.25, 100)
    assert (r.metadata, r.user, r.parallel_tool_calls) == ({"trace": "t-1"}, "u-7", False)
    assert r.text is not None and r.text.format is not None and r.text.format.type == "text"


# -- streaming -----------------------------------------------------------------------------------


def test_stream_helper_reaches_the_final_response(
    gateways: dict[Flags, GatewayServer], engine: FakeEngine, hf_tok: HFTokenizer
) -> None:
    ids = script(engine, hf_tok, ANSWER)
    client = client_of(gateways)
    events, final = events_of(client, input="What is the answer?")
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) == len(kinds) - 8 > 1  # streamed as it came
    assert "".join(d.delta for d in deltas) == ANSWER
    assert [e.sequence_number for e in events] == list(range(len(events)))
    item_id = events[2].item.id
    assert all((d.item_id, d.output_index, d.content_index) == (item_id, 0, 0) for d in deltas)
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert final.id == events[0].response.id and final.status == "completed"
    assert final.output_text == ANSWER and final.output[0].id == item_id
    assert final.usage is not None and final.usage.output_tokens == len(ids) + 1
    stored = client.responses.retrieve(final.id)  # kept before its last event
    assert stored.model_dump(exclude={"output"}) == final.model_dump(exclude={"output"})
    assert shape(stored.output) == shape(final.output) and stored.output[0].id == item_id


def test_stream_framing_names_each_event(gateways: dict[Flags, GatewayServer]) -> None:
    body = {"model": MODEL_NAME, "input": "Hi", "stream": True, "max_output_tokens": 3}
    url = f"{gateways[PLAIN].url}/v1/responses"
    with httpx.stream("POST", url, json=body, timeout=10) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        blocks = r.read().decode().strip().split("\n\n")
    for block in blocks:
        event, data = block.split("\n")
        payload = json.loads(data.removeprefix("data: "))
        assert event == f"event: {payload['type']}"
    assert json.loads(blocks[-1].split("\n")[1][6:])["type"] == "response.incomplete"
    assert "[DONE]" not in blocks[-1]


# -- the store -----------------------------------------------------------------------------------


def test_retrieve_delete_and_input_items(
    gateways: dict[Flags, GatewayServer], engine: FakeEngine, hf_tok: HFTokenizer
) -> None:
    script(engine, hf_tok, ANSWER)
    client = client_of(gateways)
    items: Any = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "One."},
        {"role": "user", "content": [{"type": "input_text", "text": "Two."}]},
    ]
    r = create(client, input=items, metadata={"k": "v"})
    got = client.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump()
    listed = client.responses.input_items.list(r.id)
    texts = [item.content[0].text for item in listed.data]
    assert texts == ["Two.", "One.", "Be brief."]  # newest first, as OpenAI lists them
    assert all(item.id.startswith("msg_") and item.type == "message" for item in listed.data)
    page = client.responses.input_items.list(r.id, order="asc", limit=2)
    assert [i.content[0].text for i in page.data] == ["Be brief.", "One."] and page.has_more
    rest = client.responses.input_items.list(r.id, order="asc", after=page.data[-1].id)
    assert [i.content[0].text for i in rest.data] == ["Two."] and not rest.has_more
    every = list(client.responses.input_items.list(r.id, order="asc", limit=1))  # paginated
    assert [i.content[0].text for i in every] == ["Be brief.", "One.", "Two."]
    client.responses.delete(r.id)
    for call in (
        lambda: client.responses.retrieve(r.id),
        lambda: client.responses.delete(r.id),
        lambda: client.responses.input_items.list(r.id),
    ):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert e.value.body["param"] == "response_id"  # type: ignore[index]


def test_store_false_keeps_nothing(
    gateways: dict[Flags, GatewayServer], engine: FakeEngine, hf_tok: HFTokenizer
) -> None:
    script(engine, hf_tok, ANSWER)
    client = client_of(gateways)
    r = create(client, input="Hi", store=False)
    assert r.store is False and r.output_text == ANSWER
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError) as e:
        create(client, input="Again", previous_response_id=r.id)
    assert e.value.body["code"] == "previous_response_not_found"  # type: ignore[index]


def test_previous_response_id_continues_the_conversation(
    gateways: dict[Flags, GatewayServer], engine: FakeEngine, hf_tok: HFTokenizer
) -> None:
    client = client_of(gateways)
    script(engine, hf_tok, "First answer.")
    r1 = create(client, input="First question.", instructions="Only the first time.")
    script(engine, hf_tok, "Second answer.")
    r2 = create(client, input="Second question.", previous_response_id=r1.id)
    assert r2.previous_response_id == r1.id and r2.output_text == "Second answer."
    prompt = prompt_text(engine, hf_tok, r2.id)
    turns = [
        "<|im_start|>user\nFirst question.<|im_end|>",
        "<|im_start|>assistant\nFirst answer.<|im_end|>",
        "<|im_start|>user\nSecond question.<|im_end|>",
    ]
    at = [prompt.index(t) for t in turns]
    assert at == sorted(at)
    assert "Only the first time." not in prompt  # instructions are not carried on
    assert r1.usage is not None and r2.usage is not None
    assert r2.usage.input_tokens > r1.usage.input_tokens + r1.usage.output_tokens - 10
    script(engine, hf_tok, "Third answer.")
    r3 = create(client, input="Third question.", previous_response_id=r2.id, stream=True)
    final = [e for e in r3 if e.type == "response.completed"][0].response
    third = prompt_text(engine, hf_tok, final.id)
    assert third.startswith(prompt.removesuffix("<|im_start|>assistant\n"))
    assert "Second answer.<|im_end|>" in third and "Third question." in third
    # input_items lists the call's own input, not the conversation's
    assert [i.content[0].text for i in client.responses.input_items.list(r2.id)] == [
        "Second question."
    ]


# -- tools ---------------------------------------------------------------------------------------


def test_function_call_round_trip(
    gateways: dict[Flags, GatewayServer], engine: FakeEngine, hf_tok: HFTokenizer
) -> None:
    client = client_of(gateways, HERMES)
    script(engine, hf_tok, "Let me check.\n" + HERMES_CALL)
    r = create(client, input="Weather in Paris?", tools=[WEATHER])
    expected = [
        ("message", "assistant", "completed", [("output_text", "Let me check.", [])]),
        ("function_call", "get_weather", {"city": "Paris"}, "completed"),
    ]
    assert shape(r.output) == expected and r.status == "completed"
    call = r.output[1]
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    assert r.tools[0].name == "get_weather" and r.tool_choice == "auto"
    events, final = events_of(client, input="Weather in Paris?", tools=[WEATHER])
    assert shape(final.output) == expected
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(pieces) > 1 and json.loads("".join(pieces)) == {"city": "Paris"}
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [json.loads(d.arguments) for d in done] == [{"city": "Paris"}]
    assert final.output[1].parsed_arguments is None  # not strict: the SDK leaves them

    script(engine, hf_tok, "It is sunny.")
    result: Any = {"type": "function_call_output", "call_id": call.call_id, "output": "22 C"}
    chained = create(client, previous_response_id=r.id, input=[result], tools=[WEATHER])
    assert chained.output_text == "It is sunny."
    prompt = prompt_text(engine, hf_tok, chained.id)
    assert (
        "<|im_start|>assistant\nLet me check.<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'
    ) in prompt
    assert "<tool_response>\n22 C\n</tool_response>" in prompt
    # The same conversation sent back whole (the SDK's `input += response.output`) renders the
    # same prompt.
    replay: Any = [
        {"role": "user", "content": "Weather in Paris?"},
        *[item.model_dump(exclude_none=True) for item in r.output],
        result,
    ]
    stateless = create(client, input=replay, tools=[WEATHER], store=False)
    assert stateless.output_text == "It is sunny."
    assert (
        engine.add_messages[f"{stateless.id}-0"].prompt_token_ids
        == engine.add_messages[f"{chained.id}-0"].prompt_token_ids
    )


def test_named_and_required_tool_choices_constrain_the_output(
    gateways: dict[Flags, GatewayServer], engine: FakeEngine, hf_tok: HFTokenizer
) -> None:
    client = client_of(gateways)  # no tool parser needed: the output is the calls' JSON
    script(engine, hf_tok, '{"city": "Oslo"}')
    choice: Any = {"type": "function", "name": "get_weather"}
    r = create(client, input="Weather?", tools=[WEATHER], tool_choice=choice)
    assert shape(r.output) == [("function_call", "get_weather", {"city": "Oslo"}, "completed")]
    constraint = engine.add_messages[f"{r.id}-0"].sampling_params.structured_output
    assert json.loads(constraint.json_schema) == WEATHER["parameters"]
    assert r.tool_choice.type == "function" and r.tool_choice.name == "get_weather"
    script(engine, hf_tok, '[{"name": "get_weather", "parameters": {"city": "Rome"}}]')
    events, final = events_of(client, input="Weather?", tools=[WEATHER], tool_choice="required")
    assert shape(final.output) == [("function_call", "get_weather", {"city": "Rome"}, "completed")]
    schema = json.loads(
        engine.add_messages[f"{final.id}-0"].sampling_params.structured_output.json_schema
    )
    assert schema["type"] == "array" and schema["minItems"] == 1


# -- structured output ---------------------------------------------------------------------------


def test_text_format_json_schema_reaches_the_engine(
    gateways: dict[Flags, GatewayServer], engine: FakeEngine, hf_tok: HFTokenizer
) -> None:
    client = client_of(gateways)
    script(engine, hf_tok, '{"answer": 42}')
    fmt: Any = {"type": "json_schema", "name": "answer", "schema": SCHEMA, "strict": True}
    r = create(client, input="The answer?", text={"format": fmt})
    constraint = engine.add_messages[f"{r.id}-0"].sampling_params.structured_output
    assert constraint.WhichOneof("kind") == "json_schema"
    assert json.loads(constraint.json_schema) == SCHEMA
    assert json.loads(r.output_text) == {"answer": 42}
    assert r.text.format.type == "json_schema" and r.text.format.name == "answer"
    r = create(client, input="Any JSON.", text={"format": {"type": "json_object"}})
    constraint = engine.add_messages[f"{r.id}-0"].sampling_params.structured_output
    assert constraint.WhichOneof("kind") == "json_object" and constraint.json_object

    class Answer(pydantic.BaseModel):
        answer: int

    parsed = client.responses.parse(model=MODEL_NAME, input="The answer?", text_format=Answer)
    assert parsed.output_parsed == Answer(answer=42)
    constraint = engine.add_messages[f"{parsed.id}-0"].sampling_params.structured_output
    assert json.loads(constraint.json_schema)["properties"] == {
        "answer": {"title": "Answer", "type": "integer"}
    }


# -- cut off -------------------------------------------------------------------------------------


def test_max_output_tokens_leaves_the_response_incomplete(
    gateways: dict[Flags, GatewayServer], engine: FakeEngine, hf_tok: HFTokenizer
) -> None:
    ids = script(engine, hf_tok, ANSWER)
    client = client_of(gateways)
    r = create(client, input="Hi", max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details is not None
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].status == "incomplete"
    assert r.output_text == hf_tok.decode(ids[:3])
    assert r.usage is not None and r.usage.output_tokens == 3
    events = list(create(client, input="Hi", max_output_tokens=3, stream=True))
    last = events[-1]
    assert last.type == "response.incomplete" and last.response.status == "incomplete"
    assert last.response.incomplete_details.reason == "max_output_tokens"
    assert last.response.output[0].status == "incomplete"
    assert client.responses.retrieve(last.response.id).status == "incomplete"


# -- reasoning -----------------------------------------------------------------------------------


def test_reasoning_becomes_a_reasoning_item(
    gateways: dict[Flags, GatewayServer], engine: FakeEngine, hf_tok: HFTokenizer
) -> None:
    thought = "The user greets me."
    ids = script(engine, hf_tok, f"<think>{thought}</think>Hello world!")
    client = client_of(gateways, QWEN3)
    expected = [
        ("reasoning", [("reasoning_text", thought)], "completed"),
        ("message", "assistant", "completed", [("output_text", "Hello world!", [])]),
    ]
    r = create(client, input="Hi", reasoning={"effort": "high"})
    assert shape(r.output) == expected and r.output[0].id.startswith("rs_")
    end = ids.index(hf_tok.token_to_id("</think>"))
    assert r.usage is not None and r.usage.output_tokens_details.reasoning_tokens == end - 1
    assert r.reasoning is not None and r.reasoning.effort == "high"
    assert "<|im_start|>system\nReasoning: high<|im_end|>" in prompt_text(engine, hf_tok, r.id)
    events, final = events_of(client, input="Hi")
    assert shape(final.output) == expected
    pieces = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert len(pieces) > 1 and "".join(pieces) == thought
    assert final.usage is not None and final.usage.output_tokens_details.reasoning_tokens == end - 1
    # A next turn shows the reasoning again (the template's reasoning_content).
    script(engine, hf_tok, "Bye.")
    nxt = create(client, input="Bye?", previous_response_id=r.id)
    assert f"<think>{thought}</think>\nHello world!<|im_end|>" in prompt_text(
        engine, hf_tok, nxt.id
    )


def test_reasoning_then_a_call(
    gateways: dict[Flags, GatewayServer], engine: FakeEngine, hf_tok: HFTokenizer
) -> None:
    script(engine, hf_tok, f"<think>I need the weather.</think>\n\n{HERMES_CALL}")
    client = client_of(gateways, BOTH)
    expected = [
        ("reasoning", [("reasoning_text", "I need the weather.")], "completed"),
        ("function_call", "get_weather", {"city": "Paris"}, "completed"),  # no empty message
    ]
    assert shape(create(client, input="Weather?", tools=[WEATHER]).output) == expected
    assert shape(events_of(client, input="Weather?", tools=[WEATHER])[1].output) == expected


# -- a client that leaves ------------------------------------------------------------------------


def test_a_client_leaving_a_stream_aborts_the_engine_request(
    gateways: dict[Flags, GatewayServer], engine: FakeEngine, hf_tok: HFTokenizer
) -> None:
    script(engine, hf_tok, ANSWER + " ", eos=False)  # never ends by itself
    body = {"model": MODEL_NAME, "input": "Hi", "stream": True}
    url = f"{gateways[PLAIN].url}/v1/responses"
    with httpx.stream("POST", url, json=body, timeout=10) as r:
        lines = r.iter_lines()
        created = json.loads(next(line for line in lines if line.startswith("data: "))[6:])
        next(line for line in lines if "response.output_text.delta" in line)
    request_id = f"{created['response']['id']}-0"
    wait_for(lambda: request_id in engine.aborted, 5, "the engine's abort")
    with pytest.raises(openai.NotFoundError):  # never finished: never stored
        client_of(gateways).responses.retrieve(created["response"]["id"])


def test_a_client_leaving_a_whole_response_aborts_it(
    gateways: dict[Flags, GatewayServer], engine: FakeEngine, hf_tok: HFTokenizer
) -> None:
    script(engine, hf_tok, ANSWER + " ", eos=False)
    before = len(engine.aborted)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{gateways[PLAIN].url}/v1/responses",
            json={"model": MODEL_NAME, "input": "Hi"},
            timeout=0.3,
        )
    wait_for(lambda: len(engine.aborted) == before + 1, 5, "the abort")
    assert engine.aborted[-1].startswith("resp_")
