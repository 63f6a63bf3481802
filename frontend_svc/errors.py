"""HTTP errors in the OpenAI error shape ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse

from frontend_svc.engine_types import EngineErrorCode, EngineRequestError, EngineUnavailableError


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


def invalid_parameter(message: str, param: str | None) -> ApiError:
    return ApiError(400, message, type="invalid_request_error", param=param)


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
    return ApiError(500, error.message, type="internal_error", code=error.code.value)
