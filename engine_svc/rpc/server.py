"""Build and run the engine's grpc.aio server: Engine service, health, reflection, shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import signal
import socket
from collections.abc import Callable, Coroutine

import grpc
from grpc_health.v1 import health_pb2_grpc

from engine_svc.config import ServerConfig
from engine_svc.engine_core import EngineCore
from engine_svc.executor import MultiprocExecutor
from engine_svc.loop.engine_loop import EngineLoop
from engine_svc.loop.liveness import drain_and_abort
from engine_svc.rpc import handlers, health, reflection
from engine_svc.rpc.servicer import EngineServicer
from engine_svc.rpc.tls import TlsConfig
from protos.gc_heap import freeze_startup_heap
from protos.tandem.engine.v1 import engine_pb2 as pb

logger = logging.getLogger(__name__)

SERVICE = pb.DESCRIPTOR.services_by_name["Engine"]
SERVICE_NAME = SERVICE.full_name
MAX_MESSAGE_BYTES = 64 * 2**20
# How long shutdown waits for the calls it ended to return before the server cancels them.
_CALLS_END_S = 2.0
SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.max_pings_without_data", 0),
    # gRPC turns SO_REUSEPORT on by default: a second engine on the same port would start, and
    # the kernel would split new connections between the two. One port, one engine.
    ("grpc.so_reuseport", 0),
]


class PortUnavailable(OSError):
    """The engine cannot listen where it was told to (the port is taken, or not ours)."""


class EngineFailed(RuntimeError):
    """The engine cannot go on (a tensor-parallel worker died); ``serve`` has reported
    NOT_SERVING and ended every open call with the reason. The process should exit non-zero."""


async def serve(
    build: Callable[[], EngineCore],
    config: ServerConfig,
    started: asyncio.Event | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Build the engine (``build`` runs on the engine loop thread) and serve it until ``stop``
    is set (None: until SIGTERM/SIGINT), then drain: NOT_SERVING, refuse new work, let
    in-flight requests finish within the shutdown timeout, abort the rest, end every open call,
    stop.

    Raises ``PortUnavailable`` when a port is taken, before building the engine when it can
    tell; ``EngineFailed`` when the engine cannot go on (a tensor-parallel worker died), after
    NOT_SERVING and ending every open call with UNAVAILABLE and the reason.
    """
    ports = [config.port] + ([config.health_port] if config.health_port is not None else [])
    for port in ports:
        _check_port_free(config.host, port)  # fail in a second, not after loading the model
    loop = EngineLoop(build, config.max_waiting, config.stall_timeout_s)
    core = loop.start()  # the loop thread builds the engine: see loop/engine_loop.py
    try:
        await _serve_built(loop, core, config, started, stop)
    finally:
        loop.stop(timeout=5.0 if loop.failure is None else 0.5)  # failed: perhaps stuck for good


async def _serve_built(
    loop: EngineLoop,
    core: EngineCore,
    config: ServerConfig,
    started: asyncio.Event | None,
    stop: asyncio.Event | None,
) -> None:
    model = core.config.model
    servicer = EngineServicer(
        loop, core.info, model.model, config.version, model.tokenizer, model.chat_template
    )
    health_service = health.HealthService(("", SERVICE_NAME))
    server = grpc.aio.server(options=SERVER_OPTIONS)
    handlers.add_service(servicer, SERVICE, server)
    _add_health(health_service, server)
    reflection.enable_reflection((SERVICE_NAME, health.SERVICE_NAME), server)
    bound = _add_port(server, config.host, config.port, config.tls)
    health_server = None
    if config.health_port is not None:
        health_server = grpc.aio.server(options=SERVER_OPTIONS)
        _add_health(health_service, health_server)
        health_port = _add_port(health_server, config.host, config.health_port, None)
        await health_server.start()
        logger.info("plaintext health port %s:%d", config.host, health_port)
    await server.start()
    if config.freeze_gc_heap:
        freeze_startup_heap(logger)
    failed = _on_fatal(loop, core)
    await health_service.set_serving(True)
    watchdog = asyncio.create_task(_watch_progress(loop, health_service), name="engine-health")
    logger.info(
        "engine serving %s on %s:%d (%s)",
        core.info.served_model_name,
        config.host,
        bound,
        config.tls.mode if config.tls else "plaintext",
    )
    if stop is None:  # before saying ready: a SIGTERM from then on drains (not the default kill)
        stop = asyncio.Event()
        aio_loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            aio_loop.add_signal_handler(sig, stop.set)
    print(f"TANDEM_ENGINE_READY {config.host}:{bound}", flush=True)
    if started is not None:
        started.set()
    await _first(stop.wait(), failed.wait())
    if loop.failure is not None:
        watchdog.cancel()
        await _end_failed(loop.failure, health_service, servicer, (server, health_server))
        raise EngineFailed(loop.failure)

    logger.info("shutting down: draining for up to %.1fs", config.shutdown_timeout_s)
    watchdog.cancel()
    loop.draining = True
    await health_service.set_serving(False)
    aborted = await asyncio.to_thread(drain_and_abort, loop, config.shutdown_timeout_s)
    if aborted:
        logger.warning("aborted %d requests still running at the shutdown timeout", aborted)
    await asyncio.sleep(0.2)  # let the last outputs reach their streams
    # End the long-lived calls ourselves (health Watch: NOT_SERVING, Streams: UNAVAILABLE) and
    # wait until their handlers have returned, so the server has nothing left to cancel: a
    # cancelled handler logs a traceback. Health first: a gateway whose Stream ends drops its
    # Watch and channel at once.
    await health_service.close()
    await health_service.watches_ended(_CALLS_END_S)
    servicer.close_calls("the engine is shutting down")
    if not await servicer.calls_ended(_CALLS_END_S):
        logger.warning("some calls did not end within %.1fs; the server cancels them", _CALLS_END_S)
    await server.stop(grace=2.0)
    if health_server is not None:
        await health_server.stop(grace=1.0)


