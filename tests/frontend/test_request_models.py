"""The request models (frontend_svc.protocol): null read as absent, extras ignored, JSON's
number types kept strict, booleans read as vLLM reads them, errors that name the place, 32-bit
float bounds stated exactly, the tool and cross-field rules, and /openapi.json made of the
models' schemas (one table entry per route)."""

from __future__ import annotations

import math
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from frontend_svc.errors import ApiError
from frontend_svc.protocol import parse_chat, parse_completion, parse_detokenize, parse_tokenize
from frontend_svc.protocol.models import ChatBody, CompletionBody
from frontend_svc.server import openapi
from frontend_svc.server.openapi import OPERATIONS, Operation, openapi_schema

pytestmark = pytest.mark.timeout(60)
USER = [{"role": "user", "content": "Hi"}]
TIME: dict[str, Any] = {"type": "function", "function": {"name": "get_time"}}


def completion(**fields: Any) -> Any:
    return parse_completion({"model": "m", "prompt": "Hi", **fields}, 5)


def chat(auto_tools: bool = True, **fields: Any) -> Any:
    return parse_chat({"model": "m", "messages": USER, **fields}, 5, auto_tools)


def refused(parse: Any, **fields: Any) -> ApiError:
    with pytest.raises(ApiError) as e:
        parse(**fields)
    assert e.value.status == 400 and e.value.type == "invalid_request_error"
    assert "pydantic" not in e.value.message and "http" not in e.value.message
    return e.value


def test_null_is_absent_and_extras_are_ignored() -> None:
    every_optional = {
        name: None for name, f in CompletionBody.model_fields.items() if not f.is_required()
    }
    assert len(every_optional) > 30
    assert completion(**every_optional) == completion()
    assert completion(user="x", metadata={"a": 1}, n=None) == completion()
    req = chat(messages=[{"role": "user", "content": None, "name": None, "x-extra": [1]}])
    assert req.messages == ({"role": "user", "content": "", "name": None, "x-extra": [1]},)


@pytest.mark.parametrize(
    ("field", "value", "phrase"),
    [
        ("n", True, "'n' must be an integer."),
        ("n", "2", "'n' must be an integer."),
        ("n", 2.5, "'n' must be an integer."),
        ("max_tokens", [1], "'max_tokens' must be an integer."),
        ("stream", 2, "'stream' must be a boolean."),
        ("stream", "maybe", "'stream' must be a boolean."),
        ("stream", " true", "'stream' must be a boolean."),
        ("stream", 0.5, "'stream' must be a boolean."),
        ("temperature", "0.5", "'temperature' must be a number."),
        ("temperature", False, "'temperature' must be a number."),
        ("echo", None, None),  # null: the default
    ],
)
def test_json_types_are_strict(field: str, value: Any, phrase: str | None) -> None:
    if phrase is None:
        assert completion(**{field: value}).echo is False
        return
    error = refused(completion, **{field: value})
    assert (error.param, error.message) == (field, phrase)


@pytest.mark.parametrize(
    ("value", "read"),
    [
        *((v, True) for v in (True, 1, 1.0, "true", "TRUE", "True", "t", "yes", "Y", "on", "1")),
        *((v, False) for v in (False, 0, 0.0, "false", "F", "no", "N", "off", "OFF", "0")),
    ],
)
def test_booleans_are_read_as_vllm_reads_them(value: Any, read: bool) -> None:
    """pydantic's lax bool, as vLLM's request models have it: "logprobs": "true" is true."""
    assert chat(logprobs=value).logprobs is read
    assert completion(echo=value, max_tokens=1).echo is read
    options = completion(stream=True, stream_options={"include_usage": value}).options
    assert options.include_usage is read


def test_integral_floats_are_integers() -> None:
    req = completion(n=2.0, max_tokens=3.0, seed=7.0, stop_token_ids=[1.0, 2], prompt=[5.0, 6])
    assert (req.sampling.n, req.sampling.engine.max_tokens, req.sampling.engine.seed) == (2, 3, 7)
    assert req.sampling.engine.stop_token_ids == (1, 2) and req.prompts == ((5, 6),)
    assert all(type(t) is int for t in req.sampling.engine.stop_token_ids + req.prompts[0])


