"""Helpers shared by the generation routes: body parsing, streaming plumbing, error mapping."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any, TypeVar

import orjson
from starlette.requests import Request
from starlette.responses import Response

from frontend_svc.errors import (
    ApiError,
    from_engine_error,
    invalid_parameter,
    unsupported_media_type,
)
from frontend_svc.generation.run import UsageCounter
from frontend_svc.protocol import ResponseOptions
from frontend_svc.routes.sse import (
    DONE_EVENT,
    ClientDisconnected,
    DisconnectWatcher,
    SSEResponse,
    TextEvents,
    sse_event,
)
from frontend_svc.server.state import GatewayState
from frontend_svc.text.output_processor import SequenceDelta
from frontend_svc.text.prompt_encoder import PromptEncoder
from protos.types import ModelInfo

T = TypeVar("T")
logger = logging.getLogger(__name__)


def gateway(request: Request) -> GatewayState:
    state: GatewayState = request.app.state.gateway
    return state


def prompt_encoder(request: Request) -> PromptEncoder:
    encoder: PromptEncoder = request.app.state.prompt_encoder
    return encoder


def with_server_defaults(
    state: GatewayState, options: ResponseOptions, stream: bool
) -> ResponseOptions:
    """The request's response options with the server's flags applied
    (``--enable-force-include-usage``, ``--return-tokens-as-token-ids``)."""
    config = state.config
    return options.with_server_defaults(
        stream,
        config.enable_force_include_usage,
        config.return_tokens_as_token_ids,
        config.enable_prompt_tokens_details,
    )


def running_usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """The usage on every chunk with ``continuous_usage_stats``: the choice's prompt and its
    output so far (vLLM's)."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


# Bodies this big are parsed and validated in the worker pool: a 4 MiB list of token ids is ~2M
# Python ints, ~30 ms to parse and ~40 ms to check, and the pool keeps that off the event loop
# (Python-level work there yields the GIL every few ms; orjson's parse holds it, but briefly).
BIG_BODY_BYTES = 256 * 2**10


async def parse_body(request: Request, parse: Callable[..., T], *args: Any) -> T:
    """The JSON body turned into a request object by ``parse(body, *args)``.

    415 unless it is sent as JSON (a missing Content-Type counts as JSON, as curl-style clients
    often omit it; ``application/*+json`` types are JSON too); 400 for a body that is not JSON
    (orjson: also nesting deeper than 1024, numbers beyond float range, lone surrogates).
    """
    content_type = request.headers.get("content-type", "")
    media_type = content_type.split(";")[0].strip().lower()
    if media_type and not (
        media_type == "application/json"
        or (media_type.startswith("application/") and media_type.endswith("+json"))
    ):
        raise unsupported_media_type(content_type)
    body = await request.body()  # at most --max-body-bytes (frontend_svc.server.limits)
    if len(body) < BIG_BODY_BYTES:
        return parse(loads(body), *args)
    return await prompt_encoder(request).run(lambda: parse(loads(body), *args))


def require_task(
    info: ModelInfo, model: str, task: str, what: str, param: str | None = "model"
) -> None:
    """400 naming the tasks the model serves, unless it serves ``task``."""
    if task not in info.supported_tasks:
        raise ApiError(
            400,
            f"The model '{model}' does not support {what}; it serves: "
            f"{', '.join(info.supported_tasks)}.",
            type="invalid_request_error",
            param=param,
            code="unsupported_task",
        )


def loads(body: bytes) -> Any:
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise invalid_parameter(f"The request body is not valid JSON: {e}", None) from e


def as_api_error(error: Exception, retry_after_s: int) -> ApiError:
    return error if isinstance(error, ApiError) else from_engine_error(error, retry_after_s)


ChunkBuilder = Callable[[SequenceDelta], list[dict[str, Any]]]


async def first_delta(
    request: Request, deltas: AsyncIterator[SequenceDelta]
) -> tuple[DisconnectWatcher, SequenceDelta | None] | None:
    """The stream's first delta (None: it ended without one), awaited under a disconnect
    watcher that lasts until the response ends (``SSEResponse`` closes it), so an engine error
    before it is still an HTTP status. None when the client left first (answer 499). Every
    streaming route starts this way."""
    watcher = DisconnectWatcher(request.receive)
    try:
        return watcher, await watcher.guard(deltas.__anext__())
    except ClientDisconnected:
        watcher.close()
        return None
    except StopAsyncIteration:
        return watcher, None
    except BaseException:
        watcher.close()
        raise


async def stream_sse(
    request: Request,
    deltas: AsyncIterator[SequenceDelta],
    to_chunks: ChunkBuilder,
    usage_chunk: Callable[[dict[str, Any]], dict[str, Any]] | None,
    text_event: Callable[[SequenceDelta], bytes | None] | None = None,
) -> Response:
    """Start streaming once the first delta is in (so early engine errors get a real status).

    Later errors become an error event; the stream always ends with ``data: [DONE]``.
    ``text_event``: a delta's event as bytes when only its text is new (see ``TextEvents``),
    else None and ``to_chunks`` builds it.
    """
    state = gateway(request)
    started = await first_delta(request, deltas)
    if started is None:
        return Response(status_code=499)  # the client left before the first delta
    watcher, first = started

    async def events() -> AsyncIterator[bytes]:
        usage = UsageCounter(details=state.config.enable_prompt_tokens_details)
        try:
            if first is not None:
                async with _closing(deltas):
                    delta = first
                    while True:
                        if usage_chunk is not None:  # counted only for the usage chunk
                            usage.add(delta)
                        event = text_event(delta) if text_event is not None else None
                        if event is not None:
                            yield event
                        else:
                            for chunk in to_chunks(delta):
                                yield sse_event(chunk)
                        try:
                            delta = await deltas.__anext__()
                        except StopAsyncIteration:
                            break
            if usage_chunk is not None:
                yield sse_event(usage_chunk(usage.as_dict()))
        except Exception as e:
            logger.info("stream failed after it began: %r", e)
            yield sse_event(as_api_error(e, state.config.retry_after_s).body())
        yield DONE_EVENT

    # Closed by the response however it ends, also when the client left before the first event
    # (the events never start then, so their own closing of the deltas never runs).
    closing = getattr(deltas, "aclose", None)
    return SSEResponse(events(), watcher=watcher, closing=closing)


class PlainTextEvents:
    """A call's pre-encoded events (``TextEvents``, one per choice) for the chunks of a plain
    stream that only carry new text: neither a choice's first chunk nor its last, and nothing
    per token but the text (``plain``: the call asked for no logprobs, token ids, tools or
    running usage). ``chunks``: the route's chunk builder, which also makes each template."""

    def __init__(self, plain: bool, chunks: ChunkBuilder) -> None:
        self._plain = plain
        self._chunks = chunks
        self._by_choice: dict[int, TextEvents] = {}

    def event(self, d: SequenceDelta) -> bytes | None:
        """``d``'s event, the bytes ``chunks`` + ``sse_event`` give; None: not such a chunk.
        (The route's running token counts are skipped: only running usage reads them.)"""
        plain_middle = d.text and not d.first and d.finish_reason is None and d.stop_reason is None
        if not (self._plain and plain_middle):
            return None
        events = self._by_choice.get(d.index)
        if events is None:  # the choice's chunk, built once with a stand-in for the text
            template = self._chunks(replace(d, text=TextEvents.TEXT, token_ids=(), logprobs=()))
            events = self._by_choice[d.index] = TextEvents(template[0])
        return events.event(d.text)


class _closing:
    """``contextlib.aclosing`` for any async iterator with ``aclose``."""

    def __init__(self, it: AsyncIterator[Any]) -> None:
        self._it = it

    async def __aenter__(self) -> AsyncIterator[Any]:
        return self._it

    async def __aexit__(self, *exc: object) -> None:
        aclose = getattr(self._it, "aclose", None)
        if aclose is not None:
            await aclose()
