"""The conversation of an Anthropic Messages body: its messages and their content blocks, as
request models, and what each becomes in an OpenAI chat body::

    system (a string, or text blocks)        -> a "system" message first
    user: text blocks                        -> a "user" message (the texts joined by newlines)
    user: tool_result {tool_use_id, content} -> a "tool" message each, before the user's text
    assistant: text / thinking / tool_use    -> an "assistant" message: content,
                                                reasoning_content, tool_calls (input as JSON)
    a last assistant message with text       -> continued, not answered (Anthropic's prefill)

Blocks are told apart by their ``type``; one this text-only server cannot take (an image, a
document, a server tool's) is a 400 saying so.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BeforeValidator, Discriminator, Field, Tag, model_validator
from pydantic.json_schema import SkipJsonSchema

from frontend_svc.protocol.base import PROBLEM, RequestModel, problem
from frontend_svc.protocol.fields import FAIL_FAST, Bool


class _Discriminator(Discriminator):
    """Hashable (its error context is a dict), as a union it is part of must be."""

    def __hash__(self) -> int:
        return id(self)


def by_field(
    key: str, members: dict[str, str], what: str, refused: str | None = None
) -> Discriminator:
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
    by_field("type", {"text": "TextBlock"}, "a block", "RefusedResultBlock"),
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
    by_field(
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
    by_field(
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
    by_field("role", {"user": "UserMessage", "assistant": "AssistantMessage"}, "a message"),
]
