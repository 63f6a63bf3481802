"""The bodies of POST /v1/messages and /v1/messages/count_tokens (Anthropic's Messages API, as
vLLM serves it), and the OpenAI chat body each one becomes: the chat path parses that body
(``parse_chat``) and runs the request, so sampling, tools and the template work as in chat.

The conversation (system, messages and their content blocks) is read by
``anthropic_content``, which says how each message becomes chat's. ``tool_choice`` any is chat's
"required", tool {name} a named function; ``disable_parallel_tool_use`` is
``parallel_tool_calls`` false. ``thinking`` enabled (or adaptive) / disabled is the template's
``enable_thinking``.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, Tag, field_validator, model_validator

from frontend_svc.errors import invalid_parameter
from frontend_svc.protocol.anthropic_content import (
    AssistantMessage,
    Message,
    TextBlock,
    UserMessage,
    by_field,
)
from frontend_svc.protocol.base import RequestModel, given, problem, validate
from frontend_svc.protocol.fields import (
    FAIL_FAST,
    INT32_MAX,
    UINT32_MAX,
    Bool,
    Float,
    Float32Range,
    InRange,
    Int,
)
from frontend_svc.protocol.messages import FunctionName
from frontend_svc.protocol.models import StopStrings
from frontend_svc.protocol.parse import parse_chat
from frontend_svc.protocol.requests import ChatRequest
from frontend_svc.protocol.structured import JsonSchema


class CustomTool(RequestModel):
    """A function the model may call (a custom tool: Anthropic's server tools are not run)."""

    type: (
        Annotated[
            Literal["custom"],
            Field(description="Server tools (web search, bash, ...) are not supported."),
        ]
        | None
    ) = None
    name: FunctionName
    description: str | None = None
    input_schema: dict[str, Any] = Field(description="A JSON Schema object.")

    def chat_tool(self) -> dict[str, Any]:
        function = {"name": self.name, "parameters": self.input_schema}
        if self.description is not None:
            function["description"] = self.description
        return {"type": "function", "function": function}


class ToolChoiceAuto(RequestModel):
    type: Literal["auto"]
    disable_parallel_tool_use: Bool = False


class ToolChoiceAny(RequestModel):
    type: Literal["any"]
    disable_parallel_tool_use: Bool = False


class ToolChoiceTool(RequestModel):
    type: Literal["tool"]
    name: FunctionName
    disable_parallel_tool_use: Bool = False


class ToolChoiceNone(RequestModel):
    type: Literal["none"]


ToolChoice = Annotated[
    Annotated[ToolChoiceAuto, Tag("ToolChoiceAuto")]
    | Annotated[ToolChoiceAny, Tag("ToolChoiceAny")]
    | Annotated[ToolChoiceTool, Tag("ToolChoiceTool")]
    | Annotated[ToolChoiceNone, Tag("ToolChoiceNone")],
    by_field(
        "type",
        {
            "auto": "ToolChoiceAuto",
            "any": "ToolChoiceAny",
            "tool": "ToolChoiceTool",
            "none": "ToolChoiceNone",
        },
        "an object",
    ),
]


class ThinkingEnabled(RequestModel):
    type: Literal["enabled"]
    budget_tokens: Annotated[Int, InRange(1, UINT32_MAX)] = Field(
        description="Not enforced: the reasoning ends when the model ends it (or max_tokens)."
    )


class ThinkingOn(RequestModel):
    """Anthropic's adaptive and between-tools thinking: here, thinking on."""

    type: Literal["adaptive", "between_tools"]


class ThinkingDisabled(RequestModel):
    type: Literal["disabled"]


Thinking = Annotated[
    Annotated[ThinkingEnabled, Tag("ThinkingEnabled")]
    | Annotated[ThinkingOn, Tag("ThinkingOn")]
    | Annotated[ThinkingDisabled, Tag("ThinkingDisabled")],
    by_field(
        "type",
        {
            "enabled": "ThinkingEnabled",
            "adaptive": "ThinkingOn",
            "between_tools": "ThinkingOn",
            "disabled": "ThinkingDisabled",
        },
        "an object",
    ),
]


class JsonOutputFormat(RequestModel):
    type: Literal["json_schema"]
    schema_: JsonSchema = Field(alias="schema")


class OutputConfig(RequestModel):
    """Anthropic's structured outputs: chat's ``response_format`` json_schema."""

    format: JsonOutputFormat | None = None
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = Field(
        None, description="Accepted and not used."
    )


_CHOICES = {"auto": "auto", "any": "required", "none": "none"}  # Anthropic's -> chat's


def _type_is(name: str, kinds: list[str]) -> dict[str, Any]:
    return given(name, {"properties": {"type": {"enum": kinds}}, "required": ["type"]})


class PromptFields(RequestModel):
    """What makes the prompt (both routes): the model, system, messages, tools, thinking."""

    schema_rules: ClassVar[tuple[dict[str, Any], ...]] = (
        {
            "if": _type_is("tool_choice", ["auto", "any", "tool"]),
            "then": given("tools", {"type": "array"}),
        },
        {
            "if": _type_is("tool_choice", ["any", "tool"]),
            "then": given("tools", {"minItems": 1}),
        },
    )

    model: str
    messages: Annotated[list[Message], Field(min_length=1), FAIL_FAST]
    system: str | Annotated[list[TextBlock], FAIL_FAST] | None = None
    tools: Annotated[list[CustomTool], FAIL_FAST] | None = Field(
        None, description="Functions the model may call (each name once)."
    )
    tool_choice: ToolChoice | None = Field(None, description="Default: auto.")
    thinking: Thinking | None = Field(
        None, description="The chat template's enable_thinking (true unless disabled)."
    )
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="vLLM's: more variables for the chat template."
    )

    @field_validator("tools")
    @classmethod
    def _unique_names(cls, tools: list[CustomTool] | None) -> list[CustomTool] | None:
        seen: set[str] = set()
        for tool in tools or ():
            if tool.name in seen:
                raise problem(f"has two tools named '{tool.name}'")
            seen.add(tool.name)
        return tools

    @model_validator(mode="after")
    def _tool_rules(self) -> PromptFields:
        choice = self.tool_choice
        if choice is None or choice.type == "none":
            return self
        if self.tools is None:
            raise invalid_parameter("'tool_choice' needs 'tools'.", "tool_choice")
        if not self.tools and choice.type in ("any", "tool"):
            raise invalid_parameter(
                f"'tool_choice' {choice.type} needs a tool in 'tools'.", "tool_choice"
            )
        if isinstance(choice, ToolChoiceTool) and all(t.name != choice.name for t in self.tools):
            raise invalid_parameter(
                f"'tool_choice' names the tool '{choice.name}', which is not in 'tools'.",
                "tool_choice",
            )
        return self

    def chat_body(self) -> dict[str, Any]:
        """The OpenAI chat body of the prompt's fields."""
        messages: list[dict[str, Any]] = []
        if self.system is not None:
            system = self.system
            text = system if isinstance(system, str) else "\n".join(b.text for b in system)
            messages.append({"role": "system", "content": text})
        for m in self.messages:
            if isinstance(m, UserMessage):
                messages += m.chat_messages()
            else:
                messages.append(m.chat_message())
        body: dict[str, Any] = {"model": self.model, "messages": messages}
        last = self.messages[-1]
        if isinstance(last, AssistantMessage) and last.continued():
            body |= {"add_generation_prompt": False, "continue_final_message": True}
        kwargs = dict(self.chat_template_kwargs)
        if self.thinking is not None:
            kwargs["enable_thinking"] = self.thinking.type != "disabled"
        if kwargs:
            body["chat_template_kwargs"] = kwargs
        if self.tools is not None:
            body["tools"] = [t.chat_tool() for t in self.tools]
        choice = self.tool_choice
        if choice is not None:
            if isinstance(choice, ToolChoiceTool):
                body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
            else:
                body["tool_choice"] = _CHOICES[choice.type]
            if not isinstance(choice, ToolChoiceNone) and choice.disable_parallel_tool_use:
                body["parallel_tool_calls"] = False
        return body


