"""How the gateway is served: one process, or ``--workers N`` processes sharing the port.

With N > 1 the parent builds the app once as a check (a bad ``--engine`` or TLS file fails there,
once, as with one worker, instead of in every worker again and again), then runs ``uvicorn.run``
with N workers: uvicorn binds the port once and supervises N spawned worker processes
that accept from that one socket. Each worker builds its own app from the config handed down in
``TANDEM_WORKER_CONFIG``: its own engine streams, tokenizer and routing state.

With one worker or several, ``python -m frontend_svc`` first checks that it can listen on its
port and load its HTTPS files (:func:`serve_problem`): a taken port or a missing certificate is
one logged line and exit status 1 (uvicorn would log the port after starting the app and exit
with its startup-failure status 3, and raise a traceback for a bad certificate).

- A worker that dies, or stops answering the supervisor's pings, is replaced by a new one.
- SIGTERM or SIGINT to the parent: it sends SIGTERM to every worker; each stops accepting, lets
  its in-flight requests and streams finish for up to ``GRACEFUL_SHUTDOWN_S``, closes its engine
  streams and exits; then the parent exits 0.
- A worker whose supervisor is gone (even killed with SIGKILL) gets SIGTERM and stops the same way.
- Prometheus figures go to files in a directory the parent makes for the run and removes at exit;
  ``frontend_svc.server.metrics`` merges them so that any worker's /metrics covers all of them.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import ssl
import sys
import tempfile
from typing import Any

import uvicorn
from starlette.applications import Starlette

from frontend_svc.config import (
    METRICS_DIR_ENV,
    WORKER_CONFIG_ENV,
    FrontendConfig,
    config_to_json,
    handed_down_config,
)
from frontend_svc.server.app import build_app
from frontend_svc.server.limits import uvicorn_options

GRACEFUL_SHUTDOWN_S = 5  # after SIGTERM, in-flight requests get this long to finish
WORKER_APP = "frontend_svc.server.workers:worker_app"
_PR_SET_PDEATHSIG = 1  # linux/prctl.h

logger = logging.getLogger(__name__)


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


def server_options(config: FrontendConfig) -> dict[str, Any]:
    """Keyword arguments of ``uvicorn.run`` for this config, with one worker or several."""
    https = config.https
    return {
        "host": config.host,
        "port": config.port,
        "log_level": (config.uvicorn_log_level or config.log_level).lower(),
        "timeout_graceful_shutdown": GRACEFUL_SHUTDOWN_S,
        **uvicorn_options(config.limits),
        **(
            {
                "ssl_certfile": https.certfile,
                "ssl_keyfile": https.keyfile,
                "ssl_ca_certs": https.ca_certs,
                "ssl_cert_reqs": https.cert_reqs,
            }
            if https.enabled
            else {}
        ),
    }


def serve_problem(config: FrontendConfig) -> str | None:
    """Why the gateway cannot serve as configured, or None: its HTTPS files do not load, or it
    cannot listen on its port (in use, an unknown address, no permission: found by binding it
    as uvicorn will, ``SO_REUSEADDR``, and letting it go)."""
    https = config.https
    if https.certfile is not None:
        try:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(https.certfile, https.keyfile)
            if https.ca_certs is not None:
                context.load_verify_locations(https.ca_certs)
        except (OSError, ssl.SSLError) as e:
            return f"cannot serve HTTPS with --ssl-certfile {https.certfile}: {e}"
    host, port = config.host, config.port
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as e:
            hint = ": another process listens there (stop it or choose another --port)"
            why = e.strerror or str(e)
            return f"cannot serve on {host}:{port}: {why}" + (
                hint if e.errno == errno.EADDRINUSE else ""
            )
    return None


def serve_workers(config: FrontendConfig) -> None:
    """Serve with ``config.workers`` processes until SIGTERM or SIGINT (see the module doc)."""
    build_app(config)  # raises here, once, what would make every worker fail at its start
    metrics_dir = tempfile.mkdtemp(prefix=f"tandem-gateway-metrics-{os.getpid()}-")
    # Inherited by every worker; prometheus_client reads the first when it is first imported.
    os.environ[METRICS_DIR_ENV] = metrics_dir
    os.environ[WORKER_CONFIG_ENV] = config_to_json(config)
    try:
        uvicorn.run(WORKER_APP, factory=True, workers=config.workers, **server_options(config))
    finally:
        shutil.rmtree(metrics_dir, ignore_errors=True)


def worker_app() -> Starlette:
    """The app of one worker, built in the worker process (uvicorn calls it: ``factory``)."""
    _stop_with_supervisor()
    config = handed_down_config()
    configure_logging(config.log_level)  # a spawned process starts with none of the parent's
    return build_app(config, freeze_gc_heap=True)


def _stop_with_supervisor() -> None:
    """On Linux, have the kernel send this worker SIGTERM when its supervisor dies, however it
    dies, so that no orphan keeps serving the port. uvicorn's handler is in place by now."""
    supervisor = multiprocessing.parent_process()
    if sys.platform != "linux" or supervisor is None:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        logger.warning("prctl(PR_SET_PDEATHSIG): errno %d", ctypes.get_errno())
    elif os.getppid() != supervisor.pid:  # it died before the prctl
        os.kill(os.getpid(), signal.SIGTERM)
