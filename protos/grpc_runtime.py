"""How both of Tandem's Python services run grpcio: on its polling I/O, not its EventEngine.

On grpcio's EventEngine I/O (1.85) a received message reaches Python through three hand-offs:
EventEngine's threads poll and read the socket, then wake the aio poller thread, which wakes the
event loop; and each write's completion comes back the same way. With the ``event_engine_client``
and ``event_engine_listener`` experiments off, the poller thread reads the socket itself: one
wake fewer per message. At one stream, where every engine step is a round trip of small
messages, the gateway's CPU per token fell 12.6 -> 9.7 us and its tokens/s rose 17 % (the
client flag, which is all of the gateway's gain); with the stand-in engine on it too,
46.0k -> 59.7k tok/s (``benchmarks/results/gateway_relay_cpu.md``). Both paths are grpcio's own;
the polling one was its Python default until 2026.

grpcio reads ``GRPC_EXPERIMENTS`` once, when ``grpc`` is first imported, so this must run before
that. A ``GRPC_EXPERIMENTS`` the operator set (even empty: grpcio's defaults) is left alone. A
grpcio without these experiments would log "Unknown experiment" and run on EventEngine:
``tests/contract/test_grpc_runtime.py`` fails then, so that an upgrade cannot drop this quietly.
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
