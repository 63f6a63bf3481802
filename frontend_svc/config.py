"""Gateway configuration: command-line flags with defaults from ``TANDEM_*`` environment variables.

This is the only module of the gateway that reads the environment.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

ENV_PREFIX = "TANDEM_"


@dataclass(frozen=True)
class BackoffConfig:
    """Exponential backoff between engine reconnection attempts."""

    initial_s: float = 0.25
    max_s: float = 5.0
    multiplier: float = 2.0

    def __post_init__(self) -> None:
        if self.initial_s <= 0 or self.max_s < self.initial_s or self.multiplier < 1:
            raise ValueError(f"invalid backoff {self}")


@dataclass(frozen=True)
class FrontendConfig:
    """Everything the gateway needs to start; built once at startup."""

    engine_address: str = "127.0.0.1:50051"
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None  # None: the name the engine reports
    backoff: BackoffConfig = BackoffConfig()
    retry_after_s: int = 1  # Retry-After sent with 429 responses
    engine_rpc_timeout_s: float = 10.0  # for the unary rpcs made while connecting
    log_level: str = "info"


def _env(environ: Mapping[str, str], name: str, default: str | None) -> str | None:
    value = environ.get(ENV_PREFIX + name)
    return value if value not in (None, "") else default


def build_arg_parser(environ: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """Flags of ``python -m frontend_svc``; each default comes from ``TANDEM_<FLAG>`` if set."""
    env = os.environ if environ is None else environ
    d = FrontendConfig()
    p = argparse.ArgumentParser(
        prog="python -m frontend_svc",
        description="Tandem gateway: OpenAI-compatible HTTP API in front of a Tandem engine.",
    )
    p.add_argument(
        "--engine",
        default=_env(env, "ENGINE", d.engine_address),
        help="engine gRPC address HOST:PORT (env TANDEM_ENGINE)",
    )
    p.add_argument("--host", default=_env(env, "HOST", d.host), help="env TANDEM_HOST")
    p.add_argument("--port", type=int, default=int(_env(env, "PORT", str(d.port)) or d.port))
    p.add_argument(
        "--api-key",
        default=_env(env, "API_KEY", None),
        help="require 'Authorization: Bearer KEY' (env TANDEM_API_KEY)",
    )
    p.add_argument(
        "--served-model-name",
        default=_env(env, "SERVED_MODEL_NAME", None),
        help="model name exposed by the API; default: the engine's (env TANDEM_SERVED_MODEL_NAME)",
    )
    p.add_argument(
        "--reconnect-max-s",
        type=float,
        default=float(_env(env, "RECONNECT_MAX_S", str(d.backoff.max_s)) or d.backoff.max_s),
        help="longest wait between engine reconnection attempts (env TANDEM_RECONNECT_MAX_S)",
    )
    p.add_argument(
        "--retry-after-s",
        type=int,
        default=int(_env(env, "RETRY_AFTER_S", str(d.retry_after_s)) or d.retry_after_s),
        help="Retry-After seconds sent with 429 responses (env TANDEM_RETRY_AFTER_S)",
    )
    p.add_argument("--log-level", default=_env(env, "LOG_LEVEL", d.log_level))
    return p


def config_from_args(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> FrontendConfig:
    """Parse flags (falling back to the environment) into a :class:`FrontendConfig`."""
    args = build_arg_parser(environ).parse_args(argv)
    initial = min(BackoffConfig().initial_s, args.reconnect_max_s)
    return FrontendConfig(
        engine_address=args.engine,
        host=args.host,
        port=args.port,
        api_key=args.api_key or None,
        served_model_name=args.served_model_name or None,
        backoff=BackoffConfig(initial_s=initial, max_s=args.reconnect_max_s),
        retry_after_s=args.retry_after_s,
        log_level=args.log_level,
    )
