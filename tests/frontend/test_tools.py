"""The tool fields of a chat request as ``parse_chat`` reads them into ``ToolOptions``: what the
chat template gets, the choices, the 400s the request-model tests do not already cover, the
schema that structured outputs enforce for required/named choices, and how such output becomes
calls. (The other 400s of the tool fields: tests/frontend/test_request_models.py.)"""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from frontend_svc.errors import ApiError
from frontend_svc.protocol import parse_chat
from frontend_svc.protocol.tools import FunctionTool, ToolOptions
from frontend_svc.tool_parsers import (
    NamedFunctionParser,
    RequiredCallsParser,
    get_tool_parser,
)

pytestmark = pytest.mark.timeout(30)

USER: list[dict[str, Any]] = [{"role": "user", "content": "Hi"}]
WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
        "strict": True,
    },
}
TIME: dict[str, Any] = {"type": "function", "function": {"name": "get_time"}}


def parse(fields: dict[str, Any], auto_tools: bool = True) -> ToolOptions:
    """The tool options of a chat request with ``fields`` (``auto_tools``: the server has a
    tool-call parser)."""
    return parse_chat({"model": "m", "messages": USER, **fields}, 5, auto_tools).tools


def rejected(fields: dict[str, Any], param: str, match: str, auto_tools: bool = True) -> None:
    with pytest.raises(ApiError) as e:
        parse(fields, auto_tools)
    assert e.value.status == 400 and e.value.param == param
    assert e.value.type == "invalid_request_error"
    assert match in e.value.message, e.value.message


def test_tools_are_read_and_given_to_the_template_as_sent() -> None:
    options = parse({"tools": [WEATHER, TIME]})
    assert options.choice == "auto" and options.parallel_tool_calls
    weather = options.tools[0]
    assert weather == FunctionTool(
        "get_weather",
        "Current weather in a city.",
        WEATHER["function"]["parameters"],
        True,
    )
    assert options.template_tools() == [WEATHER, TIME]


def test_defaults_without_tools() -> None:
    bodies: list[dict[str, Any]] = [{}, {"tools": None}, {"tool_choice": "none"}, {"tools": []}]
    for body in bodies:
        options = parse(body)
        assert options.choice == "none" and options.template_tools() is None
        assert options.json_schema() is None and options.output_parser(None) is None


def test_choices() -> None:
    # Named choices, "tools": [] with "auto", parallel_tool_calls: test_request_models.
    none = parse({"tools": [WEATHER], "tool_choice": "none"})
    assert none.choice == "none" and none.template_tools() == [WEATHER]  # rendered all the same
    assert parse({"tools": [WEATHER], "tool_choice": "auto"}).choice == "auto"
    assert parse({"tools": [WEATHER], "tool_choice": "required"}).choice == "required"


# Only what test_request_models.TOOL_ERRORS does not check case for case.
@pytest.mark.parametrize(
    ("fields", "param", "match"),
    [
        ({"tools": [{"function": {"name": "a.b"}}]}, "tools", "1 to 64 characters"),
        ({"tools": [TIME, WEATHER, TIME]}, "tools", "'tools' has two functions named 'get_time'."),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "'tool_choice' names the function 'nope', which is not in 'tools'.",
        ),
    ],
)
def test_invalid_fields_are_400s_naming_the_parameter(
    fields: dict[str, Any], param: str, match: str
) -> None:
    rejected(fields, param, match)


def test_an_explicit_auto_needs_a_parser_on_the_server() -> None:
    # The default "auto", and "required"/"none" without a parser: test_request_models.
    rejected({"tools": [TIME], "tool_choice": "auto"}, "tool_choice", "--tool-call-parser", False)


