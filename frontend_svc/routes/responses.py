"""POST /v1/responses (OpenAI's Responses API), and GET / DELETE of a stored response and its
input items.

A call runs as the chat completion it spells (``frontend_svc.protocol.responses``): the same
template, prompt checks, engine request, reasoning split and tool-call parsing as
/v1/chat/completions, one sequence. Its answer is a Response object
(``routes.responses_output``), whole or as typed events (``event: <type>`` and ``data`` with
``type`` and ``sequence_number``): ``response.created``, ``response.in_progress``, each output
item's events, then ``response.completed`` (``response.incomplete`` when cut off,
``response.failed`` when the engine failed after the stream began). A stream starts once the
first token is in, so early failures keep their HTTP status; a client that leaves aborts the
engine request.

With ``store`` (the default) the finished object is kept (``frontend_svc.responses_store``) for
``GET /v1/responses/{id}``, ``GET /v1/responses/{id}/input_items`` and a later call's
``previous_response_id``, which continues its conversation (its instructions are not carried).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from frontend_svc.config import FrontendConfig
from frontend_svc.errors import ApiError, invalid_parameter
from frontend_svc.generation.chat_run import ChatRun, chat_run, encode_chat
from frontend_svc.generation.run import collect, generate
from frontend_svc.protocol.requests import ChatRequest
from frontend_svc.protocol.responses import parse_responses
from frontend_svc.protocol.responses_items import item_id
from frontend_svc.responses_store import ResponseStore, StoredResponse
from frontend_svc.routes.common import (
    as_api_error,
    first_delta,
    gateway,
    parse_body,
    prompt_encoder,
    require_task,
)
from frontend_svc.routes.responses_output import Event, OutputItems, ResponseBuilder, whole
from frontend_svc.routes.sse import (
    ClientDisconnected,
    SSEResponse,
    sse_event,
    until_disconnected,
)
from frontend_svc.server.state import GatewayState
from frontend_svc.text.output_processor import SequenceDelta

logger = logging.getLogger(__name__)

MAX_INPUT_ITEMS_LIMIT = 100  # OpenAI's page size limit for input_items


def routes(config: FrontendConfig) -> list[Route]:
    """The Responses API's routes, sharing one store of the size the flags say."""
    api = ResponsesApi(
        ResponseStore(config.responses_store_max_entries, config.responses_store_max_bytes)
    )
    return [
        Route("/v1/responses", api.create, methods=["POST"]),
        Route("/v1/responses/{response_id}", api.retrieve, methods=["GET"]),
        Route("/v1/responses/{response_id}", api.delete, methods=["DELETE"]),
        Route("/v1/responses/{response_id}/input_items", api.input_items, methods=["GET"]),
    ]


