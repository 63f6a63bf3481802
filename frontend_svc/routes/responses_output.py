"""The Response object of POST /v1/responses, and the typed stream events that build it.

The model's text goes through the chat route's readers (``frontend_svc.reasoning`` splits off the
reasoning, a ``frontend_svc.tool_parsers`` parser reads calls in the rest) and becomes output
items, each opened, written and closed in turn::

    <think>I greet back.</think>Hello!<tool_call>{...}</tool_call>
            ^^^^^^^^^^^^         ^^^^^^           ^^^^^
            reasoning item       message item     function_call item

A stream announces every step as an event (``response.output_item.added``, a content part added,
its deltas, its ``.done``, the item's ``.done``), the field names of the ``openai`` SDK's types;
a whole response is the same items, fed at once. Whitespace with no item open (between the
reasoning and a call) is held, and dropped unless text follows or the output would be empty.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from frontend_svc.protocol.responses_items import item_id
from frontend_svc.reasoning import ReasoningStream, RequestReasoning
from frontend_svc.text.output_processor import SequenceDelta
from frontend_svc.tool_parsers import ToolCallStream, ToolParser

Event = dict[str, Any]  # an event without its sequence_number (the stream numbers them)


@dataclass
class _Open:
    """The item being written: as it was added, its place in the output, its text so far."""

    item: dict[str, Any]
    index: int
    pieces: list[str] = field(default_factory=list)

    @property
    def kind(self) -> str:
        return str(self.item["type"])


class OutputItems:
    """The output items of one response, built from its text piece by piece; ``feed`` and
    ``close`` answer the events that announce each step. ``strict``: calls are read as chat
    reads a whole answer (a malformed one stays text); a stream reads them as they come.
    ``parallel``: every call is kept (else only the first, as chat's ``parallel_tool_calls``)."""

    def __init__(
        self,
        parser: ToolParser | None,
        reasoning: RequestReasoning | None,
        parallel: bool = True,
        strict: bool = False,
    ) -> None:
        self._reasoning: ReasoningStream | None = None
        if reasoning is not None and reasoning.active:
            self._reasoning = reasoning.stream()
        self._calls: ToolCallStream | None = parser.stream(strict=strict) if parser else None
        self._parallel = parallel
        self.items: list[dict[str, Any]] = []
        self._open: _Open | None = None
        self._space = ""  # whitespace with no item open: kept if text follows

    def feed(self, text: str, final: bool) -> list[Event]:
        reasoning, content = "", text
        if self._reasoning is not None:
            split = self._reasoning.feed(text, final=final)
            reasoning, content = split.reasoning, split.content
        events = self._write("reasoning", reasoning) if reasoning else []
        if self._calls is None:
            return events + self._text(content)
        out = self._calls.feed(content, final=final)
        events += self._text(out.content)
        for call in out.tool_calls:
            if call.index > 0 and not self._parallel:
                continue
            if call.name is not None:
                events += self._start(_function_call(call.name))
            if call.arguments and self._open is not None and self._open.kind == "function_call":
                events += self._write("function_call", call.arguments)
        return events

    def close(self, status: str = "completed") -> list[Event]:
        """Close the item still open (with ``status``); an output with no item gets a message
        (of the held whitespace, or empty)."""
        events, space = self._end(status), self._space
        if not self.items:
            events += self._start(_message()) + self._write("message", space)
            events += self._end(status)
        self._space = ""
        return events

    def _text(self, text: str) -> list[Event]:
        if not text:
            return []
        if self._open is None or self._open.kind != "message":
            if not text.strip():
                self._space += text
                return []
            text, self._space = self._space + text, ""
        return self._write("message", text)

    def _write(self, kind: str, piece: str) -> list[Event]:
        events = [] if self._open and self._open.kind == kind else self._start(_new(kind))
        assert self._open is not None
        self._open.pieces.append(piece)
        if piece:
            events.append(_delta(self._open, piece))
        return events

    def _start(self, item: dict[str, Any]) -> list[Event]:
        events = self._end("completed")
        self._space = ""  # whitespace before a new item (a call) is dropped
        self._open = _Open(item, len(self.items))
        self.items.append(item)
        events.append(
            {"type": "response.output_item.added", "output_index": self._open.index, "item": item}
        )
        part = _PARTS.get(str(item["type"]))
        if part is not None:
            events.append(_part_event("added", self._open, part("")))
        return events

    def _end(self, status: str) -> list[Event]:
        o, self._open = self._open, None
        if o is None:
            return []
        text = "".join(o.pieces)
        done = {**o.item, "status": status}
        head = {"item_id": o.item["id"], "output_index": o.index}
        events: list[Event] = []
        if o.kind == "function_call":
            done["arguments"] = text
            events.append(
                {"type": "response.function_call_arguments.done", **head, "arguments": text}
            )
        else:
            part = _PARTS[o.kind](text)
            done["content"] = [part]
            kind = "output_text" if o.kind == "message" else "reasoning_text"
            end = {"type": f"response.{kind}.done", **head, "content_index": 0, "text": text}
            if o.kind == "message":
                end["logprobs"] = []
            events += [end, _part_event("done", o, part)]
        self.items[o.index] = done
        events.append({"type": "response.output_item.done", "output_index": o.index, "item": done})
        return events


def _output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _reasoning_text(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


_PARTS = {"message": _output_text, "reasoning": _reasoning_text}


def _message() -> dict[str, Any]:
    return {
        "id": item_id("msg"),
        "type": "message",
        "role": "assistant",
        "status": "in_progress",
        "content": [],
    }


def _reasoning() -> dict[str, Any]:
    return {
        "id": item_id("rs"),
        "type": "reasoning",
        "summary": [],
        "content": [],
        "status": "in_progress",
    }


def _function_call(name: str) -> dict[str, Any]:
    return {
        "id": item_id("fc"),
        "type": "function_call",
        "call_id": item_id("call"),
        "name": name,
        "arguments": "",
        "status": "in_progress",
    }


def _new(kind: str) -> dict[str, Any]:
    return _message() if kind == "message" else _reasoning()


def _part_event(what: str, o: _Open, part: dict[str, Any]) -> Event:
    return {
        "type": f"response.content_part.{what}",
        "item_id": o.item["id"],
        "output_index": o.index,
        "content_index": 0,
        "part": part,
    }


def _delta(o: _Open, piece: str) -> Event:
    head = {"item_id": o.item["id"], "output_index": o.index}
    if o.kind == "function_call":
        return {"type": "response.function_call_arguments.delta", **head, "delta": piece}
    if o.kind == "reasoning":
        return {"type": "response.reasoning_text.delta", **head, "content_index": 0, "delta": piece}
    return {
        "type": "response.output_text.delta",
        **head,
        "content_index": 0,
        "delta": piece,
        "logprobs": [],
    }


# How a sequence's finish reason ends a response: its status, and what the object says why.
_INCOMPLETE = {"reason": "max_output_tokens"}
_ABORTED = {"code": "server_error", "message": "The engine aborted the request."}


class ResponseBuilder:
    """One Response object, from its first delta to its end: its output (:class:`OutputItems`),
    usage and status. ``echo``: the request's fields the object repeats."""

    def __init__(
        self,
        response_id: str,
        model: str,
        echo: dict[str, Any],
        output: OutputItems,
        reasoning: RequestReasoning | None,
    ) -> None:
        self.id = response_id
        self._model = model
        self._echo = echo
        self.output = output
        self._reasoning = reasoning
        self._counting = reasoning is not None and reasoning.active
        self._output_ids: list[int] = []
        self.created_at = int(time.time())
        self._num_prompt = self._num_cached = self._num_output = 0
        self.finish_reason: str | None = None

    def add(self, d: SequenceDelta) -> list[Event]:
        """Take one delta of the (only) sequence; the events it makes."""
        self._num_prompt = d.num_prompt_tokens
        self._num_cached = max(self._num_cached, d.num_cached_tokens)
        self._num_output += len(d.token_ids)
        if self._counting:
            self._output_ids.extend(d.token_ids)
        self.finish_reason = d.finish_reason or self.finish_reason
        return self.output.feed(d.text, final=d.finish_reason is not None)

    def finish(self) -> tuple[list[Event], dict[str, Any]]:
        """Close the output; the closing events and the final object (completed, incomplete
        when cut off by max_output_tokens or the context, failed when the engine aborted)."""
        status = {"length": "incomplete", "abort": "failed"}.get(self.finish_reason or "")
        status = status or "completed"
        events = self.output.close("incomplete" if status == "incomplete" else "completed")
        response = self.response(status, with_usage=True)
        if status == "incomplete":
            response["incomplete_details"] = dict(_INCOMPLETE)
        elif status == "failed":
            response["error"] = dict(_ABORTED)
        return events, response

    def failed(self, message: str) -> dict[str, Any]:
        """The object of a response whose generation failed after it began to stream."""
        response = self.response("failed", with_usage=True)
        response["error"] = {"code": "server_error", "message": message}
        return response

    def response(self, status: str, with_usage: bool = False) -> dict[str, Any]:
        """The Response object as it stands (``in_progress``: no output, no usage yet)."""
        done = status != "in_progress"
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "completed_at": int(time.time()) if status == "completed" else None,
            "status": status,
            "background": False,
            "error": None,
            "incomplete_details": None,
            "model": self._model,
            "output": list(self.output.items) if done else [],
            **self._echo,
            "usage": self._usage() if with_usage else None,
        }

    def _usage(self) -> dict[str, Any]:
        reasoning = 0
        if self._reasoning is not None:
            reasoning = self._reasoning.count_tokens(self._output_ids)
        return {
            "input_tokens": self._num_prompt,
            "input_tokens_details": {"cached_tokens": self._num_cached},
            "output_tokens": self._num_output,
            "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": self._num_prompt + self._num_output,
        }


def whole(
    text: str, token_ids: Sequence[int], finish_reason: str | None, num_prompt: int, num_cached: int
) -> SequenceDelta:
    """A whole sequence as one delta (a response that does not stream is built in one step)."""
    return SequenceDelta(
        index=0,
        prompt_index=0,
        text=text,
        token_ids=tuple(token_ids),
        logprobs=(),
        prompt_logprobs=(),
        finish_reason=finish_reason or "stop",
        stop_reason=None,
        num_prompt_tokens=num_prompt,
        num_cached_tokens=num_cached,
        first=True,
    )
