"""The OpenAPI document served at /openapi.json, and the Swagger UI page over it at /docs.

Request bodies are the JSON schemas of the request models themselves (``frontend_svc.protocol``:
the ranges and rules the server enforces), their definitions hoisted into
``components/schemas``; responses are summarized. Paths come from :data:`OPERATIONS`: a route
is documented by one entry there.
"""

from __future__ import annotations

import copy
import functools
import html
import json
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from frontend_svc.protocol.adapters import LoadLoraAdapterBody, UnloadLoraAdapterBody
from frontend_svc.protocol.anthropic import CountTokensBody, MessagesBody
from frontend_svc.protocol.chat_batch import ChatBatchBody
from frontend_svc.protocol.models import ChatBody, CompletionBody, DetokenizeBody, TokenizeBody
from frontend_svc.protocol.pooling import (
    ClassificationRequest,
    EmbeddingRequest,
    PoolingRequest,
    RerankRequest,
    ScoreRequest,
)
from frontend_svc.protocol.responses import ResponsesBody

REF = "#/components/schemas/{model}"
_ERROR = {"$ref": REF.format(model="ErrorResponse")}
_ANTHROPIC_ERROR = {"$ref": REF.format(model="AnthropicErrorResponse")}
ERROR_TEXT = {
    400: "Invalid parameter, unparseable JSON, or context length exceeded "
    "(code `context_length_exceeded`)",
    401: "Missing or bad API key",
    404: "Unknown model (or, for /v1/responses, an unknown stored response)",
    413: "Request body over --max-body-bytes (code `request_too_large`)",
    415: "Content-Type is not application/json",
    429: "Engine queue full (see Retry-After)",
    431: "Request headers over --max-header-bytes",
    500: "The engine failed the call (its message says why)",
    501: "An engine does not implement this call (an older engine)",
    503: "Engine unavailable (see Retry-After)",
    529: "Engine unavailable: Anthropic's overloaded_error (see Retry-After)",
}
# What any route with a JSON body can answer (401 is added where a key is required).
JSON_BODY_ERRORS = (400, 404, 413, 415, 431, 503)
GENERATION_ERRORS = (*JSON_BODY_ERRORS, 429)
# What an adapter or utility call fanned out to the engines can answer besides its own 4xx.
ENGINE_CALL_ERRORS = (500, 501, 503)
OK: dict[str, Any] = {"description": "OK"}
_JSON_OK: dict[str, Any] = {"content": {"application/json": {"schema": {"type": "object"}}}}
STREAMABLE_OK: dict[str, Any] = {
    "description": "A JSON response, or with stream=true an SSE stream of chunks ending in "
    "`data: [DONE]`",
    "content": {
        "application/json": {"schema": {"type": "object"}},
        # each event (as OpenAPI 3.2's itemSchema has it): a JSON chunk, "[DONE]" last
        "text/event-stream": {
            "schema": {
                "type": "object",
                "required": ["data"],
                "properties": {"event": {"type": "string"}, "data": {"type": "string"}},
            }
        },
    },
}

RESPONSE_EVENTS_OK: dict[str, Any] = {
    "description": "A Response object, or with stream=true an SSE stream of typed events "
    "(`event: <type>`, `data`: the event with its `type` and `sequence_number`) ending in "
    "`response.completed`, `response.incomplete` or `response.failed`",
    "content": {
        "application/json": {"schema": {"type": "object"}},
        "text/event-stream": STREAMABLE_OK["content"]["text/event-stream"],
    },
}

# Anthropic's routes: an unavailable engine is its 529 overloaded_error, not a 503.
ANTHROPIC_ERRORS = (400, 404, 413, 415, 429, 431, 529)
MESSAGE_EVENTS_OK: dict[str, Any] = {
    "description": "A message, or with stream=true an SSE stream of Anthropic's events "
    "(`event: <type>`, `data`: the event with its `type`) from `message_start` to "
    "`message_stop`",
    "content": {
        "application/json": {"schema": {"type": "object"}},
        "text/event-stream": STREAMABLE_OK["content"]["text/event-stream"],
    },
}


