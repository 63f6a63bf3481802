"""GET /v1/models, /v1/models/{model}, /health, /live, /version, /metrics, /openapi.json and
/docs."""

from __future__ import annotations

import json
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response

from frontend_svc import __version__
from frontend_svc.errors import engine_unavailable, model_not_found
from frontend_svc.routes import adapters, utility
from frontend_svc.routes.common import gateway
from frontend_svc.server.metrics import CONTENT_TYPE
from frontend_svc.server.openapi import OPTIONAL_PATHS, openapi_schema, swagger_ui_page
from frontend_svc.server.state import ADAPTER_REFRESH_S

_STARTED = int(time.time())


def _model_cards(request: Request) -> list[dict[str, Any]]:
    """The served model, then each LoRA adapter the engines have loaded, in OpenAI's model
    object shape (plus vLLM's root, parent and max_model_len, and the tasks the model serves:
    "generate", "embed", "classify", "score"). An adapter's ``parent`` is the served model and
    its ``root`` the adapter's directory, as in vLLM. 503 when no engine is connected."""
    state = gateway(request)
    _, info = state.require_engine()
    base = state.served_model_name or info.served_model_name

    def card(model_id: str, root: str, parent: str | None) -> dict[str, Any]:
        return {
            "id": model_id,
            "object": "model",
            "created": _STARTED,
            "owned_by": "tandem",
            "root": root,
            "parent": parent,
            "max_model_len": info.max_model_len,
            "supported_tasks": list(info.supported_tasks),
            "permission": [],
        }

    cards = [card(base, info.model_source or info.served_model_name, None)]
    cards += [card(a.name, a.path, base) for a in state.engines.fanout.adapters().values()]
    return cards


async def list_models(request: Request) -> Response:
    # Adapters loaded through another gateway or worker show up within ADAPTER_REFRESH_S.
    await gateway(request).engines.fanout.refresh_adapters(max_age_s=ADAPTER_REFRESH_S, wait=False)
    return JSONResponse({"object": "list", "data": _model_cards(request)})


async def retrieve_model(request: Request) -> Response:
    """GET /v1/models/{model}: one model object (the SDK's ``models.retrieve``), or 404."""
    model = request.path_params["model"]
    state = gateway(request)
    state.require_engine()
    await state.resolve_model(model)  # 404, after looking on the engines again
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
        return JSONResponse({"status": "ok", "engines": state.engines.members.describe()})
    return engine_unavailable(state.engines.members.unavailable_reason()).response()


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
    """The document, without the routes this server's flags leave out (they are 404 here)."""
    config = gateway(request).config
    doc = openapi_schema(__version__, config.api_key is not None)
    disabled = (() if config.enable_runtime_lora_updating else adapters.PATHS) + (
        () if config.enable_utility_endpoints else utility.PATHS
    )
    disabled += tuple(p for p, flag in OPTIONAL_PATHS.items() if not getattr(config, flag))
    for path in disabled:
        doc["paths"].pop(path, None)
    return JSONResponse(doc)


async def docs(request: Request) -> Response:
    """Swagger UI over /openapi.json (under the proxy's root path, if any), as vLLM serves."""
    return HTMLResponse(swagger_ui_page(request.scope.get("root_path", "") + "/openapi.json"))


async def server_load(request: Request) -> Response:
    """GET /load (``--enable-server-load-tracking``, vLLM's): the generation and pooling
    requests this gateway process is serving now."""
    return JSONResponse({"server_load": gateway(request).server_load.in_progress})


async def tokenizer_info(request: Request) -> Response:
    """GET /tokenizer_info (``--enable-tokenizer-info-endpoint``, vLLM's): the served
    tokenizer's configuration (its tokenizer_config.json, with the chat template this server
    uses) and its class. 503 before an engine has connected."""
    state = gateway(request)
    tokenizer, _ = state.require_engine()
    files = state.tokenizer_files
    config: dict[str, Any] = {}
    raw = files.files.get("tokenizer_config.json") if files else None
    if raw:
        loaded = json.loads(raw)
        config = loaded if isinstance(loaded, dict) else {}
    config.pop("added_tokens_decoder", None)  # one entry per added token: not configuration
    if files is not None and files.chat_template is not None:
        config["chat_template"] = files.chat_template
    return JSONResponse({"tokenizer_class": config.get("tokenizer_class", "tokenizers"), **config})
