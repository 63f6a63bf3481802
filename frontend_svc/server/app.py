"""The Starlette application: routes, HTTP limits, API-key check, error handlers, lifespan."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from frontend_svc.config import FrontendConfig
from frontend_svc.engine.errors import EngineCallError, EngineRequestError, EngineUnavailableError
from frontend_svc.errors import ApiError, from_engine_error, from_http_status, unauthorized
from frontend_svc.routes import (
    adapters,
    anthropic,
    anthropic_errors,
    chat,
    chat_batch,
    completions,
    invocations,
    pooling,
    responses,
    scoring,
    system,
    tokenize,
    utility,
)
from frontend_svc.server.limits import RequestLimitsMiddleware
from frontend_svc.server.load_report import (
    LoadReportMiddleware,
    RootPathMiddleware,
    route_path,
)
from frontend_svc.server.openapi import PUBLIC_PATHS
from frontend_svc.server.state import GatewayState
from frontend_svc.text.prompt_encoder import PromptEncoder

logger = logging.getLogger(__name__)


class ApiKeyMiddleware:
    """401 for every route but the public ones unless ``Authorization: Bearer <key>`` or
    ``x-api-key: <key>`` (Anthropic's header) matches; in Anthropic's shape on its routes."""

    def __init__(self, app: ASGIApp, state: GatewayState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and route_path(scope) not in PUBLIC_PATHS:
            headers = dict(scope["headers"])
            auth = headers.get(b"authorization", b"").decode("latin-1") or None
            key = headers.get(b"x-api-key", b"").decode("latin-1")
            if not (
                self.state.api_key_ok(auth) or (key and self.state.api_key_ok(f"Bearer {key}"))
            ):
                if anthropic_errors.is_anthropic_path(route_path(scope)):
                    error = anthropic_errors.authentication_error()
                    retry_after_s = self.state.config.retry_after_s
                    response = anthropic_errors.error_response(error, retry_after_s)
                else:
                    response = unauthorized().response()
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(config: FrontendConfig, freeze_gc_heap: bool = False) -> Starlette:
    """The gateway app; it connects to the engine in the background once started.
    ``freeze_gc_heap``: see ``GatewayState`` (what ``python -m frontend_svc`` asks for)."""
    state = GatewayState(config, freeze_gc_heap)
    encoder = PromptEncoder(config.limits.tokenizer_threads)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        state.engines.start()
        try:
            yield
        finally:
            encoder.close()
            await state.engines.close()

    async def api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        return exc.response()

    def shaped(scope: Scope, error: ApiError) -> Response:
        """``error`` in the shape of the request's API: Anthropic's on its routes."""
        if anthropic_errors.is_anthropic_path(route_path(scope)):
            return anthropic_errors.error_response(error, config.retry_after_s)
        return error.response()

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)  # the router's 404 and 405
        error = from_http_status(
            exc.status_code, request.method, request.url.path, exc.detail, exc.headers
        )
        return shaped(request.scope, error)

    async def engine_error(request: Request, exc: Exception) -> Response:
        return from_engine_error(exc, config.retry_after_s).response()

    async def unexpected(request: Request, exc: Exception) -> Response:
        logger.exception("unhandled error on %s", request.url.path)
        return ApiError(500, f"Internal error: {exc!r}", type="internal_error").response()

    routes = [
        Route("/v1/models", system.list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", system.retrieve_model, methods=["GET"]),
        Route("/v1/completions", completions.create_completion, methods=["POST"]),
        Route("/v1/chat/completions", chat.create_chat_completion, methods=["POST"]),
        Route(chat_batch.PATH, chat_batch.create_chat_completion_batch, methods=["POST"]),
        Route(anthropic_errors.PATH, anthropic.create_message, methods=["POST"]),
        Route(f"{anthropic_errors.PATH}/count_tokens", anthropic.count_tokens, methods=["POST"]),
        *responses.routes(config),
        Route("/v1/embeddings", pooling.create_embedding, methods=["POST"]),
        Route("/pooling", pooling.create_pooling, methods=["POST"]),
        Route("/classify", pooling.create_classification, methods=["POST"]),
        Route("/score", scoring.create_score, methods=["POST"]),
        Route("/v1/score", scoring.create_score, methods=["POST"]),
        Route("/rerank", scoring.rerank, methods=["POST"]),
        Route("/v1/rerank", scoring.rerank, methods=["POST"]),
        Route("/v2/rerank", scoring.rerank, methods=["POST"]),
        Route("/tokenize", tokenize.tokenize, methods=["POST"]),
        Route("/detokenize", tokenize.detokenize, methods=["POST"]),
        Route("/health", system.health, methods=["GET"]),
        Route("/live", system.live, methods=["GET"]),
        Route("/version", system.version, methods=["GET"]),
        Route("/metrics", system.metrics, methods=["GET"]),
        Route("/openapi.json", system.openapi, methods=["GET"]),
        Route("/docs", system.docs, methods=["GET"]),
        Route("/invocations", invocations.invocations, methods=["POST"]),
    ]
    if config.enable_server_load_tracking:
        routes.append(Route("/load", system.server_load, methods=["GET"]))
    if config.enable_tokenizer_info_endpoint:
        routes.append(Route("/tokenizer_info", system.tokenizer_info, methods=["GET"]))
    # Off by default, as in vLLM (they change what every client gets): a disabled path is a 404.
    if config.enable_runtime_lora_updating:
        routes += adapters.routes()
    if config.enable_utility_endpoints:
        routes += utility.routes()
    if (config.enable_runtime_lora_updating or config.enable_utility_endpoints) and not (
        config.api_key
    ):
        logger.warning(
            "LoRA loading or utility endpoints (sleep, profiling ...) are served without "
            "--api-key: anyone who reaches this port can use them"
        )
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={
            ApiError: api_error,
            HTTPException: http_error,
            EngineRequestError: engine_error,
            EngineUnavailableError: engine_error,
            EngineCallError: engine_error,
            Exception: unexpected,
        },
    )
    app.state.gateway = state
    app.state.prompt_encoder = encoder
    app.add_middleware(
        LoadReportMiddleware, load=state.server_load, track=config.enable_server_load_tracking
    )
    if config.api_key:  # outside the load report: a refused request is not load
        app.add_middleware(ApiKeyMiddleware, state=state)
    # added last, so outermost: a huge header is a 431 even without a valid key
    app.add_middleware(
        RequestLimitsMiddleware,
        limits=config.limits,
        retry_after_s=config.retry_after_s,
        respond=shaped,
    )
    if config.root_path:
        app.add_middleware(RootPathMiddleware, root_path=config.root_path)
    return app
