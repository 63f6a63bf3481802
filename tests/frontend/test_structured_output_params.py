"""The gateway's structured-output fields: every spelling parsed to one constraint, malformed ones
refused with a 400 naming the field, the constraint on the wire, and the engine's refusal named."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from frontend_svc.engine.errors import EngineRequestError
from frontend_svc.errors import ApiError
from frontend_svc.generation.structured_errors import name_constraint_errors
from frontend_svc.protocol import parse_chat, parse_completion
from protos.convert import request_to_pb
from protos.types import EngineErrorCode, EngineRequest, StructuredOutput

SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
SCHEMA_TEXT = json.dumps(SCHEMA, separators=(",", ":"))  # key order kept: it is generation order


def _chat(**fields: Any) -> Any:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return parse_chat(body, 20).sampling


def _completion(**fields: Any) -> Any:
    return parse_completion({"model": "m", "prompt": "hi", **fields}, 20).sampling


@pytest.mark.parametrize("parse", [_chat, _completion], ids=["chat", "completions"])
@pytest.mark.parametrize(
    ("fields", "expected", "param"),
    [
        ({"response_format": {"type": "text"}}, None, None),
        ({"response_format": {}}, None, None),
        (
            {"response_format": {"type": "json_object"}},
            StructuredOutput("json_object"),
            "response_format",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": SCHEMA, "strict": True},
                }
            },
            StructuredOutput("json_schema", SCHEMA_TEXT),
            "response_format",
        ),
        (
            {"structured_outputs": {"json": SCHEMA}},
            StructuredOutput("json_schema", SCHEMA_TEXT),
            "structured_outputs",
        ),
        (
            {"structured_outputs": {"json": json.dumps(SCHEMA)}},
            StructuredOutput("json_schema", SCHEMA_TEXT),
            "structured_outputs",
        ),
        (
            {"structured_outputs": {"regex": "[a-z]+", "json_object": False}},
            StructuredOutput("regex", "[a-z]+"),
            "structured_outputs",
        ),
        (
            {"structured_outputs": {"choice": ["a", "b"]}},
            StructuredOutput("choice", choices=("a", "b")),
            "structured_outputs",
        ),
        (
            {"structured_outputs": {"grammar": 'root ::= "a"'}},
            StructuredOutput("grammar", 'root ::= "a"'),
            "structured_outputs",
        ),
        (
            {"structured_outputs": {"json_object": True, "disable_any_whitespace": True}},
            StructuredOutput("json_object"),
            "structured_outputs",
        ),
        ({"guided_json": SCHEMA}, StructuredOutput("json_schema", SCHEMA_TEXT), "guided_json"),
        ({"guided_regex": "x+"}, StructuredOutput("regex", "x+"), "guided_regex"),
        (
            {"guided_choice": ["y", "n"]},
            StructuredOutput("choice", choices=("y", "n")),
            "guided_choice",
        ),
        ({"guided_grammar": "g"}, StructuredOutput("grammar", "g"), "guided_grammar"),
        (
            {"response_format": {"type": "text"}, "guided_regex": "x+"},
            StructuredOutput("regex", "x+"),
            "guided_regex",
        ),
    ],
)
def test_every_spelling_gives_one_constraint(
    parse: Any, fields: dict[str, Any], expected: StructuredOutput | None, param: str | None
) -> None:
    sampling = parse(**fields)
    assert sampling.engine.structured_output == expected
    assert sampling.structured_output_param == param
    assert sampling.engine_params(16, 0).structured_output == expected


def test_no_constraint_by_default() -> None:
    assert _chat().engine.structured_output is None
    assert _completion().engine.structured_output is None


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        ({"response_format": "json"}, "response_format", "must be an object"),
        ({"response_format": {"type": "xml"}}, "response_format", "'response_format.type'"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema'"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format",
            "'response_format.json_schema.schema' is required",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}},
            "response_format",
            "must be a JSON Schema object",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": 3, "schema": {}}}},
            "response_format",
            "'response_format.json_schema.name' must be a string",
        ),
        ({"structured_outputs": []}, "structured_outputs", "must be an object"),
        ({"structured_outputs": {}}, "structured_outputs", "must set one of"),
        ({"structured_outputs": {"regex": 5}}, "structured_outputs", "'structured_outputs.regex'"),
        ({"structured_outputs": {"grammar": ""}}, "structured_outputs", "non-empty string"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs", "non-empty list"),
        ({"structured_outputs": {"choice": ["a", 2]}}, "structured_outputs", "list of strings"),
        ({"structured_outputs": {"json": "{nope"}}, "structured_outputs", "not valid JSON"),
        ({"structured_outputs": {"json": "[1]"}}, "structured_outputs", "JSON Schema object"),
        ({"structured_outputs": {"json_object": "maybe"}}, "structured_outputs", "boolean"),
        ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs", "not supported"),
        ({"guided_regex": ["a"]}, "guided_regex", "'guided_regex' must be a non-empty string"),
        ({"guided_regex": ""}, "guided_regex", "non-empty string"),
        ({"guided_grammar": "  "}, "guided_grammar", "non-empty string"),
        ({"guided_choice": []}, "guided_choice", "non-empty list of strings"),
        ({"guided_choice": "a"}, "guided_choice", "non-empty list of strings"),
        ({"guided_json": 7}, "guided_json", "JSON Schema object"),
        (
            {"response_format": {"type": "json_object"}, "guided_regex": "a"},
            "guided_regex",
            "at most one structured output constraint; this request has 'response_format', "
            "'guided_regex'",
        ),
        (
            {"structured_outputs": {"regex": "a", "choice": ["a"]}},
            "structured_outputs",
            "'structured_outputs.regex', 'structured_outputs.choice'",
        ),
    ],
)
def test_malformed_constraints_are_400s_naming_the_field(
    fields: dict[str, Any], param: str, message: str
) -> None:
    for parse in (_chat, _completion):
        with pytest.raises(ApiError) as e:
            parse(**fields)
        assert e.value.status == 400 and e.value.param == param
        assert message in e.value.message, e.value.message


@pytest.mark.parametrize(
    ("constraint", "kind", "value"),
    [
        (StructuredOutput("json_schema", SCHEMA_TEXT), "json_schema", SCHEMA_TEXT),
        (StructuredOutput("json_object"), "json_object", True),
        (StructuredOutput("regex", "a+"), "regex", "a+"),
        (StructuredOutput("grammar", 'root ::= "a"'), "grammar", 'root ::= "a"'),
    ],
)
def test_constraint_on_the_wire(constraint: StructuredOutput, kind: str, value: object) -> None:
    params = _chat(temperature=0.5).engine_params(8, 0)
    params = type(params)(**{**params.__dict__, "structured_output": constraint})
    msg = request_to_pb(EngineRequest("r", (1, 2), params)).sampling_params
    assert msg.HasField("structured_output")
    assert msg.structured_output.WhichOneof("kind") == kind
    assert getattr(msg.structured_output, kind) == value


def test_choice_on_the_wire_and_no_constraint() -> None:
    params = _chat(guided_choice=["a", "b c"]).engine_params(8, 0)
    msg = request_to_pb(EngineRequest("r", (1,), params)).sampling_params
    assert list(msg.structured_output.choice.choices) == ["a", "b c"]
    plain = request_to_pb(EngineRequest("r", (1,), _chat().engine_params(8, 0))).sampling_params
    assert not plain.HasField("structured_output")


async def _fails(error: Exception) -> AsyncIterator[int]:
    yield 1
    raise error


def _drain(error: Exception) -> list[int]:
    async def run() -> list[int]:
        return [x async for x in name_constraint_errors(_fails(error), "guided_regex")]

    return asyncio.run(run())


def test_engine_refusal_of_the_constraint_names_the_field() -> None:
    refusal = EngineRequestError(
        EngineErrorCode.INVALID_ARGUMENT,
        "structured_output.regex: Regex parsing error at position 3: The parenthesis is not "
        "closed.",
    )
    with pytest.raises(ApiError) as e:
        _drain(refusal)
    assert e.value.status == 400 and e.value.param == "guided_regex"
    assert e.value.message == (
        "The regular expression in 'guided_regex' cannot be compiled: Regex parsing error at "
        "position 3: The parenthesis is not closed."
    )
    other = EngineRequestError(EngineErrorCode.INVALID_ARGUMENT, "logprobs must be at most 20")
    with pytest.raises(EngineRequestError):
        _drain(other)
    with pytest.raises(EngineRequestError):
        _drain(EngineRequestError(EngineErrorCode.INTERNAL, "structured_output: boom"))