def test_an_integer_json_cannot_hold_exactly_is_refused() -> None:
    """orjson reads an integer literal beyond 64 bits as a float: -2**63 - 1 became -2**63 and
    was accepted as a seed in range. A float from 2**53 on may be such a literal: refused, named."""
    body = b'{"model": "m", "prompt": "hi", "seed": -9223372036854775809}'
    with pytest.raises(ApiError) as e:
        parse_completion(orjson.loads(body), 20)
    assert e.value.param == "seed" and "exactly" in e.value.message
    assert completion(seed=-(2**63)).sampling.engine.seed == -(2**63)  # the bound itself: fine
    with pytest.raises(ApiError, match="'max_tokens' must be an integer"):
        completion(max_tokens=2.0**53)
    assert completion(max_tokens=2.0**53 - 1).sampling.engine.max_tokens == 2**53 - 1


@pytest.mark.parametrize(
    ("parse", "fields", "param", "message"),
    [
        (completion, {"n": 0}, "n", "'n' must be in [1, 128], got 0."),
        (completion, {"stop": ["a", 3]}, "stop", "'stop' must be a string or a list of strings."),
        (
            completion,
            {"stream": True, "stream_options": {"include_usage": 2}},
            "stream_options",
            "'stream_options.include_usage' must be a boolean.",
        ),
        (
            chat,
            {"messages": [{"role": ""}]},
            "messages",
            "'messages[0].role' must be a non-empty string.",
        ),
        (chat, {"messages": [{}]}, "messages", "'messages[0].role' is required."),
        (
            chat,
            {"messages": [{"role": "user", "content": 5}]},
            "messages",
            "'messages[0].content' must be a string or a list.",
        ),
        (
            chat,
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages",
            "'messages[0].content[0].type' must be 'text': this model takes no input but text.",
        ),
        (
            chat,
            {"tools": [TIME], "tool_choice": "always"},
            "tool_choice",
            "'tool_choice' must be 'none', 'auto', 'required' or an object.",
        ),
        (
            chat,
            {"tools": [TIME], "tool_choice": {"type": "function", "function": {"name": "a b"}}},
            "tool_choice",
            "'tool_choice.function.name' must be 1 to 64 characters of a-z, A-Z, 0-9, '_' and '-'.",
        ),
        (
            chat,
            {"response_format": {"type": "json_schema", "json_schema": {"schema": "{x"}}},
            "response_format",
            "'response_format.json_schema.schema' is not valid JSON: unexpected character, "
            "expected a string key: line 1 column 2 (char 1).",
        ),
    ],
)
def test_errors_name_the_place(
    parse: Any, fields: dict[str, Any], param: str, message: str
) -> None:
    error = refused(parse, **fields)
    assert (error.param, error.message) == (param, message)


def test_a_body_that_is_not_an_object() -> None:
    for parse in (parse_tokenize, parse_detokenize):
        with pytest.raises(ApiError) as e:
            parse([1, 2])
        assert (
            e.value.message == "The request body must be a JSON object." and e.value.param is None
        )


@pytest.mark.parametrize("model", [CompletionBody, ChatBody])
def test_float32_bounds_in_the_schema_are_the_exact_doubles_accepted(
    model: type[BaseModel],
) -> None:
    """The engine gets 32-bit floats: a bound in the schema is the last double that rounds
    into the range; the next double out is refused."""
    parse = completion if model is CompletionBody else chat
    checked = 0
    for name, prop in model.model_json_schema()["properties"].items():
        number = next((p for p in prop.get("anyOf", [prop]) if p.get("format") == "float"), None)
        if number is None:
            continue
        for bound, outward in ((number["minimum"], -math.inf), (number["maximum"], math.inf)):
            parse(**{name: bound})
            error = refused(parse, **{name: math.nextafter(bound, outward)})
            assert error.param == name and "must be in" in error.message, error.message
            checked += 1
    assert checked == 2 * 6  # temperature, top_p, min_p and the three penalties, both sides


