"""The real engine server (``engine_svc.rpc.server.serve``) run in this process, on its own
event loop in a background thread, around an engine core a test may tamper with (stall a step,
crash the loop). For faults a separate process cannot be made to show."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine_svc.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, ServerConfig
from engine_svc.engine_core import EngineCore
from engine_svc.rpc.server import serve
from tests.integration.harness import free_port


def tiny_core(model_dir: Path, served_model_name: str | None = None) -> EngineCore:
    return EngineCore(
        EngineConfig(
            model=ModelConfig(str(model_dir), dtype="float32", served_model_name=served_model_name),
            cache=CacheConfig(num_kv_blocks=64),
            scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256),
        )
    )


class InProcessEngine:
    def __init__(self, build: Callable[[], EngineCore], **config: object) -> None:
        self.port = free_port()
        self.config = ServerConfig(port=self.port, **config)  # type: ignore[arg-type]
        self._build = build
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="inprocess-engine", daemon=True)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout: float = 60.0) -> InProcessEngine:
        self._thread.start()
        if not self._ready.wait(timeout) or self._error is not None:
            raise RuntimeError(f"in-process engine did not start: {self._error!r}")
        return self

    def stop(self, timeout: float = 30.0) -> None:
        if self._loop is not None and self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout)

    def _run(self) -> None:
        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            started = asyncio.Event()
            task = asyncio.create_task(serve(self._build, self.config, started, self._stop))
            waiter = asyncio.create_task(started.wait())
            await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
            if task.done():
                waiter.cancel()
                task.result()  # raises the start-up error
                return
            self._ready.set()
            await task

        try:
            asyncio.run(main())
        except BaseException as e:
            self._error = e
        finally:
            self._ready.set()


class StallableCore:
    """A real core whose next step waits while ``stall`` is set (until ``release``), or raises
    while ``crash`` is set. ``stalled`` tells that a step is waiting."""

    def __init__(self, core: EngineCore) -> None:
        self._core = core
        self.stall = threading.Event()
        self.release = threading.Event()
        self.crash = threading.Event()
        self.stalled = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._core, name)

    def step(self) -> Any:
        if self.crash.is_set():
            raise RuntimeError("injected fault")
        if self.stall.is_set():
            self.stalled.set()
            self.release.wait(60)
        return self._core.step()


def start_stallable(
    model_dir: Path, served_model_name: str | None = None, **config: object
) -> tuple[InProcessEngine, StallableCore]:
    """An in-process engine serving ``model_dir`` through a :class:`StallableCore`."""
    holder: list[StallableCore] = []

    def build() -> EngineCore:
        holder.append(StallableCore(tiny_core(model_dir, served_model_name)))
        return holder[0]  # type: ignore[return-value]

    server = InProcessEngine(build, **config).start()
    return server, holder[0]
