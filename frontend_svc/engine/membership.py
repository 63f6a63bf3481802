"""The engines behind this gateway, joining and leaving: one :class:`EngineClient` (one
``Stream``) per engine, and what the gateway knows of each.

``--engine`` names the engines: ``HOST:PORT``, several separated by commas, or
``dns:///NAME:PORT`` (a Kubernetes headless Service), whose addresses are looked up again every
``resolve_interval_s`` so engines that scale up join and engines that go away leave (no new
requests; closed once their requests are done).

An engine that (re)connects joins the rotation once it is accepted: it must serve the same model
and tokenizer as the engines already in it (one that does not is kept out), and the gateway's
observer is told (``connected``, with the tightest context length among them, then
``accepted``). Its adapters and sleep state are read as it joins. An engine whose stream breaks
leaves the rotation at once and rejoins when its client reconnects.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from frontend_svc.config import FrontendConfig
from frontend_svc.engine.client import EngineClient
from frontend_svc.engine.errors import EngineCallError, EngineUnavailableError
from frontend_svc.engine.events import EngineEvents
from frontend_svc.engine.router import Router
from frontend_svc.engine.targets import (
    EngineTarget,
    channel_credentials,
    parse_engine_targets,
    resolve,
)
from protos.types import EngineErrorCode, LoadFigures, LoraAdapter, ModelInfo, TokenizerFiles

logger = logging.getLogger(__name__)


@dataclass
class Member:
    """One engine behind the gateway: its client and what is known of it."""

    client: EngineClient
    target: EngineTarget
    in_flight: int = 0
    reported: int = 0  # running + waiting in the engine's latest load figures
    info: ModelInfo | None = None  # set while accepted (connected, in rotation unless retiring)
    files: TokenizerFiles | None = None
    retiring: bool = False  # left DNS: no new requests, closed once idle
    loras: dict[str, LoraAdapter] = field(default_factory=dict)  # its adapters, by name
    sleeping: bool = False  # put to sleep (by this gateway, or found asleep on connecting)

    @property
    def load(self) -> int:
        return max(self.in_flight, self.reported)

    @property
    def in_rotation(self) -> bool:
        """Accepted and not retiring (serving requests or not: it may sleep or drain)."""
        return self.info is not None and not self.retiring

    @property
    def usable(self) -> bool:
        """In rotation, and its engine says it can generate: new requests may go to it."""
        return self.client.serving and self.info is not None and not self.retiring


class EngineMembership(EngineEvents):
    """The engines behind the gateway, by address. It observes their clients and tells
    ``events`` (the gateway) what it should know."""

    def __init__(self, config: FrontendConfig, events: EngineEvents, router: Router) -> None:
        self.config = config
        self.targets = parse_engine_targets(config.engine_address)
        self.router = router  # told when an engine (re)joins or leaves: its cache is gone
        self.engines: dict[str, Member] = {}
        self.last_error: str | None = None
        # An engine joined whose adapters are unknown (it did not answer ListLoras): the next
        # read of the adapter lists must not be skipped as recent.
        self.adapters_stale = False
        self._events = events
        self._credentials = channel_credentials(config.tls)
        self._resolver: asyncio.Task[None] | None = None
        self._closing: set[asyncio.Task[None]] = set()

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
        await asyncio.gather(*(e.client.close() for e in self.engines.values()), *self._closing)
        self.engines.clear()

    # -- state ------------------------------------------------------------------------------

    @property
    def serving(self) -> bool:
        """Whether some engine can take a request now."""
        return any(e.usable for e in self.engines.values())

    async def wait_serving(self, timeout: float) -> bool:
        deadline = asyncio.get_running_loop().time() + timeout
        while not self.serving and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        return self.serving

    @property
    def num_in_flight(self) -> int:
        return sum(e.in_flight for e in self.engines.values())

    def describe(self) -> list[dict[str, object]]:
        """Per-engine state, for /health and logs."""
        return [
            {
                "address": a,
                "connected": e.client.connected,
                "serving": e.usable,
                "in_flight": e.in_flight,
                "load": e.load,
                **({"sleeping": True} if e.sleeping and not e.client.serving else {}),
                **({"error": e.client.last_error} if e.client.last_error else {}),
                **({"retiring": True} if e.retiring else {}),
            }
            for a, e in sorted(self.engines.items())
        ]

    def unavailable_reason(self) -> str:
        errors = []
        for a, e in self.engines.items():
            if e.client.connected and not e.client.serving and e.sleeping:
                errors.append(f"{a}: asleep (POST /wake_up wakes it)")
            elif e.client.connected and not e.client.serving:
                errors.append(f"{a}: not serving (draining, stalled or asleep)")
            elif not e.client.connected and e.client.last_error:
                errors.append(f"{a}: {e.client.last_error}")
        if not self.engines:
            return f"no engine address resolved from {self.config.engine_address}" + (
                f" ({self.last_error})" if self.last_error else ""
            )
        detail = "; ".join(errors) if errors else "connecting"
        return f"no engine can serve ({detail})"

    def in_rotation(self) -> list[Member]:
        """The engines accepted and not retiring, in address order."""
        return [e for _, e in sorted(self.engines.items()) if e.in_rotation]

    def reachable(self, required: bool = False) -> list[Member]:
        """Engines in rotation and connected (serving or not: a sleeping engine is reachable),
        in address order. ``required``: an :class:`EngineUnavailableError` when there is none."""
        engines = [e for e in self.in_rotation() if e.client.connected]
        if required and not engines:
            raise EngineUnavailableError(self.unavailable_reason())
        return engines

    def request_ended(self, engine: Member) -> None:
        """One request fewer in flight on ``engine``; a retiring engine closes once idle."""
        engine.in_flight -= 1
        if engine.retiring and engine.in_flight == 0:
            self._retire_now(engine.client.address)

    # -- events from the clients ------------------------------------------------------------

    async def connected(self, address: str, info: ModelInfo, files: TokenizerFiles) -> None:
        """Accept an engine (re)connecting if it serves what the connected ones serve."""
        engine = self.engines.get(address)
        if engine is None:
            raise EngineUnavailableError(f"engine {address} is no longer configured")
        engine.info = None  # out of rotation until accepted
        loras, sleeping = await _adapters_and_sleep(engine.client)
        others = [e for a, e in self.engines.items() if a != address and e.in_rotation]
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
            self.adapters_stale = True  # the next read of the adapters reads them, however recent
        engine.info, engine.files = info, files  # claimed before the await below
        # Prompts are checked against the tightest context length among the engines.
        tightest = min([info.max_model_len] + [o.info.max_model_len for o in others if o.info])
        try:
            await self._events.connected(
                address, dataclasses.replace(info, max_model_len=tightest), files
            )
        except BaseException:
            engine.info = engine.files = None
            raise
        self._events.accepted(address, info)

    def disconnected(self, address: str) -> None:
        engine = self.engines.get(address)
        if engine is not None:
            engine.info = engine.files = None
        self._events.disconnected(address)

    def load(self, address: str, load: LoadFigures) -> None:
        engine = self.engines.get(address)
        if engine is not None:
            engine.reported = load.num_running + load.num_waiting
        self._events.load(address, load)

    def step(
        self,
        address: str,
        prompt_tokens: int,
        generation_tokens: int,
        step_tokens: Sequence[int],
    ) -> None:
        self._events.step(address, prompt_tokens, generation_tokens, step_tokens)

    # -- joining and leaving ----------------------------------------------------------------

    def _add(self, address: str, target: EngineTarget) -> None:
        if address in self.engines:
            self.engines[address].retiring = False
            return
        server_name = self.config.tls.server_name or (target.host if target.dns else None)
        client = EngineClient(
            address,
            backoff=self.config.backoff,
            rpc_timeout_s=self.config.engine_rpc_timeout_s,
            window=self.config.engine_window,
            events=self,
            credentials=self._credentials,
            server_name=server_name if self._credentials is not None else None,
        )
        self.engines[address] = Member(client, target)
        client.start()
        logger.info("engine %s joined (%s)", address, "DNS" if target.dns else "static")

    def _retire(self, address: str) -> None:
        engine = self.engines.get(address)
        if engine is None or engine.retiring:
            return
        engine.retiring = True
        self.router.forget(address)
        logger.info("engine %s left DNS: no new requests, %d in flight", address, engine.in_flight)
        if engine.in_flight == 0:
            self._retire_now(address)

    def _retire_now(self, address: str) -> None:
        engine = self.engines.pop(address, None)
        if engine is None:
            return
        task = asyncio.get_running_loop().create_task(engine.client.close())
        self._closing.add(task)  # keep a reference until it is done
        task.add_done_callback(self._closing.discard)
        self._events.left(address)

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
            for address, engine in list(self.engines.items()):
                if engine.target.dns and address not in wanted:
                    self._retire(address)
            await asyncio.sleep(self.config.routing.resolve_interval_s)


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
