"""HTTP errors in the OpenAI error shape ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from starlette.responses import JSONResponse

from frontend_svc.engine.errors import EngineCallError, EngineRequestError, EngineUnavailableError
from protos.types import EngineErrorCode


class ApiError(Exception):
    """An error answered to the client; raise it anywhere under a route."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str,
        param: str | None = None,
        code: str | int | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def invalid_parameter(message: str, param: str | None, code: str | None = None) -> ApiError:
    return ApiError(400, message, type="invalid_request_error", param=param, code=code)


def body_too_large(limit: int) -> ApiError:
    """413; the connection is closed, so the rest of the body is never read."""
    return ApiError(
        413,
        f"The request body is larger than this server's limit of {limit} bytes.",
        type="invalid_request_error",
        code="request_too_large",
        headers={"Connection": "close"},
    )


def headers_too_large(limit: int) -> ApiError:
    return ApiError(
        431,
        f"The request headers are larger than this server's limit of {limit} bytes.",
        type="invalid_request_error",
        code="request_header_fields_too_large",
        headers={"Connection": "close"},
    )


def unsupported_media_type(content_type: str) -> ApiError:
    return ApiError(
        415,
        f"Unsupported Content-Type '{content_type[:100]}'; send the body as application/json.",
        type="invalid_request_error",
        code="unsupported_media_type",
    )


def from_http_status(
    status: int, method: str, path: str, detail: str, headers: Mapping[str, str] | None
) -> ApiError:
    """Errors raised by the router itself: 404 unknown route, 405 wrong method (keeps Allow)."""
    path = path[:200]
    if status == 404:
        message = f"Invalid URL ({method} {path})."
    elif status == 405:
        allowed = (headers or {}).get("Allow", "")
        message = f"Method {method} is not allowed for {path}; allowed: {allowed}."
    else:
        message = detail
    return ApiError(status, message, type="invalid_request_error", headers=dict(headers or {}))


def model_not_found(model: str) -> ApiError:
    return ApiError(
        404,
        f"The model `{model}` does not exist.",
        type="invalid_request_error",
        param="model",
        code="model_not_found",
    )


def unauthorized() -> ApiError:
    return ApiError(
        401,
        "Incorrect or missing API key; send 'Authorization: Bearer <key>'.",
        type="invalid_request_error",
        code="invalid_api_key",
    )


def engine_unavailable(detail: str) -> ApiError:
    return ApiError(
        503,
        f"The engine is unavailable: {detail}",
        type="service_unavailable_error",
        code="engine_unavailable",
    )


def from_engine_error(error: Exception, retry_after_s: int) -> ApiError:
    """Map an engine-side failure to the HTTP error the client sees."""
    if isinstance(error, EngineUnavailableError):
        return engine_unavailable(str(error))
    if isinstance(error, EngineCallError):
        return from_call_error(error)
    if not isinstance(error, EngineRequestError):
        return ApiError(500, f"Internal error: {error!r}", type="internal_error")
    if error.code is EngineErrorCode.RESOURCE_EXHAUSTED:
        return ApiError(
            429,
            f"The engine's queue is full; retry later. ({error.message})",
            type="rate_limit_error",
            code="rate_limit_exceeded",
            headers={"Retry-After": str(retry_after_s)},
        )
    if error.code in (EngineErrorCode.INVALID_ARGUMENT, EngineErrorCode.CONTEXT_LENGTH_EXCEEDED):
        return ApiError(400, error.message, type="invalid_request_error", code=error.code.value)
    if error.code is EngineErrorCode.UNAVAILABLE:
        return engine_unavailable(error.message)
    if error.code is EngineErrorCode.DUPLICATE_REQUEST_ID:
        return ApiError(409, error.message, type="invalid_request_error", code=error.code.value)
    if error.code is EngineErrorCode.NOT_FOUND:  # the request's LoRA adapter is not loaded
        return ApiError(
            404, error.message, type="invalid_request_error", param="model", code="model_not_found"
        )
    return ApiError(500, error.message, type="internal_error", code=error.code.value)


# A refused adapter or utility call: 400 for what the caller asked wrong (a bad adapter
# directory, a name in use, a profile that is not running ...), as vLLM answers a failed load.
_CALL_STATUS = {
    EngineErrorCode.INVALID_ARGUMENT: 400,
    EngineErrorCode.ALREADY_EXISTS: 400,
    EngineErrorCode.FAILED_PRECONDITION: 400,
    EngineErrorCode.RESOURCE_EXHAUSTED: 400,  # e.g. a pin when every device slot is pinned
    EngineErrorCode.NOT_FOUND: 404,
}


def from_call_error(error: EngineCallError) -> ApiError:
    """An engine's refusal of an adapter or utility call, with the engine's own message (it
    names the file of a bad adapter directory)."""
    if error.code is EngineErrorCode.UNIMPLEMENTED:
        return ApiError(
            501,
            f"The engine does not support this call: the engine at {error.address} does not "
            f"implement {error.rpc} (an older engine); upgrade it. ({error.message})",
            type="not_implemented_error",
            code="not_implemented",
        )
    if error.code is EngineErrorCode.UNAVAILABLE:
        return engine_unavailable(error.message)
    status = _CALL_STATUS.get(error.code)
    if status is None:
        return ApiError(500, error.message, type="internal_error", code=error.code.value)
    return ApiError(status, error.message, type="invalid_request_error", code=error.code.value)
