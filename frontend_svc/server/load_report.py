"""What the gateway tells a load balancer about its load, as vLLM does:

* ``GET /load`` (``--enable-server-load-tracking``): ``{"server_load": N}``, the generation and
  pooling requests this gateway process is serving now (counted from when a request arrives
  until its response, streamed or not, has been sent or the client left);
* ORCA load reports: a request that sends ``endpoint-load-metrics-format: text`` (or ``json``)
  gets an ``endpoint-load-metrics`` response header with the engines' KV cache utilization
  (their mean) and waiting requests (their sum), from the engines' latest load figures.
"""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from protos.types import LoadFigures

# vLLM's load-aware endpoints: generation and pooling.
LOAD_PATHS = frozenset(
    {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/responses",
        "/v1/messages",
        "/v1/embeddings",
        "/pooling",
        "/classify",
        "/score",
        "/v1/score",
        "/rerank",
        "/v1/rerank",
        "/v2/rerank",
        "/invocations",
    }
)
ORCA_REQUEST_HEADER = b"endpoint-load-metrics-format"
ORCA_RESPONSE_HEADER = b"endpoint-load-metrics"


class ServerLoad:
    """The requests in progress, and the engines' latest load figures."""

    def __init__(self) -> None:
        self.in_progress = 0
        self.engines: dict[str, LoadFigures] = {}

    def orca(self, fmt: str) -> str | None:
        """The ORCA report in ``fmt`` (text or json, any case); None for another format."""
        figures = list(self.engines.values())
        kv = sum(f.kv_cache_usage for f in figures) / len(figures) if figures else 0.0
        metrics = {
            "kv_cache_utilization": kv,
            "num_requests_waiting": sum(f.num_waiting for f in figures),
        }
        fmt = fmt.strip().lower()
        if fmt == "text":
            return "TEXT " + ", ".join(f"named_metrics.{k}={v}" for k, v in metrics.items())
        if fmt == "json":
            return "JSON " + json.dumps({"named_metrics": metrics})
        return None


class LoadReportMiddleware:
    """Counts the load paths' requests in progress (with load tracking on) and adds the ORCA
    header to a response whose request asked for it."""

    def __init__(self, app: ASGIApp, load: ServerLoad, track: bool) -> None:
        self.app = app
        self.load = load
        self.track = track

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        orca = None
        for name, value in scope["headers"]:
            if name == ORCA_REQUEST_HEADER:
                orca = value.decode("latin-1")
        counted = self.track and route_path(scope) in LOAD_PATHS
        if orca is None and not counted:
            await self.app(scope, receive, send)
            return

        async def reporting(message: Message) -> None:
            if message["type"] == "http.response.start" and orca is not None:
                report = self.load.orca(orca)
                if report is not None:
                    headers = list(message.get("headers", ()))
                    headers.append((ORCA_RESPONSE_HEADER, report.encode("latin-1")))
                    message = {**message, "headers": headers}
            await send(message)

        if counted:
            self.load.in_progress += 1
        try:
            await self.app(scope, receive, reporting)
        finally:
            if counted:
                self.load.in_progress -= 1


def route_path(scope: Scope) -> str:
    """The path without the ``--root-path`` prefix, as the router matches it (a path outside
    the prefix is matched as it is)."""
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    if root and path.startswith(root) and path[len(root) : len(root) + 1] in ("/", ""):
        return path[len(root) :]
    return path


class RootPathMiddleware:
    """``--root-path``: the app is served under the prefix and without it, as vLLM's FastAPI
    app with ``root_path``: the prefix is the scope's root path (the router matches the rest,
    and /docs links under it); uvicorn's own root_path would instead expect a proxy to have
    stripped it and serve nothing under it."""

    def __init__(self, app: ASGIApp, root_path: str) -> None:
        self.app = app
        self.root_path = root_path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            scope = {**scope, "root_path": self.root_path}
        await self.app(scope, receive, send)
