"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's runtime LoRA updating).

Served with ``--enable-runtime-lora-updating`` only (404 otherwise, as an unknown path). Both act
on every engine behind the gateway (``EngineFanOut.add_lora`` / ``remove_lora``); a load that
fails anywhere is undone everywhere. Success is a plain-text sentence, as vLLM answers.
"""

from __future__ import annotations

import logging

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from frontend_svc.errors import ApiError, invalid_parameter
from frontend_svc.protocol.adapters import parse_load_lora_adapter, parse_unload_lora_adapter
from frontend_svc.routes.common import gateway, parse_body

logger = logging.getLogger(__name__)

PATHS = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")


async def load_lora_adapter(request: Request) -> Response:
    state = gateway(request)
    state.require_engine()
    body = await parse_body(request, parse_load_lora_adapter)
    name = body.lora_name
    if name == state.served_model_name:
        raise invalid_parameter(
            f"The name '{name}' is the served model's; give the adapter another.", "lora_name"
        )
    fanout = state.engines.fanout
    await fanout.refresh_adapters()  # one loaded through another gateway counts too
    if fanout.has_adapter(name):
        if not body.load_inplace:
            raise invalid_parameter(
                f"The lora adapter '{name}' has already been loaded.",
                "lora_name",
                code="already_exists",
            )
        # vLLM's load_inplace: the new directory replaces the old under the same name. Requests
        # running with the old one finish with it; one that fails to load leaves the name free.
        await fanout.remove_lora(name)
        logger.info("replacing LoRA adapter %s", name)
    await fanout.add_lora(name, body.lora_path, body.pin)
    logger.info("loaded LoRA adapter %s from %s", name, body.lora_path)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(request: Request) -> Response:
    state = gateway(request)
    state.require_engine()
    body = await parse_body(request, parse_unload_lora_adapter)
    name = body.lora_name
    await state.engines.fanout.refresh_adapters()
    if not state.engines.fanout.has_adapter(name):
        raise ApiError(
            404,
            f"The lora adapter '{name}' cannot be found.",
            type="invalid_request_error",
            param="lora_name",
            code="not_found",
        )
    await state.engines.fanout.remove_lora(name)
    logger.info("unloaded LoRA adapter %s", name)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


def routes() -> list[Route]:
    return [
        Route(PATHS[0], load_lora_adapter, methods=["POST"]),
        Route(PATHS[1], unload_lora_adapter, methods=["POST"]),
    ]