class MessagesBody(PromptFields):
    """POST /v1/messages."""

    max_tokens: Annotated[Int, InRange(1, UINT32_MAX)] = Field(
        description="Required, as Anthropic has it."
    )
    stop_sequences: StopStrings = ()
    temperature: Annotated[Float, Float32Range(0.0)] | None = None
    top_p: Annotated[Float, Float32Range(0.0, 1.0, lo_open=True)] | None = None
    top_k: Annotated[Int, InRange(0, INT32_MAX)] | None = Field(None, description="0: no limit.")
    metadata: dict[str, Any] | None = Field(None, description="Accepted and not used.")
    output_config: OutputConfig | None = None
    stream: Bool = False

    def chat_body(self) -> dict[str, Any]:
        body = super().chat_body()
        body |= {"max_tokens": self.max_tokens, "stop": list(self.stop_sequences)}
        body |= {"stream": self.stream}
        output = self.output_config.format if self.output_config else None
        if output is not None:
            schema = {"name": "output", "schema": output.schema_}
            body["response_format"] = {"type": "json_schema", "json_schema": schema}
        sampling = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k}
        return body | {k: v for k, v in sampling.items() if v is not None}


class CountTokensBody(PromptFields):
    """POST /v1/messages/count_tokens."""


def parse_messages(body: object, max_logprobs: int, auto_tools: bool) -> ChatRequest:
    """The chat request the body becomes (``auto_tools``: as ``parse_chat``)."""
    return parse_chat(validate(MessagesBody, body).chat_body(), max_logprobs, auto_tools)


def parse_count_tokens(body: object, max_logprobs: int) -> ChatRequest:
    """The chat request whose prompt is counted (tool choice "auto" whether or not the server
    reads calls: the prompt is the same)."""
    return parse_chat(validate(CountTokensBody, body).chat_body(), max_logprobs, True)