class ResponsesApi:
    def __init__(self, store: ResponseStore) -> None:
        self.store = store

    async def create(self, request: Request) -> Response:
        state = gateway(request)
        tokenizer, info = state.require_engine()
        auto_tools = state.tool_parser is not None
        req = await parse_body(request, parse_responses, auto_tools)
        lora = await state.resolve_model(req.model)  # the LoRA adapter it names, if any
        require_task(info, req.model, "generate", "responses (/v1/responses)")
        context = self._conversation(req.previous_response_id)
        chat = req.chat_request(context)
        run = await _prepare(request, state, chat)
        response_id = item_id("resp")
        output = OutputItems(
            run.parser, run.reasoning, chat.tools.parallel_tool_calls, strict=not req.stream
        )
        model = lora or state.served_model_name or req.model
        builder = ResponseBuilder(response_id, model, req.echo, output, run.reasoning)
        deltas = generate(
            state, response_id, [run.prompt], run.sampling, run.kept_ids, lora_name=lora or ""
        )

        def keep(response: dict[str, Any]) -> None:
            if req.store:
                entry = StoredResponse.of(response, list(req.input_items), context)
                self.store.put(response_id, entry)

        if req.stream:
            return await _stream(request, state, deltas, builder, keep)
        try:
            results = await until_disconnected(request, collect(deltas, 1))
        except ClientDisconnected:
            return Response(status_code=499)
        r = results[0]
        builder.add(
            whole(r.text, r.token_ids, r.finish_reason, r.num_prompt_tokens, r.num_cached_tokens)
        )
        _, response = builder.finish()
        keep(response)
        return JSONResponse(response)

    async def retrieve(self, request: Request) -> Response:
        if request.query_params.get("stream", "false").lower() not in ("false", "0"):
            raise invalid_parameter("Streaming a stored response is not supported.", "stream")
        entry = self._stored(request.path_params["response_id"])
        return Response(entry.response, media_type="application/json")

    async def delete(self, request: Request) -> Response:
        response_id = request.path_params["response_id"]
        if not self.store.delete(response_id):
            raise _not_found(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    async def input_items(self, request: Request) -> Response:
        """A page of the response's own input items (not those of the conversation it
        continued): ``limit`` (1 to 100, default 20), ``order`` (``desc``, the default, or
        ``asc``), ``after`` (an item id: the page starts after it)."""
        entry = self._stored(request.path_params["response_id"])
        query = request.query_params
        limit = _limit(query.get("limit"))
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise invalid_parameter(
                f"'order' must be 'asc' or 'desc', got '{order[:40]}'.", "order"
            )
        items: list[dict[str, Any]] = orjson.loads(entry.input_items)
        if order == "desc":
            items.reverse()
        start = 0
        after = query.get("after")
        if after is not None:
            ids = [item["id"] for item in items]
            if after not in ids:
                raise invalid_parameter(
                    f"'after' must be the id of one of the response's input items, got "
                    f"'{after[:80]}'.",
                    "after",
                )
            start = ids.index(after) + 1
        page = items[start : start + limit]
        return JSONResponse(
            {
                "object": "list",
                "data": page,
                "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None,
                "has_more": start + limit < len(items),
            }
        )

    def _stored(self, response_id: str) -> StoredResponse:
        entry = self.store.get(response_id)
        if entry is None:
            raise _not_found(response_id)
        return entry

    def _conversation(self, previous_response_id: str | None) -> list[dict[str, Any]]:
        """The items of the conversation a call continues (none without a previous id)."""
        if previous_response_id is None:
            return []
        entry = self.store.get(previous_response_id)
        if entry is None:
            raise ApiError(
                404,
                f"Previous response with id '{previous_response_id[:100]}' not found (never "
                "stored, deleted, or evicted from this server's store).",
                type="invalid_request_error",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        return entry.conversation()


def _not_found(response_id: str) -> ApiError:
    return ApiError(
        404,
        f"Response with id '{response_id[:100]}' not found.",
        type="invalid_request_error",
        param="response_id",
        code="not_found",
    )


def _limit(raw: str | None) -> int:
    if raw is None:
        return 20
    try:
        limit = int(raw)
    except ValueError:
        limit = 0
    if not 1 <= limit <= MAX_INPUT_ITEMS_LIMIT:
        raise invalid_parameter(
            f"'limit' must be an integer in [1, {MAX_INPUT_ITEMS_LIMIT}], got '{raw[:40]}'.",
            "limit",
        )
    return limit


async def _prepare(request: Request, state: GatewayState, chat: ChatRequest) -> ChatRun:
    """The chat route's preparation (``generation.chat_run``), the template's refusal of the
    conversation named as the input."""
    tokenizer, info = state.require_engine()
    try:
        encoded = await encode_chat(prompt_encoder(request), tokenizer, info, chat)
    except ApiError as e:
        if e.param != "messages":
            raise
        raise invalid_parameter(e.message, "input") from e
    return chat_run(state, tokenizer, info, chat, encoded, prompt_param="input")


async def _stream(
    request: Request,
    state: GatewayState,
    deltas: AsyncIterator[SequenceDelta],
    builder: ResponseBuilder,
    keep: Callable[[dict[str, Any]], None],
) -> Response:
    """The call as typed events, begun once the first delta is in (an engine's refusal before
    it is still an HTTP error)."""
    started = await first_delta(request, deltas)
    if started is None:
        return Response(status_code=499)  # the client left before the first delta
    watcher, first = started

    async def events() -> AsyncIterator[bytes]:
        numbers = itertools.count()

        def sse(event: Event) -> bytes:
            kind = event["type"]
            return f"event: {kind}\n".encode() + sse_event(
                {"type": kind, "sequence_number": next(numbers), **event}
            )

        yield sse({"type": "response.created", "response": builder.response("in_progress")})
        yield sse({"type": "response.in_progress", "response": builder.response("in_progress")})
        try:
            async with contextlib.aclosing(deltas):  # type: ignore[type-var]
                delta = first
                while delta is not None:
                    for event in builder.add(delta):
                        yield sse(event)
                    delta = await anext(deltas, None)
            closing, response = builder.finish()
            for event in closing:
                yield sse(event)
        except Exception as e:
            logger.info("response stream failed after it began: %r", e)
            response = builder.failed(as_api_error(e, state.config.retry_after_s).message)
        keep(response)  # before the last event: a client that reads it can GET it at once
        yield sse({"type": f"response.{response['status']}", "response": response})

    # Closed by the response however it ends, also when the client left before the first event.
    closing = getattr(deltas, "aclose", None)
    return SSEResponse(events(), watcher=watcher, closing=closing)
