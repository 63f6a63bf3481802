"""Build and run the engine's grpc.aio server: Engine service, health, reflection, shutdown."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from engine_svc.core.engine_core import EngineCore
from engine_svc.engine_loop import EngineLoop
from engine_svc.rpc.servicer import EngineServicer
from engine_svc.rpc.tls import TlsConfig
from protos.tandem.engine.v1 import engine_pb2 as pb
from protos.tandem.engine.v1 import engine_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Engine"].full_name
MAX_MESSAGE_BYTES = 64 * 2**20
SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.max_pings_without_data", 0),
]


async def serve(
    build: Callable[[], EngineCore],
    host: str,
    port: int,
    max_waiting: int,
    shutdown_timeout: float,
    version: str,
    started: asyncio.Event | None = None,
    tls: TlsConfig | None = None,
    health_port: int | None = None,
) -> None:
    """Build the engine (``build`` runs on the engine loop thread) and serve it until
    SIGTERM/SIGINT, then drain: NOT_SERVING, refuse new work, let in-flight
    requests finish within ``shutdown_timeout`` seconds, abort the rest, stop.

    With ``tls`` the port speaks TLS (mutual TLS when it names a CA). ``health_port`` adds a
    plaintext port serving only ``grpc.health.v1``, for probes that cannot speak TLS (kubelet).
    """
    loop = EngineLoop(build, max_waiting=max_waiting)
    core = loop.start()  # the loop thread builds the engine: see engine_loop's docstring
    model_dir = core.config.model.model
    server = grpc.aio.server(options=SERVER_OPTIONS)
    pb_grpc.add_EngineServicer_to_server(
        EngineServicer(loop, core.info, model_dir, version), server
    )
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    bound = _add_port(server, host, port, tls)
    health_server = None
    if health_port is not None:
        health_server = grpc.aio.server(options=SERVER_OPTIONS)
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, health_server)
        health_port = _add_port(health_server, host, health_port, None)
        await health_server.start()
        logger.info("plaintext health port %s:%d", host, health_port)
    await server.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    logger.info(
        "engine serving %s on %s:%d (%s)",
        core.info.name,
        host,
        bound,
        tls.mode if tls else "plaintext",
    )
    print(f"TANDEM_ENGINE_READY {host}:{bound}", flush=True)
    if started is not None:
        started.set()

    stop = asyncio.Event()
    aio_loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        aio_loop.add_signal_handler(sig, stop.set)
    await stop.wait()

    logger.info("shutting down: draining for up to %.1fs", shutdown_timeout)
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    aborted = await asyncio.to_thread(loop.drain_and_abort, shutdown_timeout)
    if aborted:
        logger.warning("aborted %d requests still running at the shutdown timeout", aborted)
    await asyncio.sleep(0.2)  # let the last outputs reach their streams
    await server.stop(grace=1.0)
    if health_server is not None:
        await health_server.stop(grace=None)
    loop.stop()


def _add_port(server: grpc.aio.Server, host: str, port: int, tls: TlsConfig | None) -> int:
    address = f"{host}:{port}"
    if tls is None:
        bound = server.add_insecure_port(address)
    else:
        bound = server.add_secure_port(address, tls.server_credentials())
    if bound == 0:
        raise OSError(f"cannot bind {address}")
    return bound
