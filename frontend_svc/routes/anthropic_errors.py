"""Errors on Anthropic's routes (/v1/messages and below) in Anthropic's shape,
``{"type": "error", "error": {"type", "message"}}``, whoever raises them: the routes, the API-key
check, the router (404, 405) and the HTTP limits (413, 431) ahead of every route.

An unavailable engine (503 elsewhere) is Anthropic's 529 ``overloaded_error``, which its clients
retry (with a Retry-After)."""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse

from frontend_svc.errors import ApiError

PATH = "/v1/messages"


def is_anthropic_path(path: str) -> bool:
    """Whether ``path`` is one of this API's (its errors then take Anthropic's shape)."""
    return path == PATH or path.startswith(PATH + "/")


# Anthropic's error types by HTTP status; any other 4xx is an invalid request, a 5xx an API error.
_ERROR_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    529: "overloaded_error",
}


def _status(error: ApiError) -> int:
    """An unavailable engine (503) is Anthropic's 529 ``overloaded_error``, which its clients
    retry; the rest keep their status."""
    return 529 if error.status == 503 else error.status


def error_body(error: ApiError) -> dict[str, Any]:
    """``error`` in Anthropic's shape."""
    status = _status(error)
    kind = _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def error_response(error: ApiError, retry_after_s: int) -> JSONResponse:
    status, body = _status(error), error_body(error)
    headers = dict(error.headers)
    if status == 529:
        headers.setdefault("Retry-After", str(retry_after_s))
    return JSONResponse(body, status_code=status, headers=headers)


def authentication_error() -> ApiError:
    """The 401 of a request without the server's API key."""
    return ApiError(
        401,
        "Incorrect or missing API key; send 'x-api-key: <key>' or 'Authorization: Bearer <key>'.",
        type="authentication_error",
    )
