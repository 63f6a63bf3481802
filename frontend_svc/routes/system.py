"""GET /v1/models, /v1/models/{model}, /health, /live, /version, /metrics and /openapi.json."""

from __future__ import annotations

import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from frontend_svc import __version__
from frontend_svc.errors import engine_unavailable, model_not_found
from frontend_svc.metrics import CONTENT_TYPE
from frontend_svc.openapi import openapi_schema
from frontend_svc.routes.common import gateway

_STARTED = int(time.time())


def _model_cards(request: Request) -> list[dict[str, Any]]:
    """The served models in OpenAI's model object shape (plus vLLM's root, parent and
    max_model_len, and the tasks the model serves: "generate", "embed", "classify", "score");
    503 when no engine is connected."""
    state = gateway(request)
    _, info = state.require_engine()
    return [
        {
            "id": state.served_model_name or info.served_model_name,
            "object": "model",
            "created": _STARTED,
            "owned_by": "tandem",
            "root": info.model_source or info.served_model_name,
            "parent": None,
            "max_model_len": info.max_model_len,
            "supported_tasks": list(info.supported_tasks),
            "permission": [],
        }
    ]


async def list_models(request: Request) -> Response:
    return JSONResponse({"object": "list", "data": _model_cards(request)})


async def retrieve_model(request: Request) -> Response:
    """GET /v1/models/{model}: one model object (the SDK's ``models.retrieve``), or 404."""
    model = request.path_params["model"]
    for card in _model_cards(request):
        if card["id"] == model:
            return JSONResponse(card)
    raise model_not_found(model)


async def health(request: Request) -> Response:
    """200 when at least one engine is connected (and the tokenizer loaded), else 503.

    The body lists every engine with its state, for people; probes only read the status.
    """
    state = gateway(request)
    if state.ready:
        return JSONResponse({"status": "ok", "engines": state.engines.describe()})
    return engine_unavailable(state.engines.unavailable_reason()).response()


async def live(request: Request) -> Response:
    """The process is up (it may still be waiting for the engine)."""
    return Response(status_code=200)


async def version(request: Request) -> Response:
    info = gateway(request).model_info
    return JSONResponse(
        {
            "version": __version__,
            "engine_version": info.engine_version if info else None,
        }
    )


async def metrics(request: Request) -> Response:
    return Response(gateway(request).metrics.exposition(), media_type=CONTENT_TYPE)


async def openapi(request: Request) -> Response:
    return JSONResponse(openapi_schema(__version__, gateway(request).config.api_key is not None))
