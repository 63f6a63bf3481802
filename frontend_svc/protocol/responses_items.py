"""The input items of POST /v1/responses (OpenAI's Responses API), and the chat messages they
become.

An item is validated by its ``type`` (a message's may be left out), kept in one normalized shape
(:func:`normalized_items`: each with an id, a message's content as parts: what
``GET /v1/responses/{id}/input_items`` lists and what a continued conversation holds), and
turned into the chat template's messages (:func:`chat_messages`)::

    {"role", "content": str or parts}            {"role", "content": the parts' text}
    role "developer"                             role "system" (open models' templates know it)
    {"type": "function_call", call_id, ...}      an assistant message's tool_calls entry
    {"type": "function_call_output", call_id}    {"role": "tool", "tool_call_id", "content"}
    {"type": "reasoning", content}               the next assistant message's reasoning_content

Output items (``routes.responses_output``) have the same shapes, so a stored response's output
continues a conversation as its input would.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Discriminator, Field, PlainValidator, Tag, WithJsonSchema

from frontend_svc.protocol.base import RequestModel, problem
from frontend_svc.protocol.fields import FAIL_FAST, Says
from frontend_svc.protocol.messages import FunctionName, call_arguments

ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
_TEXT_ONLY = "this model takes no input but text"


class InputContentPart(RequestModel):
    """A part of a message's content: text only (``input_text``; ``output_text`` in an
    assistant message sent back)."""

    type: Annotated[
        Literal["input_text", "output_text"],
        Says(f"must be 'input_text' or 'output_text': {_TEXT_ONLY}"),
    ]
    text: str


Content = str | Annotated[list[InputContentPart], FAIL_FAST]


def _text(content: Content) -> str:
    """The content as one string (parts joined by newlines, as chat joins them)."""
    return content if isinstance(content, str) else "\n".join(p.text for p in content)


class InputMessage(RequestModel):
    type: Literal["message"] = "message"
    id: str | None = None
    role: Literal["user", "system", "developer", "assistant"]
    content: Content


def _json_text(v: str) -> str:
    call_arguments(v)  # chat's check of a call's arguments: JSON text ("" counts as {})
    return v


class InputFunctionCall(RequestModel):
    """A call the model made (sent back with its output, to continue the conversation)."""

    type: Literal["function_call"]
    id: str | None = None
    call_id: Annotated[str, Field(min_length=1)]
    name: FunctionName
    arguments: Annotated[
        str,
        AfterValidator(_json_text),
        Field(json_schema_extra={"contentMediaType": "application/json"}),
    ] = Field(description="The arguments object as JSON text.")


class InputFunctionCallOutput(RequestModel):
    type: Literal["function_call_output"]
    id: str | None = None
    call_id: Annotated[str, Field(min_length=1)]
    output: Content


class ReasoningText(RequestModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class SummaryText(RequestModel):
    type: Literal["summary_text"] = "summary_text"
    text: str


class InputReasoning(RequestModel):
    """Reasoning the model wrote (sent back with its output): the template may show it again
    (Qwen3's renders the reasoning of the turn's assistant messages)."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: Annotated[list[SummaryText], FAIL_FAST] = Field(default_factory=list)
    content: Annotated[list[ReasoningText], FAIL_FAST] | None = None


def _item_kind(v: Any) -> str:
    """The union member an input item is (a message's ``type`` may be left out)."""
    if not isinstance(v, dict):
        return "Unknown"
    kind = v.get("type")  # null, or left out: a message
    if kind is None:
        return "Message"
    return _TAGS.get(kind, "Unknown") if isinstance(kind, str) else "Unknown"


def _unknown_item(v: Any) -> Any:
    kind = v.get("type") if isinstance(v, dict) else None
    got = f", got {kind!r}" if isinstance(kind, str) else ""
    raise problem(
        "must be an input item: an object whose 'type' is "
        + ", ".join(f"'{t}'" for t in ITEM_TYPES[:-1])
        + f" or '{ITEM_TYPES[-1]}' (a message's may be left out){got}"
    )


_TAGS = {  # capitalized: error locations leave them out (they are not field names)
    "message": "Message",
    "function_call": "FunctionCall",
    "function_call_output": "FunctionCallOutput",
    "reasoning": "Reasoning",
}
InputItem = Annotated[
    Annotated[InputMessage, Tag("Message")]
    | Annotated[InputFunctionCall, Tag("FunctionCall")]
    | Annotated[InputFunctionCallOutput, Tag("FunctionCallOutput")]
    | Annotated[InputReasoning, Tag("Reasoning")]
    # anything else: refused, saying what an item is (nothing matches it in the schema)
    | Annotated[Any, PlainValidator(_unknown_item), WithJsonSchema({"not": {}}), Tag("Unknown")],
    Discriminator(_item_kind),
]


