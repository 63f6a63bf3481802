"""``python -m frontend_svc``: serve the gateway with uvicorn (``--workers N``: N processes)."""

from __future__ import annotations

import sys

import uvicorn

from frontend_svc.app import build_app
from frontend_svc.config import config_from_args
from frontend_svc.workers import configure_logging, serve_workers, server_options


def main(argv: list[str] | None = None) -> None:
    config = config_from_args(argv)
    configure_logging(config.log_level)
    if config.workers > 1:
        serve_workers(config)
    else:
        uvicorn.run(build_app(config, freeze_gc_heap=True), **server_options(config))


if __name__ == "__main__":
    main(sys.argv[1:])