@dataclass(frozen=True)
class Operation:
    """One documented route. ``body``: the request model of a JSON body; ``public``: served
    without the API key (probes, this document); ``path_params``: names in ``{...}``;
    ``query_params``: optional query parameters, each with its JSON schema."""

    path: str
    method: str
    summary: str
    body: type[BaseModel] | None = None
    errors: tuple[int, ...] = ()
    ok: dict[str, Any] | None = None
    public: bool = False
    path_params: tuple[str, ...] = ()
    query_params: tuple[tuple[str, dict[str, Any]], ...] = ()
    anthropic: bool = False  # errors in Anthropic's shape


OPERATIONS: tuple[Operation, ...] = (
    Operation("/v1/models", "get", "List the served model", errors=(503,)),
    Operation(
        "/v1/models/{model}",
        "get",
        "Retrieve a served model",
        errors=(404, 503),
        path_params=("model",),
    ),
    Operation(
        "/v1/completions",
        "post",
        "Create a completion",
        CompletionBody,
        GENERATION_ERRORS,
        ok=STREAMABLE_OK,
    ),
    Operation(
        "/v1/chat/completions",
        "post",
        "Create a chat completion",
        ChatBody,
        GENERATION_ERRORS,
        ok=STREAMABLE_OK,
    ),
    Operation(
        "/v1/chat/completions/batch",
        "post",
        "Create a chat completion per conversation, several in one request (vLLM)",
        ChatBatchBody,
        GENERATION_ERRORS,
        ok={"description": "A chat completion with choice i for conversation i", **_JSON_OK},
    ),
    Operation(
        "/v1/responses",
        "post",
        "Create a response (OpenAI's Responses API)",
        ResponsesBody,
        GENERATION_ERRORS,
        ok=RESPONSE_EVENTS_OK,
    ),
    Operation(
        "/v1/responses/{response_id}",
        "get",
        "Retrieve a stored response",
        errors=(400, 404),
        path_params=("response_id",),
    ),
    Operation(
        "/v1/responses/{response_id}",
        "delete",
        "Delete a stored response",
        errors=(404,),
        path_params=("response_id",),
    ),
    Operation(
        "/v1/responses/{response_id}/input_items",
        "get",
        "List a stored response's input items",
        errors=(400, 404),
        path_params=("response_id",),
        query_params=(
            ("limit", {"type": "integer", "minimum": 1, "maximum": 100, "default": 20}),
            ("order", {"type": "string", "enum": ["asc", "desc"], "default": "desc"}),
            ("after", {"type": "string"}),
        ),
    ),
    Operation(
        "/v1/messages",
        "post",
        "Create a message (Anthropic's Messages API)",
        MessagesBody,
        ANTHROPIC_ERRORS,
        ok=MESSAGE_EVENTS_OK,
        anthropic=True,
    ),
    Operation(
        "/v1/messages/count_tokens",
        "post",
        "Count a message's input tokens (Anthropic's Messages API)",
        CountTokensBody,
        tuple(c for c in ANTHROPIC_ERRORS if c != 429),
        anthropic=True,
    ),
    Operation("/tokenize", "post", "Tokenize a prompt or chat", TokenizeBody, JSON_BODY_ERRORS),
    Operation("/detokenize", "post", "Detokenize token ids", DetokenizeBody, JSON_BODY_ERRORS),
    Operation("/v1/embeddings", "post", "Create embeddings", EmbeddingRequest, GENERATION_ERRORS),
    Operation("/pooling", "post", "Pool hidden states (vLLM)", PoolingRequest, GENERATION_ERRORS),
    Operation(
        "/classify", "post", "Classify texts (vLLM)", ClassificationRequest, GENERATION_ERRORS
    ),
    *(
        Operation(path, "post", "Score text pairs (vLLM)", ScoreRequest, GENERATION_ERRORS)
        for path in ("/score", "/v1/score")
    ),
    *(
        Operation(path, "post", "Rerank documents", RerankRequest, GENERATION_ERRORS)
        for path in ("/rerank", "/v1/rerank", "/v2/rerank")
    ),
    # With --enable-runtime-lora-updating only (vLLM's runtime LoRA updating); text answers.
    Operation(
        "/v1/load_lora_adapter",
        "post",
        "Load a LoRA adapter on every engine",
        LoadLoraAdapterBody,
        (400, 413, 415, 431, *ENGINE_CALL_ERRORS),
        ok={"description": "Loaded", "content": {"text/plain": {"schema": {"type": "string"}}}},
    ),
    Operation(
        "/v1/unload_lora_adapter",
        "post",
        "Unload a LoRA adapter from every engine",
        UnloadLoraAdapterBody,
        (400, 404, 413, 415, 431, *ENGINE_CALL_ERRORS),
        ok={"description": "Unloaded", "content": {"text/plain": {"schema": {"type": "string"}}}},
    ),
    # With --enable-utility-endpoints only (vLLM's dev-mode routes); on every engine.
    Operation(
        "/reset_prefix_cache",
        "post",
        "Reset the engines' prefix caches ({success})",
        errors=ENGINE_CALL_ERRORS,
    ),
    Operation(
        "/sleep",
        "post",
        "Put the engines to sleep (level 1: KV cache freed, weights to host memory; "
        "2: weights dropped, read again on wake)",
        errors=(400, *ENGINE_CALL_ERRORS),
        query_params=(("level", {"type": "string", "enum": ["1", "2"], "default": "1"}),),
    ),
    Operation("/wake_up", "post", "Wake the engines up", errors=(400, *ENGINE_CALL_ERRORS)),
    Operation(
        "/is_sleeping",
        "get",
        "Whether every engine sleeps ({is_sleeping})",
        errors=ENGINE_CALL_ERRORS,
    ),
    Operation(
        "/start_profile", "post", "Start the engines' profilers", errors=(400, *ENGINE_CALL_ERRORS)
    ),
    Operation(
        "/stop_profile",
        "post",
        "Stop the profilers ({trace_paths})",
        errors=(400, *ENGINE_CALL_ERRORS),
    ),
    Operation("/health", "get", "Engine connected", errors=(503,), public=True),
    Operation("/live", "get", "Process alive", public=True),
    Operation("/metrics", "get", "Prometheus metrics", public=True),
    Operation("/version", "get", "Gateway version"),
    Operation("/openapi.json", "get", "This document", public=True),
    Operation(
        "/docs",
        "get",
        "This document in Swagger UI",
        ok={"description": "HTML", "content": {"text/html": {"schema": {"type": "string"}}}},
        public=True,
    ),
    Operation("/load", "get", "Requests being served (--enable-server-load-tracking)"),
    Operation(
        "/tokenizer_info",
        "get",
        "Tokenizer configuration (--enable-tokenizer-info-endpoint)",
        errors=(503,),
    ),
)
# Paths served only with their flag (left out of this document otherwise, as they are 404).
OPTIONAL_PATHS = {
    "/load": "enable_server_load_tracking",
    "/tokenizer_info": "enable_tokenizer_info_endpoint",
}
# Served without the API key: probes, scrapes, and the API document (it says how to
# authenticate; vLLM serves it without a key too).
PUBLIC_PATHS = frozenset(op.path for op in OPERATIONS if op.public)
# Swagger UI from jsDelivr, as FastAPI's get_swagger_ui_html serves it (and so vLLM's /docs).
SWAGGER_UI_DIST = "https://cdn.jsdelivr.net/npm/swagger-ui-dist@5"
_SWAGGER_UI_PAGE = """<!DOCTYPE html>
<html>
<head>
<meta charset="utf-8">
<link type="text/css" rel="stylesheet" href="{dist}/swagger-ui.css">
<title>{title} - Swagger UI</title>
</head>
<body>
<div id="swagger-ui"></div>
<script src="{dist}/swagger-ui-bundle.js"></script>
<script>
const ui = SwaggerUIBundle({{
  url: {url},
  dom_id: "#swagger-ui",
  layout: "BaseLayout",
  deepLinking: true,
  showExtensions: true,
  showCommonExtensions: true,
  presets: [SwaggerUIBundle.presets.apis, SwaggerUIBundle.SwaggerUIStandalonePreset],
}})
</script>
</body>
</html>
"""
TITLE = "Tandem gateway (OpenAI-compatible)"