def _on_fatal(loop: EngineLoop, core: EngineCore) -> asyncio.Event:
    """Set when the engine cannot go on: a tensor-parallel worker died (its executor calls this
    from its watchdog thread, and ends the process a few seconds later whatever happens)."""
    failed = asyncio.Event()
    aio_loop = asyncio.get_running_loop()
    runner = core.runner
    if isinstance(runner, MultiprocExecutor):

        def on_worker_death(reason: str) -> None:
            loop.fail(reason)
            aio_loop.call_soon_threadsafe(failed.set)

        runner.on_worker_death = on_worker_death
    return failed


async def _first(*waits: Coroutine[object, object, object]) -> None:
    tasks = [asyncio.ensure_future(w) for w in waits]
    _, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()


async def _end_failed(
    reason: str,
    health_service: health.HealthService,
    servicer: EngineServicer,
    servers: tuple[grpc.aio.Server | None, ...],
) -> None:
    """NOT_SERVING to every health watcher, UNAVAILABLE with the reason to every open call, and
    no grace for requests that cannot finish."""
    logger.critical("engine NOT_SERVING for good: %s", reason)
    await health_service.close()
    await health_service.watches_ended(_CALLS_END_S / 2)
    servicer.close_calls(f"the engine failed: {reason}")
    await servicer.calls_ended(_CALLS_END_S / 2)
    for server in servers:
        if server is not None:
            await server.stop(grace=0.2)


async def _watch_progress(loop: EngineLoop, service: health.HealthService) -> None:
    """Keep health in step with the loop: NOT_SERVING while it is stalled or dead."""
    interval = min(0.5, loop.heartbeat.stall_timeout_s / 4)
    serving = True
    while True:
        await asyncio.sleep(interval)
        reason = loop.unavailable_reason()
        if (reason is None) != serving:
            serving = reason is None
            if serving:
                logger.warning("engine loop is making progress again: SERVING")
            elif loop.sleep_requested:
                logger.info("engine NOT_SERVING: %s", reason)  # asked for: not an error
            else:
                logger.error("engine NOT_SERVING: %s", reason)
            await service.set_serving(serving)


def _add_health(service: health.HealthService, server: grpc.aio.Server) -> None:
    health_pb2_grpc.add_HealthServicer_to_server(service, server)


def _add_port(server: grpc.aio.Server, host: str, port: int, tls: TlsConfig | None) -> int:
    address = f"{host}:{port}"
    try:
        if tls is None:
            bound = server.add_insecure_port(address)
        else:
            bound = server.add_secure_port(address, tls.server_credentials())
    except RuntimeError:  # grpcio's "Failed to bind to address"
        bound = 0
    if bound == 0:
        raise PortUnavailable(f"cannot listen on {address}: the address is in use or unavailable")
    return bound


def _check_port_free(host: str, port: int) -> None:
    """Raise PortUnavailable if something listens on ``host:port`` (port 0: any free port)."""
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError:
        return  # leave the verdict to the real bind
    for family, kind, proto, _, addr in infos:
        with contextlib.closing(socket.socket(family, kind, proto)) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC binds
            try:
                s.bind(addr)
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    raise PortUnavailable(
                        f"cannot listen on {host}:{port}: the port is already in use "
                        "(another engine?)"
                    ) from None