# -- normalized, and as chat messages ------------------------------------------------------------


def item_id(prefix: str) -> str:
    """A new id in OpenAI's style: ``<prefix>_`` and 32 random hex digits (a few per call)."""
    return f"{prefix}_{os.urandom(16).hex()}"


ParsedItem = InputMessage | InputFunctionCall | InputFunctionCallOutput | InputReasoning


def normalized_items(input: str | Sequence[ParsedItem]) -> list[dict[str, Any]]:
    """The input as items of one shape: each with an id (the client's, or a new one), a
    message's content as parts (``input_text``; ``output_text`` for the assistant's)."""
    if isinstance(input, str):
        input = [InputMessage(role="user", content=input)]
    out: list[dict[str, Any]] = []
    for item in input:
        if isinstance(item, InputMessage):
            if isinstance(item.content, str):
                kind = "output_text" if item.role == "assistant" else "input_text"
                parts: list[dict[str, Any]] = [{"type": kind, "text": item.content}]
            else:
                parts = [{"type": p.type, "text": p.text} for p in item.content]
            for p in parts:
                if p["type"] == "output_text":
                    p["annotations"] = []
            out.append(
                {
                    "id": item.id or item_id("msg"),
                    "type": "message",
                    "role": item.role,
                    "content": parts,
                    "status": "completed",
                }
            )
        elif isinstance(item, InputFunctionCall):
            out.append(
                {
                    "id": item.id or item_id("fc"),
                    "type": "function_call",
                    "call_id": item.call_id,
                    "name": item.name,
                    "arguments": item.arguments,
                    "status": "completed",
                }
            )
        elif isinstance(item, InputFunctionCallOutput):
            out.append(
                {
                    "id": item.id or item_id("fco"),
                    "type": "function_call_output",
                    "call_id": item.call_id,
                    "output": _text(item.output),
                    "status": "completed",
                }
            )
        else:
            reasoning: dict[str, Any] = {
                "id": item.id or item_id("rs"),
                "type": "reasoning",
                "summary": [{"type": "summary_text", "text": s.text} for s in item.summary],
            }
            if item.content is not None:
                reasoning["content"] = [
                    {"type": "reasoning_text", "text": c.text} for c in item.content
                ]
            out.append(reasoning)
    return out


def chat_messages(items: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Normalized items (input or output ones) as the chat template's messages: a function call
    joins the assistant message before it (or starts one); its output is a ``tool`` message
    (with the function's ``name`` where the call is known); reasoning goes to the next assistant
    message as ``reasoning_content`` (dropped when a user's message comes first)."""
    messages: list[dict[str, Any]] = []
    names: dict[str, str] = {}
    reasoning: str | None = None
    turn: dict[str, Any] | None = None  # the assistant message calls may still join
    for item in items:
        kind = item["type"]
        if kind == "reasoning":
            parts = item.get("content") or item.get("summary") or ()
            reasoning = "\n".join(p["text"] for p in parts)
            continue
        if kind == "message":
            role = "system" if item["role"] == "developer" else item["role"]
            message = {"role": role, "content": "\n".join(p["text"] for p in item["content"])}
            turn = message if role == "assistant" else None
        elif kind == "function_call":
            names[item["call_id"]] = item["name"]
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": _parsed(item["arguments"])},
            }
            if turn is not None and reasoning is None:
                turn.setdefault("tool_calls", []).append(call)
                continue
            message = turn = {"role": "assistant", "content": "", "tool_calls": [call]}
        else:  # function_call_output
            message = {"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]}
            if item["call_id"] in names:
                message["name"] = names[item["call_id"]]
            turn = None
        if message["role"] == "assistant" and reasoning is not None:
            message["reasoning_content"] = reasoning
        if message["role"] != "system":
            reasoning = None
        messages.append(message)
    return messages


def _parsed(arguments: str) -> Any:
    """A call's arguments as the template writes them back (``tojson``): parsed, as chat
    parses them; text that is not JSON stays text."""
    try:
        return json.loads(arguments) if arguments else {}
    except (ValueError, RecursionError):
        return arguments
