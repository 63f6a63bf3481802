"""``python -m frontend_svc``: serve the gateway with uvicorn (``--workers N``: N processes)."""

from __future__ import annotations

import logging
import sys

from protos.grpc_runtime import prefer_polling_io


def main(argv: list[str] | None = None) -> None:
    # Before anything imports grpc, which reads its experiments then (protos/grpc_runtime.py);
    # spawned workers inherit the variable.
    too_late = prefer_polling_io()
    import uvicorn

    from frontend_svc.config import config_from_args
    from frontend_svc.server.app import build_app
    from frontend_svc.server.workers import (
        configure_logging,
        serve_problem,
        serve_workers,
        server_options,
    )

    config = config_from_args(argv)
    configure_logging(config.log_level)
    logger = logging.getLogger("frontend_svc")
    if too_late:
        logger.warning(too_late)
    problem = serve_problem(config)
    if problem is not None:
        logger.error("%s", problem)
        sys.exit(1)
    if config.workers > 1:
        serve_workers(config)
    else:
        uvicorn.run(build_app(config, freeze_gc_heap=True), **server_options(config))


if __name__ == "__main__":
    main(sys.argv[1:])
