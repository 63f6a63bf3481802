"""The body of POST /v1/responses (OpenAI's Responses API), and what the gateway makes of it.

A Responses call is a chat completion spelled differently, and it runs as one: its input items
become chat messages (``protocol.responses_items``), its fields a :class:`ChatRequest`
(:meth:`ResponsesRequest.chat_request`)::

    input "Hi"                                   one user message
    instructions                                 a first system message
    tools [{"type": "function", name, ...}]      tools [{"type": "function", "function": {...}}]
    tool_choice {"type": "function", name}       {"type": "function", "function": {name}}
    text.format json_schema / json_object        response_format's constraint
    reasoning.effort                             the template's ``reasoning_effort``
    max_output_tokens                            max_tokens

Chat's own rules apply to what the two share (tool choices, the constraint a forced call makes),
through chat's own code.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Literal

import orjson
from pydantic import AfterValidator, Field, ValidationInfo, WithJsonSchema, model_validator

from frontend_svc.errors import invalid_parameter
from frontend_svc.protocol.base import NOT_NULL, RequestModel, given, problem, validate
from frontend_svc.protocol.fields import FAIL_FAST, FALSE, Bool, Float, Float32Range, Says
from frontend_svc.protocol.messages import (
    FunctionDefinition,
    FunctionName,
    NamedFunction,
    NamedToolChoice,
    Tool,
    ToolChoiceFields,
)
from frontend_svc.protocol.models import MaxTokens
from frontend_svc.protocol.requests import ChatRequest, SamplingOptions
from frontend_svc.protocol.responses_items import InputItem, chat_messages, normalized_items
from frontend_svc.protocol.structured import JsonSchema
from frontend_svc.protocol.tools import ToolOptions
from protos.types import EngineSamplingParams, StructuredOutput

# OpenAI's limits on metadata: 16 pairs, keys of at most 64 characters, values of at most 512.
MAX_METADATA_PAIRS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512


# -- tools, text format, reasoning ---------------------------------------------------------------


class ResponsesFunctionTool(RequestModel):
    """A function the model may call (flat: the Responses API's shape, not chat's)."""

    type: Annotated[
        Literal["function"],
        Says("must be 'function': this server runs no built-in tools"),
    ]
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="A JSON Schema object.")
    strict: Bool | None = None

    def echo(self) -> dict[str, Any]:
        return {
            "type": "function",
            "name": self.name,
            "description": self.description,
            "parameters": self.parameters,
            "strict": self.strict,
        }


class ResponsesFunctionChoice(RequestModel):
    """A tool choice that forces one function of ``tools``."""

    type: Annotated[
        Literal["function"], Says("must be 'function': this server runs no built-in tools")
    ]
    name: FunctionName


class TextFormat(RequestModel):
    """``text.format``: ``text`` (no constraint), ``json_object``, or ``json_schema`` with
    ``schema`` (and ``name``, ``description``, ``strict``)."""

    schema_rules: ClassVar[tuple[dict[str, Any], ...]] = (
        {
            "if": given("type", {"const": "json_schema"}),
            "then": {"required": ["schema"], "properties": {"schema": NOT_NULL}},
        },
    )

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    description: str | None = None
    schema_: JsonSchema | None = Field(None, alias="schema")
    strict: Bool | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> TextFormat:
        if self.type == "json_schema" and self.schema_ is None:
            raise invalid_parameter(
                "'text.format.schema' is required with type 'json_schema'.", "text"
            )
        return self

    def constraint(self) -> StructuredOutput | None:
        if self.type == "json_object":
            return StructuredOutput("json_object")
        if self.type == "json_schema" and self.schema_ is not None:
            return StructuredOutput("json_schema", orjson.dumps(self.schema_).decode())
        return None

    def echo(self) -> dict[str, Any]:
        if self.type != "json_schema":
            return {"type": self.type}
        return {
            "type": "json_schema",
            "name": self.name,
            "description": self.description,
            "schema": self.schema_,
            "strict": self.strict,
        }


class TextConfig(RequestModel):
    format: TextFormat | None = None


class ReasoningConfig(RequestModel):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = Field(
        None, description="Given to the chat template as reasoning_effort."
    )
    summary: Literal["auto", "concise", "detailed"] | None = Field(
        None, description="Accepted; summaries are not written (the reasoning itself is)."
    )


Metadata = Annotated[
    dict[
        Annotated[str, Field(max_length=MAX_METADATA_KEY_CHARS)],
        Annotated[str, Field(max_length=MAX_METADATA_VALUE_CHARS)],
    ],
    Field(max_length=MAX_METADATA_PAIRS),
]


def _not_background(v: bool) -> bool:
    if v:
        raise problem("must be false: this server does not run responses in the background")
    return v


# -- the body ------------------------------------------------------------------------------------


class ResponsesBody(RequestModel):
    """POST /v1/responses."""

    schema_rules: ClassVar[tuple[dict[str, Any], ...]] = ToolChoiceFields.schema_rules

    model: str
    input: str | Annotated[list[InputItem], FAIL_FAST, Field(json_schema_extra={"minItems": 1})]
    instructions: str | None = Field(None, description="A first system message (not carried on).")
    previous_response_id: str | None = Field(
        None, description="Continue the conversation of a stored response (404 if unknown)."
    )
    tools: Annotated[list[ResponsesFunctionTool], FAIL_FAST] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponsesFunctionChoice | None = Field(
        None, description="Default: 'auto' with tools, else 'none'."
    )
    parallel_tool_calls: Bool = True
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: MaxTokens | None = Field(
        None, description="Default: the rest of the context."
    )
    temperature: Annotated[Float, Float32Range(0.0)] | None = None
    top_p: Annotated[Float, Float32Range(0.0, 1.0, lo_open=True)] | None = None
    metadata: Metadata | None = None
    user: str | None = None
    store: Bool = Field(True, description="Keep the response for GET and previous_response_id.")
    stream: Bool = False
    background: Annotated[Bool, AfterValidator(_not_background), WithJsonSchema(FALSE)] | None = (
        None
    )
    conversation: Annotated[None, Says("is not supported (use previous_response_id)")] = None

    @model_validator(mode="after")
    def _rules(self, info: ValidationInfo) -> ResponsesBody:
        if isinstance(self.input, list) and not self.input:
            raise invalid_parameter("'input' must be a string or a non-empty list.", "input")
        seen: set[str] = set()
        for tool in self.tools or ():
            if tool.name in seen:
                raise invalid_parameter(f"'tools' has two functions named '{tool.name}'.", "tools")
            seen.add(tool.name)
        tools = self.tool_options((info.context or {}).get("auto_tools", False))
        if tools.json_schema() is not None and self.constraint() is not None:
            raise invalid_parameter(
                "You can only either use constraints for structured outputs or tools, not both.",
                "text",
            )
        return self

    def tool_options(self, auto_supported: bool) -> ToolOptions:
        """The tool fields as chat's :class:`ToolOptions`, by chat's own rules (400s naming
        ``tool_choice`` or ``tools``)."""
        choice: Any = self.tool_choice
        if isinstance(choice, ResponsesFunctionChoice):
            choice = NamedToolChoice.model_construct(
                type="function", function=NamedFunction.model_construct(name=choice.name)
            )
        chat_tools = None
        if self.tools is not None:
            chat_tools = [
                Tool.model_construct(
                    type="function",
                    function=FunctionDefinition.model_construct(
                        name=t.name,
                        description=t.description,
                        parameters=t.parameters,
                        strict=t.strict,
                    ),
                )
                for t in self.tools
            ]
        fields = ToolChoiceFields.model_construct(
            tools=chat_tools, tool_choice=choice, parallel_tool_calls=self.parallel_tool_calls
        )
        return fields.tool_options(auto_supported)

    def constraint(self) -> StructuredOutput | None:
        fmt = self.text.format if self.text is not None else None
        return fmt.constraint() if fmt is not None else None


# -- the gateway's view --------------------------------------------------------------------------


@dataclass(frozen=True)
class ResponsesRequest:
    """A validated Responses call. ``input_items``: its input, normalized (what
    ``input_items`` lists and a continued conversation holds); ``echo``: the request's fields as
    the Response object repeats them."""

    model: str
    input_items: tuple[dict[str, Any], ...]
    instructions: str | None
    previous_response_id: str | None
    sampling: SamplingOptions
    tools: ToolOptions
    template_kwargs: dict[str, Any]
    stream: bool
    store: bool
    echo: dict[str, Any] = field(default_factory=dict)

    def chat_request(self, history: Sequence[dict[str, Any]]) -> ChatRequest:
        """The chat completion this call runs: the instructions, then ``history`` (the items of
        the conversation it continues), then its input."""
        messages = chat_messages([*history, *self.input_items])
        if self.instructions is not None:
            messages.insert(0, {"role": "system", "content": self.instructions})
        return ChatRequest(
            model=self.model,
            messages=tuple(messages),
            add_generation_prompt=True,
            template_kwargs=self.template_kwargs,
            sampling=self.sampling,
            logprobs=False,
            stream=self.stream,
            max_tokens_param="max_output_tokens",
            tools=self.tools,
        )


def parse_responses(body: object, auto_tools: bool = False) -> ResponsesRequest:
    """``auto_tools``: the server reads tool calls the model chose to make (chat's rule for
    tool_choice "auto")."""
    b = validate(ResponsesBody, body, {"auto_tools": auto_tools})
    tools = b.tool_options(auto_tools)
    constraint, param = b.constraint(), "text.format"
    schema = tools.json_schema()
    if schema is not None:  # required or named: the output is the calls' JSON (chat's way)
        constraint = StructuredOutput("json_schema", orjson.dumps(schema).decode())
        param = "tool_choice"
    engine = EngineSamplingParams(
        max_tokens=b.max_output_tokens,
        temperature=b.temperature,
        top_p=b.top_p,
        structured_output=constraint,
    )
    sampling = SamplingOptions(
        engine=engine, structured_output_param=param if constraint is not None else None
    )
    effort = b.reasoning.effort if b.reasoning is not None else None
    summary = b.reasoning.summary if b.reasoning is not None else None
    fmt = b.text.format if b.text is not None else None
    echo = {
        "instructions": b.instructions,
        "max_output_tokens": b.max_output_tokens,
        "metadata": b.metadata or {},
        "parallel_tool_calls": b.parallel_tool_calls,
        "previous_response_id": b.previous_response_id,
        "reasoning": {"effort": effort, "summary": summary},
        "store": b.store,
        "temperature": b.temperature,
        "text": {"format": fmt.echo() if fmt is not None else {"type": "text"}},
        "tool_choice": _choice_echo(tools),
        "tools": [t.echo() for t in b.tools or ()],
        "top_p": b.top_p,
        "truncation": "disabled",
        "user": b.user,
    }
    return ResponsesRequest(
        model=b.model,
        input_items=tuple(normalized_items(b.input)),
        instructions=b.instructions,
        previous_response_id=b.previous_response_id,
        sampling=sampling,
        tools=tools,
        template_kwargs={"reasoning_effort": effort} if effort is not None else {},
        stream=b.stream,
        store=b.store,
        echo=echo,
    )


def _choice_echo(tools: ToolOptions) -> Any:
    if tools.choice == "function":
        return {"type": "function", "name": tools.function_name}
    return tools.choice
