"""Every engine behind this gateway: one :class:`EngineClient` (one ``Stream``) per engine.

``--engine`` names the engines: ``HOST:PORT``, several separated by commas, or
``dns:///NAME:PORT`` (a Kubernetes headless Service), whose addresses are looked up again every
``resolve_interval_s`` so engines that scale up join and engines that go away leave.

A request goes to the engine :class:`~frontend_svc.engine.router.Router` picks among the connected
ones. When that engine fails the request before it produced a token (stream broken, draining,
queue full) it is sent to another engine; once tokens have reached the client, the error is the
client's. An engine whose stream breaks leaves the rotation at once and rejoins when its client
reconnects. Engines must serve the same model and tokenizer; one that does not is kept out.

LoRA adapters and the engine's utility calls (sleep, prefix-cache reset, profiling) act on every
connected engine at once, as vLLM's data-parallel engines do; their answers are combined (asleep
only if every engine is) and a failure names the engine. A load that fails on one engine is
undone on the others. The pool keeps each engine's adapters (read with ListLoras when it
connects, after each load and unload, and when a request names an adapter nobody here knows: it
may have been loaded through another gateway); a request with an adapter only goes to an engine
that has it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from frontend_svc.config import FrontendConfig
from frontend_svc.engine.client import EngineClient
from frontend_svc.engine.router import Router
from frontend_svc.engine.targets import (
    EngineTarget,
    channel_credentials,
    parse_engine_targets,
    resolve,
)
from frontend_svc.engine.types import (
    EngineCallError,
    EngineErrorCode,
    EngineOutput,
    EngineRequest,
    EngineRequestError,
    EngineUnavailableError,
    FinishReason,
    LoadFigures,
    LoraAdapter,
    ModelInfo,
    TokenizerFiles,
)

logger = logging.getLogger(__name__)
T = TypeVar("T")

OnConnect = Callable[[ModelInfo, TokenizerFiles], Awaitable[None]]
OnLoad = Callable[[str, LoadFigures], None]
OnRoute = Callable[[str, int], None]  # engine address, prompt tokens expected to hit its cache
OnAccept = Callable[[str, ModelInfo], None]  # an engine (re)connected and joined the rotation
OnStep = Callable[[str, int, int, Sequence[int]], None]  # engine address, then EngineClient's

# Failures that leave the request untouched on the engine, so another engine may take it.
_RETRYABLE_CODES = (EngineErrorCode.RESOURCE_EXHAUSTED, EngineErrorCode.UNAVAILABLE)


@dataclass
class _Engine:
    client: EngineClient
    target: EngineTarget
    in_flight: int = 0
    reported: int = 0  # running + waiting in the engine's latest load figures
    info: ModelInfo | None = None
    files: TokenizerFiles | None = None
    retiring: bool = False  # left DNS: no new requests, closed once idle
    loras: dict[str, LoraAdapter] = field(default_factory=dict)  # its adapters, by name
    sleeping: bool = False  # put to sleep (by this gateway, or found asleep on connecting)

    @property
    def load(self) -> int:
        return max(self.in_flight, self.reported)


class EnginePool:
    """Connections to every engine, and the choice of one per request."""

    def __init__(
        self,
        config: FrontendConfig,
        on_connect: OnConnect | None = None,
        on_load: OnLoad | None = None,
        on_route: OnRoute | None = None,
        on_leave: Callable[[str], None] | None = None,
        on_accept: OnAccept | None = None,
        on_step: OnStep | None = None,
    ) -> None:
        self.config = config
        self.targets = parse_engine_targets(config.engine_address)
        self.router = Router(
            config.routing.affinity_min_tokens, config.routing.affinity_max_imbalance
        )
        self._credentials = channel_credentials(config.tls)
        self._on_connect = on_connect
        self._on_load = on_load
        self._on_route = on_route
        self._on_leave = on_leave  # an engine left for good (DNS): drop what is kept about it
        self._on_accept = on_accept
        self._on_step = on_step
        self._engines: dict[str, _Engine] = {}
        self._resolver: asyncio.Task[None] | None = None
        self._closing: set[asyncio.Task[None]] = set()
        self.last_error: str | None = None
        # Loads, unloads and adapter-list reads take turns, so a list read before a load
        # cannot overwrite what the load recorded.
        self._lora_lock = asyncio.Lock()
        self._loras_read_at = 0.0  # time.monotonic() of the last read of every engine's list

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        """Connect to the fixed addresses now; look DNS names up in the background."""
        for t in self.targets:
            if not t.dns:
                self._add(t.address, t)
        if any(t.dns for t in self.targets) and self._resolver is None:
            self._resolver = asyncio.create_task(self._resolve_forever(), name="engine-dns")

    async def close(self) -> None:
        if self._resolver is not None:
            self._resolver.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._resolver
            self._resolver = None
        await asyncio.gather(*(e.client.close() for e in self._engines.values()), *self._closing)
        self._engines.clear()

    # -- state ------------------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        return any(self._usable(e) for e in self._engines.values())

    async def wait_connected(self, timeout: float) -> bool:
        deadline = asyncio.get_running_loop().time() + timeout
        while not self.connected and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        return self.connected

    @property
    def num_in_flight(self) -> int:
        return sum(e.in_flight for e in self._engines.values())

    def describe(self) -> list[dict[str, object]]:
        """Per-engine state, for /health and logs."""
        return [
            {
                "address": a,
                "connected": e.client.connected,
                "serving": self._usable(e),
                "in_flight": e.in_flight,
                "load": e.load,
                **({"sleeping": True} if e.sleeping and not e.client.serving else {}),
                **({"error": e.client.last_error} if e.client.last_error else {}),
                **({"retiring": True} if e.retiring else {}),
            }
            for a, e in sorted(self._engines.items())
        ]

    def unavailable_reason(self) -> str:
        errors = []
        for a, e in self._engines.items():
            if e.client.connected and not e.client.serving and e.sleeping:
                errors.append(f"{a}: asleep (POST /wake_up wakes it)")
            elif e.client.connected and not e.client.serving:
                errors.append(f"{a}: not serving (draining, stalled or asleep)")
            elif not e.client.connected and e.client.last_error:
                errors.append(f"{a}: {e.client.last_error}")
        if not self._engines:
            return f"no engine address resolved from {self.config.engine_address}" + (
                f" ({self.last_error})" if self.last_error else ""
            )
        detail = "; ".join(errors) if errors else "connecting"
        return f"no engine can serve ({detail})"

    # -- requests ---------------------------------------------------------------------------

    async def generate(self, request: EngineRequest) -> AsyncGenerator[EngineOutput, None]:
        """Run ``request`` on the chosen engine, moving it while no token has been produced.

        Raises like :meth:`EngineClient.generate`; closing the generator aborts the request.
        """
        tried: set[str] = set()
        last_error: Exception | None = None
        lora = request.lora_name
        while True:
            engine = self._pick(request, tried)
            if engine is None:
                if last_error is None and lora and not self.has_adapter(lora):
                    last_error = EngineRequestError(
                        EngineErrorCode.NOT_FOUND,
                        f"The LoRA adapter `{lora}` is not loaded on any engine.",
                    )
                raise last_error or EngineUnavailableError(self.unavailable_reason())
            address = engine.client.address
            tried.add(address)
            produced = False
            engine.in_flight += 1
            try:
                # The request's collector is read here, not through EngineClient.generate: a
                # generator and a coroutine fewer to resume for every token (~0.5 us of ~16).
                handle = engine.client.open(request)
                collector = handle.collector
                try:
                    while True:
                        out = collector.take()
                        if out is None:
                            await collector.wait()
                            continue
                        if not produced and out.finish_reason is FinishReason.ABORT:
                            raise EngineUnavailableError(f"engine {address} aborted the request")
                        produced = True
                        yield out
                        if out.finished:
                            return
                finally:
                    # Aborts the request unless its last output or error was taken (the
                    # sequence stops reading after the last output: that is no early leave).
                    handle.close()
            except (EngineUnavailableError, EngineRequestError) as e:
                retryable = isinstance(e, EngineUnavailableError) or e.code in _RETRYABLE_CODES
                if (
                    lora
                    and isinstance(e, EngineRequestError)
                    and e.code is EngineErrorCode.NOT_FOUND
                ):
                    # Unloaded behind this gateway's back (another gateway): another engine may
                    # still have it.
                    engine.loras.pop(lora, None)
                    retryable = True
                if produced or not retryable:
                    raise
                logger.info("request %s: engine %s failed (%s)", request.request_id, address, e)
                last_error = e
            finally:
                engine.in_flight -= 1
                if engine.retiring and engine.in_flight == 0:
                    self._retire_now(address)

    def _usable(self, e: _Engine) -> bool:
        return e.client.serving and e.info is not None and not e.retiring

    def _pick(self, request: EngineRequest, exclude: set[str]) -> _Engine | None:
        lora = request.lora_name
        candidates = {
            a: e
            for a, e in self._engines.items()
            if self._usable(e) and a not in exclude and (not lora or lora in e.loras)
        }
        if not candidates:
            return None
        choice = self.router.choose(
            request.prompt_token_ids, {a: e.load for a, e in candidates.items()}, lora
        )
        if self._on_route is not None:
            self._on_route(choice.address, choice.affinity_tokens)
        return candidates[choice.address]

    # -- LoRA adapters and utility calls: on every engine ------------------------------------

    def adapters(self) -> dict[str, LoraAdapter]:
        """The adapters of the engines in rotation (name -> adapter), by engine, in load order."""
        out: dict[str, LoraAdapter] = {}
        for _, e in sorted(self._engines.items()):
            if e.info is not None and not e.retiring:
                for name, adapter in e.loras.items():
                    out.setdefault(name, adapter)
        return out

    def has_adapter(self, name: str) -> bool:
        """Whether an engine in rotation has adapter ``name`` (no rpc)."""
        return any(
            name in e.loras for e in self._engines.values() if e.info is not None and not e.retiring
        )

    async def refresh_adapters(self, max_age_s: float = 0.0, wait: bool = True) -> None:
        """Read every connected engine's adapters again, unless that was done within
        ``max_age_s`` seconds (calls that arrive together share one read). An engine that fails
        to answer keeps what was known of it. ``wait=False``: skip it while a load or unload
        runs (it will read them when done) rather than wait for that."""
        if not wait and self._lora_lock.locked():
            return
        async with self._lora_lock:
            if time.monotonic() - self._loras_read_at < max_age_s:
                return
            await self._read_adapters()

    async def _read_adapters(self) -> None:
        self._loras_read_at = time.monotonic()
        engines = self._connected_engines()
        for e, result in await _each(engines, lambda c: c.list_loras()):
            if isinstance(result, EngineCallError) and result.code is EngineErrorCode.UNIMPLEMENTED:
                e.loras = {}
            elif isinstance(result, Exception):
                logger.warning("reading the adapters of %s: %s", e.client.address, result)
            else:
                e.loras = {a.name: a for a in result}

    async def add_lora(self, name: str, path: str, pin: bool = False) -> None:
        """Load an adapter on every connected engine. If any engine fails, it is unloaded again
        from those that loaded it, and the error (the first failing engine's) says so."""
        async with self._lora_lock:
            engines = self._connected_engines(required=True)
            results = await _each(engines, lambda c: c.add_lora(name, path, pin))
            failures = [(e, r) for e, r in results if isinstance(r, Exception)]
            loaded = [e for e, r in results if not isinstance(r, Exception)]
            if failures:
                undo = await _each(loaded, lambda c: c.remove_lora(name))
                notes = [
                    f"unloading it again from {e.client.address} failed: {r}"
                    if isinstance(r, Exception)
                    else f"it was unloaded again from {e.client.address}, which had loaded it"
                    for e, r in undo
                ]
                raise _combined(failures, len(engines), notes)
            for e, result in results:
                assert isinstance(result, LoraAdapter)
                e.loras[name] = result
            await self._read_adapters()

    async def remove_lora(self, name: str) -> None:
        """Unload an adapter from every connected engine (an engine that does not have it, or
        knows no adapters at all, is fine). NOT_FOUND when no engine had it."""
        async with self._lora_lock:
            engines = self._connected_engines(required=True)
            results = await _each(engines, lambda c: c.remove_lora(name))
            absent = (EngineErrorCode.NOT_FOUND, EngineErrorCode.UNIMPLEMENTED)
            failures, missing, removed = [], [], 0
            for e, result in results:
                if isinstance(result, EngineCallError) and result.code in absent:
                    missing.append((e, result))
                elif isinstance(result, Exception):
                    failures.append((e, result))
                    continue
                else:
                    removed += 1
                e.loras.pop(name, None)
            await self._read_adapters()
            if failures:
                raise _combined(failures, len(engines))
            if not removed:
                raise _combined(missing[:1], 1)

    async def reset_prefix_cache(self) -> bool:
        """Reset every engine's prefix cache; False when some kept entries in use."""
        return all(await self._on_every_engine(lambda c: c.reset_prefix_cache()))

    async def sleep(self, level: int) -> None:
        """Put every engine to sleep (those that failed stay awake; the error names them)."""
        await self._on_every_engine(lambda c: c.sleep(level), sleeping=True)

    async def wake_up(self) -> None:
        await self._on_every_engine(lambda c: c.wake_up(), sleeping=False)

    async def is_sleeping(self) -> bool:
        """True when every connected engine sleeps."""
        return all(await self._on_every_engine(lambda c: c.is_sleeping()))

    async def start_profile(self) -> None:
        await self._on_every_engine(lambda c: c.start_profile())

    async def stop_profile(self) -> list[str]:
        """Where each engine wrote its trace."""
        return await self._on_every_engine(lambda c: c.stop_profile())

    async def _on_every_engine(
        self, call: Callable[[EngineClient], Awaitable[T]], sleeping: bool | None = None
    ) -> list[T]:
        """``call`` on every connected engine at once; the results in address order, or the
        first failure (naming the engine when there are several). ``sleeping``: what a
        success means for the engine's sleep state."""
        engines = self._connected_engines(required=True)
        results = await _each(engines, call)
        failures = [(e, r) for e, r in results if isinstance(r, Exception)]
        if sleeping is not None:
            for e, result in results:
                if not isinstance(result, Exception):
                    e.sleeping = sleeping
        if failures:
            raise _combined(failures, len(engines))
        return [r for _, r in results if not isinstance(r, Exception)]

    def _connected_engines(self, required: bool = False) -> list[_Engine]:
        """Engines accepted and connected (serving or not: a sleeping engine is reachable), in
        address order. ``required``: an :class:`EngineUnavailableError` when there is none."""
        engines = [
            e
            for _, e in sorted(self._engines.items())
            if e.client.connected and e.info is not None and not e.retiring
        ]
        if required and not engines:
            raise EngineUnavailableError(self.unavailable_reason())
        return engines

    # -- engines joining and leaving --------------------------------------------------------

    def _add(self, address: str, target: EngineTarget) -> None:
        if address in self._engines:
            self._engines[address].retiring = False
            return
        server_name = self.config.tls.server_name or (target.host if target.dns else None)
        client = EngineClient(
            address,
            backoff=self.config.backoff,
            rpc_timeout_s=self.config.engine_rpc_timeout_s,
            window=self.config.engine_window,
            on_connect=functools.partial(self._engine_connected, address),
            on_load=functools.partial(self._engine_load, address),
            on_disconnect=functools.partial(self._engine_disconnected, address),
            on_step=functools.partial(self._on_step, address) if self._on_step else None,
            credentials=self._credentials,
            server_name=server_name if self._credentials is not None else None,
        )
        self._engines[address] = _Engine(client, target)
        client.start()
        logger.info("engine %s joined (%s)", address, "DNS" if target.dns else "static")

    def _retire(self, address: str) -> None:
        engine = self._engines.get(address)
        if engine is None or engine.retiring:
            return
        engine.retiring = True
        self.router.forget(address)
        logger.info("engine %s left DNS: no new requests, %d in flight", address, engine.in_flight)
        if engine.in_flight == 0:
            self._retire_now(address)

    def _retire_now(self, address: str) -> None:
        engine = self._engines.pop(address, None)
        if engine is None:
            return
        task = asyncio.get_running_loop().create_task(engine.client.close())
        self._closing.add(task)  # keep a reference until it is done
        task.add_done_callback(self._closing.discard)
        if self._on_leave is not None:
            self._on_leave(address)

    async def _engine_connected(self, address: str, info: ModelInfo, files: TokenizerFiles) -> None:
        """Accept an engine (re)connecting if it serves what the connected ones serve."""
        engine = self._engines.get(address)
        if engine is None:
            raise EngineUnavailableError(f"engine {address} is no longer configured")
        engine.info = None  # out of rotation until accepted
        loras, sleeping = await _adapters_and_sleep(engine.client)
        others = [
            e
            for a, e in self._engines.items()
            if a != address and e.info is not None and not e.retiring
        ]
        for other in others:
            assert other.info is not None and other.files is not None
            mismatch = _mismatch(other.info, other.files, info, files)
            if mismatch:
                raise ValueError(
                    f"engine {address} differs from engine {other.client.address}: {mismatch}; "
                    "every engine behind one gateway must serve the same model"
                )
        self.router.forget(address)  # a (re)connected engine starts with an empty cache
        self.router.set_block_size(info.block_size)
        engine.reported = 0
        engine.loras, engine.sleeping = loras or {}, sleeping
        if loras is None:
            self._loras_read_at = 0.0  # the next refresh_adapters reads them, however recent
        engine.info, engine.files = info, files  # claimed before the await below
        if self._on_connect is not None:
            # Prompts are checked against the tightest context length among the engines.
            tightest = min([info.max_model_len] + [o.info.max_model_len for o in others if o.info])
            try:
                await self._on_connect(dataclasses.replace(info, max_model_len=tightest), files)
            except BaseException:
                engine.info = engine.files = None
                raise
        if self._on_accept is not None:
            self._on_accept(address, info)

    def _engine_disconnected(self, address: str) -> None:
        engine = self._engines.get(address)
        if engine is not None:
            engine.info = engine.files = None

    def _engine_load(self, address: str, load: LoadFigures) -> None:
        engine = self._engines.get(address)
        if engine is not None:
            engine.reported = load.num_running + load.num_waiting
        if self._on_load is not None:
            self._on_load(address, load)

    async def _resolve_forever(self) -> None:
        known: dict[EngineTarget, set[str]] = {}
        while True:
            for target in (t for t in self.targets if t.dns):
                try:
                    known[target] = await resolve(target)
                except (OSError, UnicodeError) as e:  # keep the last answer: not an outage
                    self.last_error = f"cannot resolve {target.host}: {e}"
                    logger.warning("%s", self.last_error)
                    continue
                self.last_error = None
            wanted = {a: t for t, addresses in known.items() for a in addresses}
            for address, target in wanted.items():
                self._add(address, target)
            for address, engine in list(self._engines.items()):
                if engine.target.dns and address not in wanted:
                    self._retire(address)
            await asyncio.sleep(self.config.routing.resolve_interval_s)


async def _each(
    engines: Sequence[_Engine], call: Callable[[EngineClient], Awaitable[T]]
) -> list[tuple[_Engine, T | Exception]]:
    """``call`` on every engine's client at once: (engine, result or the exception it raised)."""
    results = await asyncio.gather(*(call(e.client) for e in engines), return_exceptions=True)
    out: list[tuple[_Engine, T | Exception]] = []
    for engine, result in zip(engines, results, strict=True):
        if isinstance(result, BaseException) and not isinstance(result, Exception):
            raise result  # cancelled
        out.append((engine, result))
    return out


def _combined(
    failures: Sequence[tuple[_Engine, Exception]], num_engines: int, notes: Sequence[str] = ()
) -> Exception:
    """One error for the failures of a call made on ``num_engines`` engines: the first one's
    kind, every failure's message, each naming its engine when there were several."""
    first = failures[0][1]
    if num_engines == 1 and not notes:
        return first
    parts = [f"engine {e.client.address}: {_message(err)}" for e, err in failures]
    message = "; ".join(parts + list(notes))
    if isinstance(first, EngineCallError):
        return EngineCallError(first.rpc, first.address, first.code, message)
    if isinstance(first, EngineUnavailableError):
        return EngineUnavailableError(message)
    return first


def _message(error: Exception) -> str:
    return error.message if isinstance(error, EngineCallError) else str(error)


async def _adapters_and_sleep(client: EngineClient) -> tuple[dict[str, LoraAdapter] | None, bool]:
    """A connecting engine's adapters and sleep state. An engine that predates those rpcs has
    no adapters and is awake; one that fails to answer (a stalled loop) is taken all the same,
    its adapters unknown (None) until the next read: the base model need not wait for them."""
    listed, sleeping = await asyncio.gather(
        client.list_loras(), client.is_sleeping(), return_exceptions=True
    )
    for what, result in (("its adapters", listed), ("whether it sleeps", sleeping)):
        if isinstance(result, BaseException) and not isinstance(result, Exception):
            raise result  # cancelled
        if isinstance(result, Exception) and not (
            isinstance(result, EngineCallError) and result.code is EngineErrorCode.UNIMPLEMENTED
        ):
            logger.warning("asking %s %s: %s", client.address, what, result)
    loras = None if isinstance(listed, BaseException) else {a.name: a for a in listed}
    if isinstance(listed, EngineCallError) and listed.code is EngineErrorCode.UNIMPLEMENTED:
        loras = {}
    return loras, sleeping is True


def _mismatch(
    a: ModelInfo, a_files: TokenizerFiles, b: ModelInfo, b_files: TokenizerFiles
) -> str | None:
    if a.served_model_name != b.served_model_name:
        return f"model {b.served_model_name!r}, not {a.served_model_name!r}"
    if a.vocab_size != b.vocab_size:
        return f"vocabulary size {b.vocab_size}, not {a.vocab_size}"
    if a.block_size != b.block_size:
        return f"KV block size {b.block_size}, not {a.block_size}"
    if a_files != b_files:
        return "another tokenizer"
    return None
