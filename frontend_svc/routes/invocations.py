"""POST /invocations: SageMaker's one inference path, as vLLM serves it. The body's shape says
which API it is for, and that route answers it unchanged:

* ``messages``: chat completions;
* ``prompt``: completions;
* ``input``: embeddings;
* ``query`` with ``documents``: rerank;
* ``queries`` or ``text_1``: score.

Anything else is a 400 that lists the shapes.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import orjson
from starlette.requests import Request
from starlette.responses import Response

from frontend_svc.errors import ApiError
from frontend_svc.routes import chat, completions, pooling, scoring

Handler = Callable[[Request], Awaitable[Response]]
_SHAPES: tuple[tuple[tuple[str, ...], Handler], ...] = (
    (("messages",), chat.create_chat_completion),
    (("prompt",), completions.create_completion),
    (("input",), pooling.create_embedding),
    (("query", "documents"), scoring.rerank),
    (("queries",), scoring.create_score),
    (("text_1",), scoring.create_score),
)


async def invocations(request: Request) -> Response:
    try:
        body = orjson.loads(await request.body())  # kept by the request: the route reads it again
    except orjson.JSONDecodeError:
        body = None
    if isinstance(body, dict):
        for fields, handler in _SHAPES:
            if all(f in body for f in fields):
                return await handler(request)
    raise ApiError(
        400,
        "/invocations takes the body of one of: chat completions (messages), completions "
        "(prompt), embeddings (input), rerank (query and documents), score (queries or text_1).",
        type="invalid_request_error",
    )