NAMED = {"type": "function", "function": {"name": "get_time"}}
# The rules of tools and tool_choice (those of the hand-written validator before the models).
TOOL_ERRORS: list[tuple[dict[str, Any], str, str]] = [
    ({"tools": {"a": 1}}, "tools", "'tools' must be a list."),
    ({"tools": ["get_weather"]}, "tools", "'tools[0]' must be an object."),
    ({"tools": [{"type": "custom", "function": {"name": "f"}}]}, "tools", "'tools[0].type'"),
    ({"tools": [{"type": "function"}]}, "tools", "'tools[0].function' is required."),
    ({"tools": [{"function": {}}]}, "tools", "'tools[0].function.name' is required."),
    ({"tools": [{"function": {"name": ""}}]}, "tools", "1 to 64 characters"),
    ({"tools": [{"function": {"name": "x" * 65}}]}, "tools", "1 to 64 characters"),
    ({"tools": [{"function": {"name": "get weather"}}]}, "tools", "1 to 64 characters"),
    ({"tools": [{"function": {"name": "météo"}}]}, "tools", "1 to 64 characters"),
    ({"tools": [{"function": {"name": "a\n"}}]}, "tools", "1 to 64 characters"),
    ({"tools": [{"function": {"name": 7}}]}, "tools", "1 to 64 characters"),
    ({"tools": [TIME, TIME]}, "tools", "'tools' has two functions named 'get_time'."),
    ({"tools": [{"function": {"name": "f", "description": 1}}]}, "tools", "description"),
    ({"tools": [{"function": {"name": "f", "parameters": "{}"}}]}, "tools", "parameters"),
    ({"tools": [{"function": {"name": "f", "strict": "strictly"}}]}, "tools", "strict"),
    ({"tools": [TIME], "tool_choice": "always"}, "tool_choice", "must be 'none', 'auto'"),
    ({"tools": [TIME], "tool_choice": 1}, "tool_choice", "must be 'none', 'auto'"),
    ({"tools": [TIME], "tool_choice": {"type": "function"}}, "tool_choice", "function' is req"),
    (
        {"tools": [TIME], "tool_choice": {"type": "allowed_tools", "function": {"name": "x"}}},
        "tool_choice",
        "'tool_choice.type' must be 'function'.",
    ),
    (
        {"tools": [TIME], "tool_choice": {"type": "function", "function": {"name": "a b"}}},
        "tool_choice",
        "'tool_choice.function.name' must be 1 to 64",
    ),
    ({"tool_choice": NAMED}, "tool_choice", "'tool_choice' needs 'tools'."),
    ({"tools": [], "tool_choice": NAMED}, "tool_choice", "'get_time', which is not in 'tools'"),
    ({"tool_choice": "required"}, "tool_choice", "'tool_choice' needs 'tools'."),
    ({"tools": [], "tool_choice": "required"}, "tool_choice", "at least one tool"),
    ({"tool_choice": "auto"}, "tool_choice", "'tool_choice' needs 'tools'."),
    ({"tools": [TIME], "parallel_tool_calls": "nope"}, "parallel_tool_calls", "boolean"),
    ({"tools": [TIME], "guided_regex": "a", "tool_choice": NAMED}, "guided_regex", "not both"),
    (
        {"tools": [TIME], "response_format": {"type": "json_object"}, "tool_choice": "required"},
        "response_format",
        "not both",
    ),
]


@pytest.mark.parametrize(("fields", "param", "match"), TOOL_ERRORS)
def test_tool_fields_are_400s_naming_the_parameter(
    fields: dict[str, Any], param: str, match: str
) -> None:
    error = refused(chat, **fields)
    assert error.param == param and match in error.message, error.message


def test_tool_choices() -> None:
    assert chat(tools=[TIME], tool_choice=NAMED).tools.function_name == "get_time"
    assert chat(tools=[], tool_choice="auto").tools.choice == "none"
    assert chat(tools=None, tool_choice=None).tools.choice == "none"
    assert chat(tools=[TIME]).tools.choice == "auto"
    assert chat(tools=[TIME], parallel_tool_calls=False).tools.parallel_tool_calls is False
    # "auto" needs the server's tool parser; required and named choices do not.
    error = refused(chat, auto_tools=False, tools=[TIME])
    assert error.param == "tool_choice" and "--enable-auto-tool-choice" in error.message
    assert chat(auto_tools=False, tools=[TIME], tool_choice="required").tools.choice == "required"
    assert chat(auto_tools=False, tools=[TIME], tool_choice="none").tools.choice == "none"
    # A constraint of its own is fine when the output is free.
    assert chat(
        tools=[TIME], tool_choice="auto", guided_regex="a"
    ).sampling.engine.structured_output
    # /tokenize renders tools (names unique there too) without any choice.
    assert parse_tokenize({"messages": USER, "tools": [TIME]}).tools == [TIME]
    assert refused(parse_tokenize, body={"prompt": "x", "tools": [TIME, TIME]}).param == "tools"


