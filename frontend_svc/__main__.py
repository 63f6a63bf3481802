"""``python -m frontend_svc``: serve the gateway with uvicorn."""

from __future__ import annotations

import logging
import sys

import uvicorn

from frontend_svc.app import build_app
from frontend_svc.config import config_from_args
from frontend_svc.limits import uvicorn_options


def main(argv: list[str] | None = None) -> None:
    config = config_from_args(argv)
    logging.basicConfig(
        level=config.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    uvicorn.run(
        build_app(config),
        host=config.host,
        port=config.port,
        log_level=config.log_level.lower(),
        timeout_graceful_shutdown=5,
        **uvicorn_options(config.limits),
    )


if __name__ == "__main__":
    main(sys.argv[1:])
