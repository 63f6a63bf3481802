"""The bodies of POST /v1/messages and /v1/messages/count_tokens (Anthropic's Messages API, as
vLLM serves it), and the OpenAI chat body each one becomes: the chat path parses that body
(``parse_chat``) and runs the request, so sampling, tools and the template work as in chat.

The conversion, message by message::

    system (a string, or text blocks)        -> a "system" message first
    user: text blocks                        -> a "user" message (the texts joined by newlines)
    user: tool_result {tool_use_id, content} -> a "tool" message each, before the user's text
    assistant: text / thinking / tool_use    -> an "assistant" message: content,
                                                reasoning_content, tool_calls (input as JSON)
    a last assistant message with text       -> continued, not answered (Anthropic's prefill)

Blocks are told apart by their ``type``; one this text-only server cannot take (an image, a
document, a server tool's) is a 400 saying so. ``tool_choice`` any is chat's "required", tool
{name} a named function; ``disable_parallel_tool_use`` is ``parallel_tool_calls`` false.
``thinking`` enabled (or adaptive) / disabled is the template's ``enable_thinking``.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BeforeValidator, Discriminator, Field, Tag, field_validator, model_validator
from pydantic.json_schema import SkipJsonSchema

from frontend_svc.errors import invalid_parameter
from frontend_svc.protocol.base import PROBLEM, RequestModel, given, problem, validate
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


class _Discriminator(Discriminator):
    """Hashable (its error context is a dict), as a union it is part of must be."""

    def __hash__(self) -> int:
        return id(self)


def _by(key: str, members: dict[str, str], what: str, refused: str | None = None) -> Discriminator:
    """How a union is told apart by its ``key`` field: the tag of ``members[value]`` (the
    member's class name, which error locations skip), ``refused`` for any other string;
    otherwise a 400 saying the value must be ``what`` with one of the members' values."""

    def tag(v: Any) -> str | None:
        kind = v.get(key) if isinstance(v, dict) else getattr(v, key, None)
        return members.get(kind, refused) if isinstance(kind, str) else None

    names = ", ".join(f"'{m}'" for m in members)
    return _Discriminator(
        tag,
        custom_error_type=PROBLEM,
        custom_error_message="{phrase}",
        custom_error_context={"phrase": f"must be {what} whose '{key}' is one of {names}"},
    )


class TextBlock(RequestModel):
    type: Literal["text"]
    text: str


class ToolUseBlock(RequestModel):
    """A call the assistant made (the conversation so far)."""

    type: Literal["tool_use"]
    id: str
    name: Annotated[str, Field(min_length=1)]
    input: dict[str, Any]


class ThinkingBlock(RequestModel):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(RequestModel):
    """Reasoning Anthropic's API hid; sent back as it came, and left out of the prompt."""

    type: Literal["redacted_thinking"]
    data: str | None = None


class _Refused(RequestModel):
    """A block of a type the place it is in does not take: always a 400 naming the type."""

    allowed: ClassVar[str]  # what the place takes, for the message

    @model_validator(mode="before")
    @classmethod
    def _refuse(cls, data: Any) -> Any:
        kind = data.get("type") if isinstance(data, dict) else None
        if kind in ("image", "document"):
            raise problem(f"is an '{kind}' block: not supported, this server takes text only")
        raise problem(f"is a '{kind}' block, which is not supported here (only {cls.allowed})")


class RefusedUserBlock(_Refused):
    allowed = "text and tool_result blocks"


class RefusedAssistantBlock(_Refused):
    allowed = "text, thinking and tool_use blocks"


class RefusedResultBlock(_Refused):
    allowed = "text blocks"


ResultBlock = Annotated[
    Annotated[TextBlock, Tag("TextBlock")]
    | SkipJsonSchema[Annotated[RefusedResultBlock, Tag("RefusedResultBlock")]],
    _by("type", {"text": "TextBlock"}, "a block", "RefusedResultBlock"),
]


def _blocks(v: Any) -> Any:
    """A content string as the one text block it means (Anthropic's shorthand)."""
    if isinstance(v, str):
        return [{"type": "text", "text": v}]
    if not isinstance(v, list):
        raise problem("must be a string or a list of content blocks")
    return v


class ToolResultBlock(RequestModel):
    """What a tool the assistant called answered."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: Annotated[
        list[ResultBlock],
        FAIL_FAST,
        BeforeValidator(_blocks, json_schema_input_type=str | list[ResultBlock]),
    ] = Field(default_factory=list)
    is_error: Bool = False

    def text(self) -> str:
        return "\n".join(b.text for b in self.content if isinstance(b, TextBlock))


UserBlock = Annotated[
    Annotated[TextBlock, Tag("TextBlock")]
    | Annotated[ToolResultBlock, Tag("ToolResultBlock")]
    | SkipJsonSchema[Annotated[RefusedUserBlock, Tag("RefusedUserBlock")]],
    _by(
        "type",
        {"text": "TextBlock", "tool_result": "ToolResultBlock"},
        "a block",
        "RefusedUserBlock",
    ),
]
AssistantBlock = Annotated[
    Annotated[TextBlock, Tag("TextBlock")]
    | Annotated[ToolUseBlock, Tag("ToolUseBlock")]
    | Annotated[ThinkingBlock, Tag("ThinkingBlock")]
    | Annotated[RedactedThinkingBlock, Tag("RedactedThinkingBlock")]
    | SkipJsonSchema[Annotated[RefusedAssistantBlock, Tag("RefusedAssistantBlock")]],
    _by(
        "type",
        {
            "text": "TextBlock",
            "tool_use": "ToolUseBlock",
            "thinking": "ThinkingBlock",
            "redacted_thinking": "RedactedThinkingBlock",
        },
        "a block",
        "RefusedAssistantBlock",
    ),
]


class UserMessage(RequestModel):
    role: Literal["user"]
    content: Annotated[
        list[UserBlock],
        FAIL_FAST,
        BeforeValidator(_blocks, json_schema_input_type=str | list[UserBlock]),
    ]

    def chat_messages(self) -> list[dict[str, Any]]:
        """A "tool" message per tool result, then a "user" message with the text (if any)."""
        out: list[dict[str, Any]] = []
        texts = []
        for block in self.content:
            if isinstance(block, ToolResultBlock):
                tool = {"role": "tool", "tool_call_id": block.tool_use_id, "content": block.text()}
                out.append(tool | ({"is_error": True} if block.is_error else {}))
            elif isinstance(block, TextBlock):
                texts.append(block.text)
        if texts or not out:
            out.append({"role": "user", "content": "\n".join(texts)})
        return out


class AssistantMessage(RequestModel):
    role: Literal["assistant"]
    content: Annotated[
        list[AssistantBlock],
        FAIL_FAST,
        BeforeValidator(_blocks, json_schema_input_type=str | list[AssistantBlock]),
    ]

    def chat_message(self) -> dict[str, Any]:
        """One "assistant" message: the text, the reasoning (``reasoning_content``, as Qwen3's
        template reads it, and vLLM's ``reasoning``) and the calls."""
        blocks = self.content
        message: dict[str, Any] = {
            "role": "assistant",
            "content": "\n".join(b.text for b in blocks if isinstance(b, TextBlock)),
        }
        thinking = "".join(b.thinking for b in blocks if isinstance(b, ThinkingBlock))
        if thinking:
            message["reasoning_content"] = message["reasoning"] = thinking
        calls = [
            {
                "id": b.id,
                "type": "function",
                "function": {"name": b.name, "arguments": json.dumps(b.input)},
            }
            for b in blocks
            if isinstance(b, ToolUseBlock)
        ]
        if calls:
            message["tool_calls"] = calls
        return message

    def continued(self) -> bool:
        """Whether a reply continues this message when it is the last (Anthropic's prefill):
        it holds text and makes no call."""
        has_text = any(isinstance(b, TextBlock) and b.text.strip() for b in self.content)
        return has_text and not any(isinstance(b, ToolUseBlock) for b in self.content)


Message = Annotated[
    Annotated[UserMessage, Tag("UserMessage")]
    | Annotated[AssistantMessage, Tag("AssistantMessage")],
    _by("role", {"user": "UserMessage", "assistant": "AssistantMessage"}, "a message"),
]


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
    _by(
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
    _by(
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