# Cross-field rules the validators check and the schema states too (if/then, oneOf, anyOf).
CROSS_FIELD: list[tuple[str, dict[str, Any], dict[str, Any], str]] = [
    ("/v1/completions", {"max_tokens": 0}, {"max_tokens": 0, "echo": True}, "max_tokens"),
    ("/v1/completions", {"stream_options": {"x": 1}}, {"stream_options": {}}, "stream_options"),
    (
        "/v1/chat/completions",
        {"top_logprobs": 2},
        {"top_logprobs": 2, "logprobs": True},
        "top_logprobs",
    ),
    (
        "/v1/chat/completions",
        {"continue_final_message": True},
        {"continue_final_message": True, "add_generation_prompt": False},
        "continue_final_message",
    ),
    (
        "/v1/chat/completions",
        {"tool_choice": "auto"},
        {"tools": [TIME], "tool_choice": "auto"},
        "tool_choice",
    ),
    (
        "/v1/chat/completions",
        {"tool_choice": "required", "tools": []},
        {"tools": [TIME], "tool_choice": "required"},
        "tool_choice",
    ),
    (
        "/v1/chat/completions",
        {"response_format": {"type": "json_schema"}},
        {"response_format": {}},
        "response_format",
    ),
    (
        "/v1/chat/completions",
        {"structured_outputs": {"json_object": False}},
        {"structured_outputs": {"json_object": True}},
        "structured_outputs",
    ),
    ("/tokenize", {"prompt": "x", "messages": USER}, {"prompt": "x"}, "prompt"),
    ("/tokenize", {}, {"messages": USER}, "prompt"),
    # booleans as strings or 0/1 (vLLM's reading), in the rules across fields too
    (
        "/v1/chat/completions",
        {"top_logprobs": 2, "logprobs": "off"},
        {"top_logprobs": 2, "logprobs": "On"},
        "top_logprobs",
    ),
    (
        "/v1/chat/completions",
        {"continue_final_message": "yes", "add_generation_prompt": 1},
        {"continue_final_message": "yes", "add_generation_prompt": "No"},
        "continue_final_message",
    ),
    (
        "/v1/completions",
        {"stream": "0", "stream_options": {"include_usage": True}},
        {"stream": "t", "stream_options": {"include_usage": True}},
        "stream_options",
    ),
]


@pytest.mark.parametrize(("path", "bad", "good", "param"), CROSS_FIELD)
def test_cross_field_rules_are_in_the_schema(
    path: str, bad: dict[str, Any], good: dict[str, Any], param: str
) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    doc = openapi_schema("test")
    body_schema = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]
    validator = jsonschema.Draft202012Validator({**body_schema["schema"], **doc})
    base: dict[str, Any] = {} if path == "/tokenize" else {"model": "m"}
    base |= {"prompt": "Hi"} if path == "/v1/completions" else {}
    base |= {"messages": USER} if path == "/v1/chat/completions" else {}
    parse: Any = {
        "/v1/completions": lambda b: parse_completion(b, 5),
        "/v1/chat/completions": lambda b: parse_chat(b, 5, True),
        "/tokenize": parse_tokenize,
    }[path]
    validator.validate({**base, **good})
    parse({**base, **good})
    assert not validator.is_valid({**base, **bad})
    with pytest.raises(ApiError) as e:
        parse({**base, **bad})
    assert e.value.param == param


def _cased(word: str, mask: int) -> str:
    """``word`` with the letters whose bit is set in ``mask`` upper-cased."""
    return "".join(c.upper() if mask >> i & 1 else c for i, c in enumerate(word))


