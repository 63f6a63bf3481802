"""Test harness: the real gateway served by uvicorn in a background thread, plus helpers."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import uvicorn

from frontend_svc.config import BackoffConfig, FrontendConfig, LimitsConfig
from frontend_svc.server.app import build_app
from frontend_svc.server.limits import uvicorn_options


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class GatewayServer:
    """``build_app`` under uvicorn on a free loopback port."""

    def __init__(
        self,
        engine_address: str,
        api_key: str | None = None,
        limits: LimitsConfig | None = None,
        freeze_gc_heap: bool = False,
        **config: Any,
    ) -> None:
        """``config``: other ``FrontendConfig`` fields (tool_call_parser, ...)."""
        self.port = free_port()
        self.config = FrontendConfig(
            engine_address=engine_address,
            host="127.0.0.1",
            port=self.port,
            api_key=api_key,
            backoff=BackoffConfig(initial_s=0.05, max_s=0.3),
            retry_after_s=2,
            engine_rpc_timeout_s=2.0,
            limits=limits or LimitsConfig(),
            **config,
        )
        self.app = build_app(self.config, freeze_gc_heap)
        config = uvicorn.Config(
            self.app,
            host="127.0.0.1",
            port=self.port,
            log_level="warning",
            lifespan="on",
            **uvicorn_options(self.config.limits),
        )
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.server.run, name="gateway", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> GatewayServer:
        self._thread.start()
        wait_for(lambda: self.server.started, 10, "gateway start")
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(10)

    def wait_healthy(self, timeout: float = 10.0, expected: int = 200) -> None:
        def ok() -> bool:
            try:
                return httpx.get(f"{self.url}/health", timeout=2).status_code == expected
            except httpx.HTTPError:
                return False

        wait_for(ok, timeout, f"/health == {expected}")


def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise TimeoutError(f"timed out waiting for {what}")
