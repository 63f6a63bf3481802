"""How both of Tandem's Python services run grpcio: on its polling I/O, not its EventEngine.

grpcio (1.85) moves a received message through three threads before Python sees it: an
EventEngine thread reads the socket, wakes the aio poller thread, which wakes the event loop;
and each write's completion comes back the same way. With the ``event_engine_client`` and
``event_engine_listener`` experiments off, the poller thread reads the socket itself, one wake
fewer per message. At one stream, where every engine step is a round trip of small messages,
that is 18 % less gateway CPU per token and 14 % more tokens/s (+26 % with the engine side too):
``benchmarks/results/gateway_relay_cpu.md``. Both paths are grpcio's own, the polling one its
default until 2026.

grpcio reads ``GRPC_EXPERIMENTS`` once, when ``grpc`` is first imported, so this must run before
that. A ``GRPC_EXPERIMENTS`` the operator set (even empty: grpcio's defaults) is left alone. A
grpcio that no longer has these experiments logs "Unknown experiment" once and runs as it would.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

EXPERIMENTS = "GRPC_EXPERIMENTS"
POLLING_IO = "-event_engine_client,-event_engine_listener"


def prefer_polling_io(environ: MutableMapping[str, str] | None = None) -> str | None:
    """Default ``GRPC_EXPERIMENTS`` to grpcio's polling I/O in ``environ`` (a child process's
    environment), or in this process's own, where it takes effect only if ``grpc`` is not
    imported yet. Returns a warning for the log when it came too late for that."""
    if environ is None:
        if "grpc" in sys.modules:  # e.g. a tracing wrapper imported it first
            if EXPERIMENTS in os.environ:
                return None
            return (
                "grpc was imported before this service could choose grpcio's polling I/O: "
                "running on grpcio's default (see protos/grpc_runtime.py)"
            )
        environ = os.environ
    environ.setdefault(EXPERIMENTS, POLLING_IO)
    return None