def swagger_ui_page(openapi_url: str) -> str:
    """The /docs page: Swagger UI (from the CDN) showing the document at ``openapi_url``."""
    url = json.dumps(openapi_url).replace("<", "\\u003c")  # a JS string, even inside <script>
    return _SWAGGER_UI_PAGE.format(dist=SWAGGER_UI_DIST, title=html.escape(TITLE), url=url)


def openapi_schema(version: str, api_key: bool = False) -> dict[str, Any]:
    """The document; ``api_key``: the server checks a bearer key (only then is the security
    scheme declared, so clients and fuzzers do not expect a 401 a keyless server never sends)."""
    bodies, definitions = copy.deepcopy(_body_schemas())  # the cached ones stay untouched
    paths: dict[str, dict[str, Any]] = {}
    for op in OPERATIONS:
        codes = sorted({*op.errors, *(() if op.public or not api_key else (401,))})
        spec: dict[str, Any] = {
            "summary": op.summary,
            "responses": {"200": op.ok or OK, **{str(c): _error(c, op.anthropic) for c in codes}},
        }
        parameters = [
            {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
            for name in op.path_params
        ] + [{"name": name, "in": "query", "schema": schema} for name, schema in op.query_params]
        if parameters:
            spec["parameters"] = parameters
        if op.body is not None:
            spec["requestBody"] = {"required": True, **_json(bodies[op.body])}
        if api_key and op.public:
            spec["security"] = []
        paths.setdefault(op.path, {})[op.method] = spec
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": TITLE, "version": version},
        "components": {
            "schemas": {
                **definitions,
                "ErrorResponse": _ERROR_RESPONSE,
                "AnthropicErrorResponse": _ANTHROPIC_ERROR_RESPONSE,
            }
        },
        "paths": paths,
    }
    if api_key:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        doc["security"] = [{"bearer": []}]
    return doc