def test_named_choice_enforces_that_functions_parameters() -> None:
    tools = [WEATHER, TIME]
    named = parse(
        {"tools": tools, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    )
    parameters = copy.deepcopy(WEATHER["function"]["parameters"])
    schema = named.json_schema()
    assert schema == parameters
    assert schema is not None
    schema["properties"].clear()  # a copy: the tool's (and the request's) stay as they were
    assert named.tools[0].parameters == parameters == WEATHER["function"]["parameters"]
    assert named.json_schema() == parameters
    no_params = parse(
        {"tools": tools, "tool_choice": {"type": "function", "function": {"name": "get_time"}}}
    )
    assert no_params.json_schema() == {"type": "object", "properties": {}}


def test_required_schema_as_vllm_builds_it() -> None:
    options = parse({"tools": [WEATHER, TIME], "tool_choice": "required"})
    assert options.json_schema() == {
        "type": "array",
        "minItems": 1,
        "items": {
            "type": "object",
            "anyOf": [
                {
                    "properties": {
                        "name": {"type": "string", "enum": ["get_weather"]},
                        "parameters": WEATHER["function"]["parameters"],
                    },
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                },
                {
                    "properties": {
                        "name": {"type": "string", "enum": ["get_time"]},
                        "parameters": {"type": "object", "properties": {}},
                    },
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                },
            ],
        },
    }
    single = parse({"tools": [TIME], "tool_choice": "required", "parallel_tool_calls": False})
    assert (single.json_schema() or {})["maxItems"] == 1


def _tool_with_defs(name: str, defs: dict[str, Any], key: str = "$defs") -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "parameters": {
                "type": "object",
                "properties": {"where": {"$ref": f"#/{key}/Place"}},
                key: defs,
            },
        },
    }


def test_required_schema_hoists_definitions_to_the_root() -> None:
    place = {"type": "object", "properties": {"city": {"type": "string"}}}
    tools = [_tool_with_defs("a", {"Place": place}), _tool_with_defs("b", {"Place": place})]
    before = copy.deepcopy(tools)
    schema = parse({"tools": tools, "tool_choice": "required"}).json_schema()
    assert schema is not None and schema["$defs"] == {"Place": place}
    for branch in schema["items"]["anyOf"]:
        assert "$defs" not in branch["properties"]["parameters"]
    assert tools == before  # the request is not changed
    old_style = parse(
        {
            "tools": [_tool_with_defs("c", {"Place": place}, "definitions")],
            "tool_choice": "required",
        }
    ).json_schema()
    assert old_style is not None and old_style["definitions"] == {"Place": place}

    other = {"type": "string"}
    conflicting = [_tool_with_defs("a", {"Place": place}), _tool_with_defs("b", {"Place": other})]
    rejected({"tools": conflicting, "tool_choice": "required"}, "tools", "'$defs/Place'")


def test_required_schema_accepts_what_the_parser_reads() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    place = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    tools = [WEATHER, TIME, _tool_with_defs("go", {"Place": place})]
    schema = parse({"tools": tools, "tool_choice": "required"}).json_schema()
    output = (
        '[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}, '
        '{"name": "get_time", "parameters": {}}, '
        '{"name": "go", "parameters": {"where": {"city": "Oslo"}}}]'
    )
    jsonschema.validate(json.loads(output), schema)
    for bad in [
        "[]",
        '[{"name": "nope", "parameters": {}}]',
        '[{"name": "get_weather", "parameters": {"unit": "celsius"}}]',
        '[{"name": "go", "parameters": {"where": {"town": "Oslo"}}}]',
    ]:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(json.loads(bad), schema)
    single = parse({"tools": tools, "tool_choice": "required", "parallel_tool_calls": False})
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(json.loads(output), single.json_schema())

    parser = parse({"tools": tools, "tool_choice": "required"}).output_parser(None)
    assert isinstance(parser, RequiredCallsParser)
    result = parser.extract(output)
    assert result.content is None
    assert [(c.name, json.loads(c.arguments)) for c in result.calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}),
        ("get_time", {}),
        ("go", {"where": {"city": "Oslo"}}),
    ]


def test_output_parsers_per_choice() -> None:
    hermes = get_tool_parser("hermes")
    assert parse({"tools": [TIME]}).output_parser(hermes) is hermes
    assert parse({"tools": [TIME], "tool_choice": "none"}).output_parser(hermes) is None
    named = parse(
        {"tools": [TIME], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}
    )
    parser = named.output_parser(hermes)
    assert isinstance(parser, NamedFunctionParser)
    result = parser.extract('{"tz": "UTC"}')
    assert result.content is None
    assert [(c.name, c.arguments) for c in result.calls] == [("get_time", '{"tz": "UTC"}')]
