"""The request fields that ask for structured outputs, as request models.

Three spellings reach the same constraint (``engine_types.StructuredOutput``): OpenAI's
``response_format``, vLLM's ``structured_outputs`` and vLLM's older top-level ``guided_*``
fields. At most one constraint per request. Only the shape is checked here: whether a schema,
regex or grammar compiles is the engine's to say (``structured_output.name_constraint_errors``
names the field in its refusal).
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

import orjson
from pydantic import Field, PlainValidator, model_validator

from frontend_svc.errors import invalid_parameter
from frontend_svc.protocol.base import NOT_NULL, RequestModel, given
from frontend_svc.protocol.fields import (
    FAIL_FAST,
    TRUE,
    Bool,
    NonBlank,
    Says,
    json_schema_object,
)
from protos.types import StructuredOutput

# A JSON Schema: an object, or its JSON text (vLLM takes both).
JsonSchema = Annotated[
    dict[str, Any],
    PlainValidator(
        json_schema_object,
        json_schema_input_type=dict[str, Any]
        | Annotated[str, Field(json_schema_extra={"contentMediaType": "application/json"})],
    ),
]
Choices = Annotated[
    list[str], Field(min_length=1), FAIL_FAST, Says("must be a non-empty list of strings")
]


class JsonSchemaFormat(RequestModel):
    name: str | None = None
    schema_: JsonSchema = Field(alias="schema")
    strict: Bool | None = None


class ResponseFormat(RequestModel):
    """OpenAI's: ``{"type": "text"}`` (no constraint; ``{}`` too), ``json_object``, or
    ``json_schema`` with ``json_schema: {"name", "schema", "strict"}``."""

    schema_rules: ClassVar[tuple[dict[str, Any], ...]] = (
        {
            "if": given("type", {"const": "json_schema"}),
            "then": {
                "required": ["json_schema"],
                "properties": {"json_schema": {"type": "object"}},
            },
        },
    )

    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise invalid_parameter(
                "'response_format.json_schema' must be an object with 'name' and 'schema'.",
                "response_format",
            )
        return self

    def constraint(self) -> StructuredOutput | None:
        if self.type == "json_object":
            return StructuredOutput("json_object")
        if self.json_schema is not None and self.type == "json_schema":
            return _json_schema(self.json_schema.schema_)
        return None


# vLLM's structured_outputs keys -> the contract's kinds (in the order they are read).
_KINDS = {
    "json": "json_schema",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
    "json_object": "json_object",
}


class StructuredOutputsParams(RequestModel):
    """vLLM's ``structured_outputs``: one of its kinds (a second one is refused with the
    request's other constraints: at most one per request)."""

    schema_rules: ClassVar[tuple[dict[str, Any], ...]] = (
        {"anyOf": [given(k, TRUE if k == "json_object" else NOT_NULL) for k in _KINDS]},
    )

    json_: JsonSchema | None = Field(None, alias="json")
    regex: NonBlank | None = None
    choice: Choices | None = None
    grammar: NonBlank | None = None
    json_object: Bool | None = None
    structural_tag: Annotated[None, Says("is not supported")] = None

    @model_validator(mode="after")
    def _one_kind(self) -> StructuredOutputsParams:
        if not self.constraints():
            raise invalid_parameter(
                f"'structured_outputs' must set one of {', '.join(_KINDS)}.",
                "structured_outputs",
            )
        return self

    def constraints(self) -> list[tuple[StructuredOutput, str]]:
        """Each constraint set, with the place it came from (for errors)."""
        values = (self.json_, self.regex, self.choice, self.grammar, self.json_object)
        return [
            (_constraint(kind, value), f"structured_outputs.{key}")
            for (key, kind), value in zip(_KINDS.items(), values, strict=True)
            if value is not None and value is not False
        ]


class StructuredOutputFields(RequestModel):
    """The structured-output fields of a generation request (at most one constraint)."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: JsonSchema | None = None
    guided_regex: NonBlank | None = None
    guided_choice: Choices | None = None
    guided_grammar: NonBlank | None = None

    def structured_output(self) -> tuple[StructuredOutput, str] | None:
        """The request's constraint and the field it came from (for errors), or None; a 400
        when there is more than one."""
        found = self._constraints()
        if len(found) > 1:
            names = ", ".join(f"'{where}'" for _, _, where in found)
            raise invalid_parameter(
                f"Give at most one structured output constraint; this request has {names}.",
                found[1][1],
            )
        return (found[0][0], found[0][1]) if found else None

    def _constraints(self) -> list[tuple[StructuredOutput, str, str]]:
        """(constraint, param, place) of every constraint the request sets."""
        found: list[tuple[StructuredOutput, str, str]] = []
        if self.response_format is not None:
            constraint = self.response_format.constraint()
            if constraint is not None:
                found.append((constraint, "response_format", "response_format"))
        if self.structured_outputs is not None:
            found += [
                (c, "structured_outputs", w) for c, w in self.structured_outputs.constraints()
            ]
        guided = (
            ("guided_json", "json_schema", self.guided_json),
            ("guided_regex", "regex", self.guided_regex),
            ("guided_choice", "choice", self.guided_choice),
            ("guided_grammar", "grammar", self.guided_grammar),
        )
        found += [(_constraint(kind, v), name, name) for name, kind, v in guided if v is not None]
        return found


def _constraint(kind: str, value: Any) -> StructuredOutput:
    if kind == "json_schema":
        return _json_schema(value)
    if kind == "json_object":
        return StructuredOutput(kind)
    if kind == "choice":
        return StructuredOutput(kind, choices=tuple(value))
    return StructuredOutput(kind, value)


def _json_schema(schema: dict[str, Any]) -> StructuredOutput:
    return StructuredOutput("json_schema", orjson.dumps(schema).decode())