@functools.cache
def _body_schemas() -> tuple[dict[type[BaseModel], dict[str, Any]], dict[str, Any]]:
    """Each request model's ``$ref``, and every schema they define, by component name (pydantic
    names them after the classes and keeps them apart when two share a name)."""
    models = list(dict.fromkeys(op.body for op in OPERATIONS if op.body is not None))
    refs, defs = models_json_schema([(m, "validation") for m in models], ref_template=REF)
    return {m: refs[(m, "validation")] for m in models}, defs.get("$defs", {})


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"content": {"application/json": {"schema": schema}}}


def _error(code: int, anthropic: bool = False) -> dict[str, Any]:
    # Anthropic's shape on its routes, from the HTTP limits (413, 431) and the key check too
    return {"description": ERROR_TEXT[code], **_json(_ANTHROPIC_ERROR if anthropic else _ERROR)}


def _object(required: list[str], **props: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "required": required, "properties": props}


_ERROR_RESPONSE = _object(
    ["error"],
    error=_object(
        ["message", "type"],
        message={"type": "string"},
        type={"type": "string"},
        param={"type": ["string", "null"]},
        code={"type": ["string", "integer", "null"]},
    ),
)
_ANTHROPIC_ERROR_RESPONSE = _object(
    ["type", "error"],
    type={"const": "error"},
    error=_object(["type", "message"], type={"type": "string"}, message={"type": "string"}),
)
