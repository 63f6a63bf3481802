"""LoRA adapters and the engine's utility calls (sleep, prefix-cache reset, profiling), on every
engine behind the gateway at once, as vLLM's data-parallel engines do.

Their answers are combined (asleep only if every engine is) and a failure names the engine. A
load that fails on one engine is undone on the others. Each engine's adapters are kept on its
:class:`~frontend_svc.engine.membership.Member` (read with ListLoras when it joins, after each
load and unload, and when a request names an adapter nobody here knows: it may have been loaded
through another gateway); the pool sends a request with an adapter only to an engine that has it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from frontend_svc.engine.client import EngineClient
from frontend_svc.engine.errors import EngineCallError, EngineUnavailableError
from frontend_svc.engine.membership import EngineMembership, Member
from protos.types import EngineErrorCode, LoraAdapter

logger = logging.getLogger(__name__)
T = TypeVar("T")


class EngineFanOut:
    """Calls made on every engine in rotation (``members``)."""

    def __init__(self, members: EngineMembership) -> None:
        self.members = members
        # Loads, unloads and adapter-list reads take turns, so a list read before a load
        # cannot overwrite what the load recorded.
        self._lora_lock = asyncio.Lock()
        self._loras_read_at = 0.0  # time.monotonic() of the last read of every engine's list

    # -- LoRA adapters ----------------------------------------------------------------------

    def adapters(self) -> dict[str, LoraAdapter]:
        """The adapters of the engines in rotation (name -> adapter), by engine, in load order."""
        out: dict[str, LoraAdapter] = {}
        for e in self.members.in_rotation():
            for name, adapter in e.loras.items():
                out.setdefault(name, adapter)
        return out

    def has_adapter(self, name: str) -> bool:
        """Whether an engine in rotation has adapter ``name`` (no rpc)."""
        return any(name in e.loras for e in self.members.engines.values() if e.in_rotation)

    async def refresh_adapters(self, max_age_s: float = 0.0, wait: bool = True) -> None:
        """Read every connected engine's adapters again, unless that was done within
        ``max_age_s`` seconds (calls that arrive together share one read). An engine that fails
        to answer keeps what was known of it. ``wait=False``: skip it while a load or unload
        runs (it will read them when done) rather than wait for that."""
        if not wait and self._lora_lock.locked():
            return
        async with self._lora_lock:
            recent = time.monotonic() - self._loras_read_at < max_age_s
            if recent and not self.members.adapters_stale:
                return
            await self._read_adapters()

    async def _read_adapters(self) -> None:
        self._loras_read_at = time.monotonic()
        self.members.adapters_stale = False
        engines = self.members.reachable()
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
            engines = self.members.reachable(required=True)
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
            engines = self.members.reachable(required=True)
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

    # -- utility calls ----------------------------------------------------------------------

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
        engines = self.members.reachable(required=True)
        results = await _each(engines, call)
        failures = [(e, r) for e, r in results if isinstance(r, Exception)]
        if sleeping is not None:
            for e, result in results:
                if not isinstance(result, Exception):
                    e.sleeping = sleeping
        if failures:
            raise _combined(failures, len(engines))
        return [r for _, r in results if not isinstance(r, Exception)]


async def _each(
    engines: Sequence[Member], call: Callable[[EngineClient], Awaitable[T]]
) -> list[tuple[Member, T | Exception]]:
    """``call`` on every engine's client at once: (engine, result or the exception it raised)."""
    results = await asyncio.gather(*(call(e.client) for e in engines), return_exceptions=True)
    out: list[tuple[Member, T | Exception]] = []
    for engine, result in zip(engines, results, strict=True):
        if isinstance(result, BaseException) and not isinstance(result, Exception):
            raise result  # cancelled
        out.append((engine, result))
    return out


def _combined(
    failures: Sequence[tuple[Member, Exception]], num_engines: int, notes: Sequence[str] = ()
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