_WORDS = ["true", "false", "yes", "no", "on", "off", "t", "f", "y", "n", "1", "0", "2", "tru"]


@given(
    st.one_of(
        st.booleans(),
        st.integers(-3, 3),
        st.sampled_from([0.0, 1.0, -0.0, 0.5, 2.0, 1e300]),
        st.tuples(st.sampled_from(_WORDS), st.integers(0, 31)).map(lambda t: _cased(*t)),
        st.sampled_from([" true", "true ", "true\n", "", "\u0130", None, [], {}]),
    )
)
@settings(max_examples=300, deadline=None)
def test_the_boolean_schema_is_what_is_accepted(value: Any) -> None:
    """A boolean field's JSON schema holds exactly the values its validation takes."""
    jsonschema = pytest.importorskip("jsonschema")
    schema = ChatBody.model_json_schema()["properties"]["logprobs"]
    accepted = True
    try:
        parse_chat({"model": "m", "messages": USER, "logprobs": value}, 5, True)
    except ApiError:
        accepted = False
    assert jsonschema.Draft202012Validator(schema).is_valid(value) == accepted, value


def test_request_bodies_are_the_models_schemas() -> None:
    doc = openapi_schema("1.2.3")
    components = doc["components"]["schemas"]
    bodies = [op for op in OPERATIONS if op.body is not None]
    assert {op.path for op in bodies} >= {"/v1/completions", "/v1/chat/completions", "/tokenize"}
    for op in bodies:
        assert op.body is not None
        ref = doc["paths"][op.path][op.method]["requestBody"]["content"]["application/json"]
        name = ref["schema"]["$ref"].removeprefix("#/components/schemas/")
        assert (
            components[name]["properties"].keys()
            == op.body.model_json_schema()["properties"].keys()
        )
    chat_schema = components["ChatBody"]
    assert chat_schema["properties"]["n"]["anyOf"][0] == {
        "type": "integer",
        "minimum": 1,
        "maximum": 128,
    }
    stop = chat_schema["properties"]["stop"]["anyOf"][0]["anyOf"][1]
    assert (stop["maxItems"], stop["items"]["maxLength"]) == (64, 1024)
    assert chat_schema["required"] == ["model", "messages"]
    text = str(doc)
    assert "'additionalProperties': False" not in text  # clients send extras
    assert "$defs" not in text  # every definition is a component


def test_a_route_is_documented_by_one_table_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    class EchoBody(BaseModel):
        text: str

    entry = Operation("/v1/echo", "post", "Echo", EchoBody, openapi.JSON_BODY_ERRORS)
    monkeypatch.setattr(openapi, "OPERATIONS", (*OPERATIONS, entry))
    monkeypatch.setattr(openapi, "_body_schemas", openapi._body_schemas.__wrapped__)
    doc = openapi_schema("1", api_key=True)
    op = doc["paths"]["/v1/echo"]["post"]
    assert op["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/EchoBody"
    }
    assert doc["components"]["schemas"]["EchoBody"]["required"] == ["text"]
    assert set(op["responses"]) == {"200", "400", "401", "404", "413", "415", "431", "503"}


LONG = (1 << 16) + 5  # past the length where token ids are checked in Python, slice by slice


@pytest.mark.parametrize(
    ("bad", "why"),
    [(True, "a bool"), (-1, "negative"), (2**32, "beyond uint32"), ("5", "a string")],
)
def test_long_token_id_prompt_is_checked_like_a_short_one(bad: object, why: str) -> None:
    """The Python path for long id lists (it lets the event loop in while a worker parses)
    accepts and refuses exactly what pydantic-core does for short ones."""
    ids = [7] * LONG
    req = parse_completion({"model": "m", "prompt": ids}, 5)
    assert req.prompts == (tuple(ids),)
    ids[LONG - 2] = bad
    with pytest.raises(ApiError) as e:
        parse_completion({"model": "m", "prompt": ids}, 5)
    assert e.value.param == "prompt", why
    floats = [7.0] * LONG  # integral floats are ids, as in short lists
    assert parse_completion({"model": "m", "prompt": floats}, 5).prompts == ((7,) * LONG,)
