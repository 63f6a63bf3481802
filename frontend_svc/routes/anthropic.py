"""POST /v1/messages and POST /v1/messages/count_tokens: Anthropic's Messages API, as vLLM serves
it, on top of the chat path.

The body becomes a chat request (``frontend_svc.protocol.anthropic``); its prompt is rendered,
checked and generated as chat does it, and the reply is read as chat reads it: split into
reasoning and content by the server's ``--reasoning-parser``, the content read for tool calls by
the request's parser. What comes back is Anthropic's message: ``thinking``, ``text`` and
``tool_use`` blocks, in that order, and a ``stop_reason``::

    finish "length"                          -> "max_tokens"
    a call made (and not cut off)            -> "tool_use"
    a stop sequence matched                  -> "stop_sequence" (and ``stop_sequence`` says which)
    anything else (EOS, a stop token)        -> "end_turn"

Streamed, the same blocks come as Anthropic's events (each ``event: <type>`` + ``data``)::

    message_start                     the message, content empty, usage.input_tokens
    content_block_start  index i      {"type": "thinking" | "text" | "tool_use", ...}
    content_block_delta  index i      thinking_delta / text_delta / input_json_delta, repeated
    content_block_stop   index i      (the next block starts after it)
    message_delta                     stop_reason, stop_sequence, usage.output_tokens
    message_stop

An error is Anthropic's ``{"type": "error", "error": {"type", "message"}}`` (as an ``error``
event once a stream has begun). A client that leaves aborts the engine request, as in chat.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from frontend_svc.engine.errors import EngineCallError, EngineRequestError, EngineUnavailableError
from frontend_svc.errors import ApiError
from frontend_svc.generation.chat_run import ChatRun, chat_run, encode_chat
from frontend_svc.generation.run import ChoiceResult, collect, generate, random_id
from frontend_svc.protocol.anthropic import parse_count_tokens, parse_messages
from frontend_svc.protocol.requests import ChatRequest
from frontend_svc.reasoning import ReasoningStream
from frontend_svc.routes.anthropic_errors import PATH, error_body, error_response
from frontend_svc.routes.common import (
    as_api_error,
    first_delta,
    gateway,
    parse_body,
    prompt_encoder,
    require_task,
)
from frontend_svc.routes.sse import (
    ClientDisconnected,
    SSEResponse,
    sse_event,
    until_disconnected,
)
from frontend_svc.text.output_processor import SequenceDelta
from frontend_svc.tool_parsers import ToolCallStream

logger = logging.getLogger(__name__)


async def create_message(request: Request) -> Response:
    try:
        return await _create_message(request)
    except Exception as e:
        return _failure(request, e)


async def count_tokens(request: Request) -> Response:
    """``{"input_tokens": N}``: the prompt the same body would send to the engine."""
    try:
        state = gateway(request)
        tokenizer, info = state.require_engine()
        req = await parse_body(request, parse_count_tokens, info.max_logprobs)
        await state.resolve_model(req.model)
        prompt = await encode_chat(prompt_encoder(request), tokenizer, info, req)
        return JSONResponse({"input_tokens": prompt.num_tokens})
    except Exception as e:
        return _failure(request, e)


async def _create_message(request: Request) -> Response:
    state = gateway(request)
    tokenizer, info = state.require_engine()
    auto_tools = state.tool_parser is not None
    req = await parse_body(request, parse_messages, info.max_logprobs, auto_tools)
    lora = await state.resolve_model(req.model)  # the LoRA adapter it names, if any
    require_task(info, req.model, "generate", f"messages ({PATH})")
    encoded = await encode_chat(prompt_encoder(request), tokenizer, info, req)
    run = chat_run(state, tokenizer, info, req, encoded)
    reply = _Reply(
        req,
        _anthropic_id("msg"),
        lora or state.served_model_name or req.model,
        run,
    )
    deltas = generate(
        state, reply.id, [run.prompt], run.sampling, run.kept_ids, lora_name=lora or ""
    )
    if req.stream:
        return await _stream(request, deltas, reply)
    try:
        results = await until_disconnected(request, collect(deltas, 1))
    except ClientDisconnected:
        return Response(status_code=499)
    return JSONResponse(reply.whole(results[0]))


def _anthropic_id(prefix: str) -> str:
    """``<prefix>_`` and 32 random hex digits (Anthropic's ids: ``msg_...``, ``toolu_...``)."""
    return f"{prefix}_{random_id(prefix).rpartition('-')[2]}"


def _tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as the ``input`` object; {} when they are no JSON object (a call cut
    off by max_tokens)."""
    try:
        parsed = orjson.loads(arguments)
    except orjson.JSONDecodeError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


def _stop(finish: str | None, stop_reason: int | str | None, called: bool) -> dict[str, Any]:
    """``stop_reason`` and ``stop_sequence`` of a finished reply (see the module docstring)."""
    if finish == "length":
        return {"stop_reason": "max_tokens", "stop_sequence": None}
    if called:
        return {"stop_reason": "tool_use", "stop_sequence": None}
    if finish == "stop" and isinstance(stop_reason, str):  # a stop string (a token's is an int)
        return {"stop_reason": "stop_sequence", "stop_sequence": stop_reason}
    return {"stop_reason": "end_turn", "stop_sequence": None}


class _Reply:
    """The reply to one request: whole (:meth:`whole`) or as stream events (:meth:`start`,
    then :meth:`events` per delta)."""

    def __init__(self, req: ChatRequest, message_id: str, model: str, run: ChatRun) -> None:
        self.id = message_id
        self._model = model
        self._parallel = req.tools.parallel_tool_calls
        # tool_choice any or tool: the output is the calls' JSON, never text (chat's answer)
        self._constrained = req.tools.choice in ("required", "function")
        self._parser = run.parser
        self._reasoning = run.reasoning
        self._num_prompt_tokens = len(run.prompt.token_ids)
        # Streaming: the open block (its type; None before the first) and its index.
        self._block: str | None = None
        self._index = -1
        self._num_tokens = 0
        self._thinking: ReasoningStream | None = None
        if run.reasoning is not None and run.reasoning.active:
            self._thinking = run.reasoning.stream()
        self._calls: ToolCallStream | None = run.parser.stream() if run.parser else None

    def _message(self, content: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self._model,
            "content": content,
            **fields,
        }

    def whole(self, r: ChoiceResult) -> dict[str, Any]:
        thinking, content = self._reasoning.split(r.text) if self._reasoning else (None, r.text)
        calls = []
        if self._parser is not None and content is not None:
            extracted = self._parser.extract(content)
            calls = extracted.calls if self._parallel else extracted.calls[:1]
            if calls or self._constrained:
                content = None if self._constrained else extracted.content
        blocks: list[dict[str, Any]] = []
        if thinking:
            blocks.append({"type": "thinking", "thinking": thinking, "signature": ""})
        if content:
            blocks.append({"type": "text", "text": content})
        blocks += [
            {
                "type": "tool_use",
                "id": _anthropic_id("toolu"),
                "name": c.name,
                "input": _tool_input(c.arguments),
            }
            for c in calls
        ]
        usage = {"input_tokens": r.num_prompt_tokens, "output_tokens": len(r.token_ids)}
        stop = _stop(r.finish_reason, r.stop_reason, bool(calls))
        return self._message(blocks, **stop, usage=usage)

    def start(self) -> bytes:
        usage = {"input_tokens": self._num_prompt_tokens, "output_tokens": 0}
        message = self._message([], stop_reason=None, stop_sequence=None, usage=usage)
        return _event({"type": "message_start", "message": message})

    def events(self, d: SequenceDelta) -> list[bytes]:
        """The events of one delta: its pieces of reasoning, text and calls; at the end, the
        last block's stop, ``message_delta`` and ``message_stop``."""
        self._num_tokens += len(d.token_ids)
        final = d.finish_reason is not None
        text = d.text
        out: list[bytes] = []
        if self._thinking is not None:
            split = self._thinking.feed(text, final=final)
            if split.reasoning:
                out += self._piece("thinking", {"thinking": split.reasoning})
            text = split.content
        called = False
        if self._calls is None:
            if text:
                out += self._piece("text", {"text": text})
        else:
            fed = self._calls.feed(text, final=final)
            if fed.content and not self._constrained:
                out += self._piece("text", {"text": fed.content})
            for call in fed.tool_calls:
                if not self._parallel and call.index > 0:
                    continue
                if call.id is not None:
                    block: dict[str, Any] = {
                        "id": _anthropic_id("toolu"),
                        "name": call.name,
                        "input": {},
                    }
                    out += self._open("tool_use", block)
                if call.arguments:
                    out += self._delta("input_json_delta", {"partial_json": call.arguments})
            called = self._calls.num_calls > 0
        if final:
            out += self._close()
            usage = {"output_tokens": self._num_tokens}
            delta = _stop(d.finish_reason, d.stop_reason, called)
            out.append(_event({"type": "message_delta", "delta": delta, "usage": usage}))
            out.append(_event({"type": "message_stop"}))
        return out

    def _piece(self, block: str, fields: dict[str, Any]) -> list[bytes]:
        """A piece of a thinking or text block (opening it unless it is the open one)."""
        out = [] if self._block == block else self._open(block, {k: "" for k in fields})
        return out + self._delta(f"{block}_delta", fields)

    def _open(self, block: str, fields: dict[str, Any]) -> list[bytes]:
        out = self._close()
        self._block, self._index = block, self._index + 1
        content = {"type": block, **fields}
        if block == "thinking":
            content["signature"] = ""
        event = {"type": "content_block_start", "index": self._index, "content_block": content}
        return [*out, _event(event)]

    def _delta(self, kind: str, fields: dict[str, Any]) -> list[bytes]:
        delta = {"type": kind, **fields}
        return [_event({"type": "content_block_delta", "index": self._index, "delta": delta})]

    def _close(self) -> list[bytes]:
        if self._block is None:
            return []
        self._block = None
        return [_event({"type": "content_block_stop", "index": self._index})]


def _event(payload: dict[str, Any]) -> bytes:
    """An SSE event as Anthropic sends them: ``event:`` names the payload's type."""
    return b"event: " + payload["type"].encode() + b"\n" + sse_event(payload)


async def _stream(
    request: Request, deltas: AsyncIterator[SequenceDelta], reply: _Reply
) -> Response:
    """Start streaming once the first delta is in (an early engine error gets a real status),
    as ``routes.common.stream_sse`` does; a later error is an ``error`` event."""
    retry_after_s = gateway(request).config.retry_after_s
    started = await first_delta(request, deltas)
    if started is None:
        return Response(status_code=499)  # the client left before the first delta
    watcher, first = started

    async def events() -> AsyncIterator[bytes]:
        try:
            yield reply.start()
            async with contextlib.aclosing(deltas):  # type: ignore[type-var]
                delta = first
                while delta is not None:
                    for event in reply.events(delta):
                        yield event
                    delta = await anext(deltas, None)
        except Exception as e:
            logger.info("stream failed after it began: %r", e)
            yield _event(error_body(as_api_error(e, retry_after_s)))

    return SSEResponse(events(), watcher=watcher, closing=getattr(deltas, "aclose", None))


def _failure(request: Request, e: Exception) -> Response:
    if not isinstance(e, ApiError) and not _expected(e):
        logger.exception("unhandled error on %s", request.url.path)
    retry_after_s = gateway(request).config.retry_after_s
    return error_response(as_api_error(e, retry_after_s), retry_after_s)


def _expected(e: Exception) -> bool:
    """Engine failures (mapped to their status, as the app's handlers map them)."""
    return isinstance(e, (EngineRequestError, EngineUnavailableError, EngineCallError))
