"""HTTP limits, checked before any route runs: header size (431), body size (413), Retry-After;
and after a big request, freed memory handed back to the OS (``native_memory``).

The body cap holds whether the client announces a Content-Length (refused before a byte of the
body is read) or streams a chunked body (refused as soon as what was read passes the cap; uvicorn
reads only as fast as the app consumes, so the rest is never buffered). Both answers close the
connection. uvicorn (h11) answers request heads above its own buffer limit with a text/plain 400
before the app sees them; ``uvicorn_options`` raises that buffer to a hard bound above our limit,
so heads in between get a proper 431 here.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from frontend_svc.config import LimitsConfig
from frontend_svc.errors import ApiError, body_too_large, headers_too_large
from protos.native_memory import trim_heap

HEAD_HARD_BOUND_FACTOR = 8  # uvicorn drops heads over 8x --max-header-bytes without the app
TRIM_AFTER_BODY_BYTES = 256 * 2**10  # after a bigger request, hand freed memory back to the OS


def uvicorn_options(limits: LimitsConfig) -> dict[str, Any]:
    """Keyword arguments for ``uvicorn.run`` / ``uvicorn.Config`` that go with these limits."""
    return {"h11_max_incomplete_event_size": HEAD_HARD_BOUND_FACTOR * limits.max_header_bytes}


# The response to an error answered here, in the shape the request's route speaks.
ErrorResponse = Callable[[Scope, ApiError], Response]


def _openai_shape(scope: Scope, error: ApiError) -> Response:
    return error.response()


class RequestLimitsMiddleware:
    """431 for big heads, 413 for big bodies, and a Retry-After header on every 503.
    ``respond``: the error's response for the request (default: OpenAI's shape)."""

    def __init__(
        self,
        app: ASGIApp,
        limits: LimitsConfig,
        retry_after_s: int,
        respond: ErrorResponse = _openai_shape,
    ) -> None:
        self.app = app
        self.respond = respond
        self.max_body = limits.max_body_bytes
        self.max_head = limits.max_header_bytes
        self.retry_after = str(retry_after_s).encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers: list[tuple[bytes, bytes]] = scope["headers"]
        if sum(len(k) + len(v) + 4 for k, v in headers) > self.max_head:
            await self.respond(scope, headers_too_large(self.max_head))(scope, receive, send)
            return
        length = next((v for k, v in headers if k == b"content-length"), None)
        if length is not None and length.isdigit() and int(length) > self.max_body:
            await self.respond(scope, body_too_large(self.max_body))(scope, receive, send)
            return
        received = [0]
        try:
            await self.app(scope, self._capped(receive, received), self._with_retry_after(send))
        finally:
            if received[0] >= TRIM_AFTER_BODY_BYTES:
                # What such a request allocated is freed by now but kept by the C library.
                await asyncio.get_running_loop().run_in_executor(None, trim_heap)

    def _capped(self, receive: Receive, received: list[int]) -> Receive:
        async def capped_receive() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                received[0] += len(message.get("body", b""))
                if received[0] > self.max_body:
                    # the route's read fails; answered 413 by the route (in its shape)
                    raise body_too_large(self.max_body)
            return message

        return capped_receive

    def _with_retry_after(self, send: Send) -> Send:
        async def send_with_retry_after(message: Message) -> None:
            if message["type"] == "http.response.start" and message["status"] == 503:
                headers = list(message.get("headers", []))
                if not any(k.lower() == b"retry-after" for k, _ in headers):
                    message = {**message, "headers": [*headers, (b"retry-after", self.retry_after)]}
            await send(message)

        return send_with_retry_after
