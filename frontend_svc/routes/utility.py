"""The engines' utility calls, as vLLM's dev-mode routes: POST /reset_prefix_cache, POST
/sleep?level=1|2, POST /wake_up, GET /is_sleeping, POST /start_profile, POST /stop_profile.

Served with ``--enable-utility-endpoints`` only (404 otherwise, as an unknown path). Each call
goes to every engine behind the gateway (``EngineFanOut``); /is_sleeping is true only when every
engine sleeps. Bodies as vLLM's: empty for sleep, wake_up and the profiler's start;
``{"success": bool}`` for the cache reset, ``{"is_sleeping": bool}``; /stop_profile adds where
each engine wrote its trace (``{"trace_paths": [...]}``).
"""

from __future__ import annotations

import logging

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from frontend_svc.errors import invalid_parameter
from frontend_svc.routes.common import gateway

logger = logging.getLogger(__name__)

PATHS = (
    "/reset_prefix_cache",
    "/sleep",
    "/wake_up",
    "/is_sleeping",
    "/start_profile",
    "/stop_profile",
)


async def reset_prefix_cache(request: Request) -> Response:
    """``success`` is false when some engine kept the entries of blocks running requests use."""
    success = await gateway(request).engines.fanout.reset_prefix_cache()
    logger.info("prefix caches reset (complete: %s)", success)
    return JSONResponse({"success": success})


async def sleep(request: Request) -> Response:
    """``level`` 1 (default): KV cache freed, weights moved to host memory; 2: weights dropped
    too (read again from the checkpoint on wake up). The engines finish their running requests
    first; while asleep they refuse new ones (503 here) and /health is 503."""
    query = request.query_params
    level = query.get("level", "1")
    if level not in ("1", "2"):
        raise invalid_parameter(f"'level' must be 1 or 2, not '{level[:20]}'.", "level")
    mode = query.get("mode", "wait")
    if mode != "wait":
        raise invalid_parameter(
            "'mode' must be 'wait': the engines finish their running requests before they sleep.",
            "mode",
        )
    await gateway(request).engines.fanout.sleep(int(level))
    logger.warning("engines put to sleep (level %s)", level)
    return Response(status_code=200)


async def wake_up(request: Request) -> Response:
    if "tags" in request.query_params:
        raise invalid_parameter(
            "'tags' is not supported: waking up restores the weights and the KV cache together.",
            "tags",
        )
    await gateway(request).engines.fanout.wake_up()
    logger.info("engines woken up")
    return Response(status_code=200)


async def is_sleeping(request: Request) -> Response:
    return JSONResponse({"is_sleeping": await gateway(request).engines.fanout.is_sleeping()})


async def start_profile(request: Request) -> Response:
    """400 (the engine's message) when an engine has no profile directory or already profiles."""
    await gateway(request).engines.fanout.start_profile()
    logger.info("profiler started")
    return Response(status_code=200)


async def stop_profile(request: Request) -> Response:
    paths = await gateway(request).engines.fanout.stop_profile()
    logger.info("profiler stopped: %s", ", ".join(paths))
    return JSONResponse({"trace_paths": paths})


def routes() -> list[Route]:
    return [
        Route("/reset_prefix_cache", reset_prefix_cache, methods=["POST"]),
        Route("/sleep", sleep, methods=["POST"]),
        Route("/wake_up", wake_up, methods=["POST"]),
        Route("/is_sleeping", is_sleeping, methods=["GET"]),
        Route("/start_profile", start_profile, methods=["POST"]),
        Route("/stop_profile", stop_profile, methods=["POST"]),
    ]
