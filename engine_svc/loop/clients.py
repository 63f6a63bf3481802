"""The engine loop's clients and their requests: what a client receives for an engine step
(``ClientBatch``, with the contract's ``LoadFigures`` every message carries), where it goes
(the client's sink), and which client owns which request (``Clients``).

Request ids are scoped per client: two clients may both send "req-1". Internally a request is
``"{client}/{id}"``; outputs go back under the client's own id.

Imports neither torch nor the engine core: a consumer of batches needs only this module.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from engine_svc.core.outputs import EngineCoreOutput
from engine_svc.core.scheduler import SchedulerStats
from protos.types import FinishReason, LoadFigures


def load_after(load: LoadFigures, s: SchedulerStats) -> LoadFigures:
    """``load`` after a step whose scheduler stats are ``s``: its gauges, and its counters (that
    step's, ``Scheduler.take_stats``) added to ours. A new snapshot per step, so a message built
    on the server's event loop while the loop thread steps on reads one step's figures, never a
    mix of two."""
    return LoadFigures(
        s.num_running,
        s.num_waiting,
        s.kv_cache_usage,
        load.prefix_cache_queries + s.prefix_cache_queries,
        load.prefix_cache_hits + s.prefix_cache_hits,
        load.num_preemptions + s.num_preemptions,
        _names(s.running_lora_adapters),
        _names(s.waiting_lora_adapters),
        num_waiting_deferred=s.num_waiting_deferred,
        spec_num_drafts=load.spec_num_drafts + s.spec_num_drafts,
        spec_num_draft_tokens=load.spec_num_draft_tokens + s.spec_num_draft_tokens,
        spec_num_accepted_tokens=load.spec_num_accepted_tokens + s.spec_num_accepted_tokens,
        spec_accepted_per_pos=_add(load.spec_accepted_per_pos, s.spec_accepted_per_pos),
    )


def _add(total: tuple[int, ...], step: list[int]) -> tuple[int, ...]:
    """Per-position totals plus a step's counts (either may be the longer)."""
    if not step:
        return total
    n = max(len(total), len(step))
    return tuple(
        (total[i] if i < len(total) else 0) + (step[i] if i < len(step) else 0) for i in range(n)
    )


def load_with_gauges(load: LoadFigures, s: SchedulerStats) -> LoadFigures:
    """``load`` with the gauges of ``s`` (requests, KV cache usage, adapters) and its counters
    unchanged: after work between two steps (an abort, a sleep), whose counters the next step's
    ``load_after`` adds (``Scheduler.stats`` reads them without taking them)."""
    return LoadFigures(
        s.num_running,
        s.num_waiting,
        s.kv_cache_usage,
        load.prefix_cache_queries,
        load.prefix_cache_hits,
        load.num_preemptions,
        _names(s.running_lora_adapters),
        _names(s.waiting_lora_adapters),
        num_waiting_deferred=s.num_waiting_deferred,
        spec_num_drafts=load.spec_num_drafts,
        spec_num_draft_tokens=load.spec_num_draft_tokens,
        spec_num_accepted_tokens=load.spec_num_accepted_tokens,
        spec_accepted_per_pos=load.spec_accepted_per_pos,
    )


@dataclass
class ClientBatch:
    """What one client receives for one engine step."""

    outputs: list[EngineCoreOutput] = field(default_factory=list)
    errors: list[tuple[str, Exception]] = field(default_factory=list)  # (request id, error)
    load: LoadFigures | None = None


Sink = Callable[[ClientBatch], None]


def _names(per_adapter: dict[str, int]) -> tuple[str, ...]:
    """The LoRA adapters of a per-adapter count, sorted (empty unless LoRA is on)."""
    return tuple(sorted(per_adapter)) if per_adapter else ()


def internal_id(client: str, request_id: str) -> str:
    """The engine's id for a client's request: ids are the client's own, so two clients may
    use the same one."""
    return f"{client}/{request_id}"


class Clients:
    """The loop's clients (a sink each) and the requests each has in flight, by internal id.

    Not thread-safe: ``EngineLoop`` holds its lock around every use, except ``deliver``, whose
    sink lookups are single dict reads.
    """

    def __init__(self) -> None:
        self._sinks: dict[str, Sink] = {}
        self._owner: dict[str, tuple[str, str]] = {}  # internal id -> (client, request id)

    # ------------------------------------------------------------------ clients
    def register(self, client: str, sink: Sink) -> None:
        self._sinks[client] = sink

    def unregister(self, client: str) -> list[str]:
        """Forget a client; returns the internal ids of the requests it still has in flight."""
        self._sinks.pop(client, None)
        return [i for i, (c, _) in self._owner.items() if c == client]

    def deliver(self, batches: dict[str, ClientBatch], load: LoadFigures) -> None:
        """Hand each client its batch, with ``load``; a client gone gets nothing."""
        for client, batch in batches.items():
            batch.load = load
            sink = self._sinks.get(client)
            if sink is not None:
                sink(batch)

    # ------------------------------------------------------------------ requests
    def __contains__(self, internal: str) -> bool:
        return internal in self._owner

    def __len__(self) -> int:
        return len(self._owner)

    def add(self, internal: str, client: str, request_id: str) -> None:
        self._owner[internal] = (client, request_id)

    def forget(self, internal: str) -> None:
        self._owner.pop(internal, None)

    def in_flight(self) -> list[str]:
        """The internal ids of every request in flight."""
        return list(self._owner)

    def has_requests(self, client: str) -> bool:
        return any(c == client for c, _ in self._owner.values())

    def find(self, client: str | None, request_ids: list[str]) -> list[str]:
        """The internal ids in flight of ``request_ids``: the client's own, or (client None)
        any client's with that id."""
        if client is not None:  # a Stream's abort: its internal ids, looked up directly
            return [i for r in set(request_ids) if (i := internal_id(client, r)) in self._owner]
        wanted = set(request_ids)  # the unary Abort rpc (rare): any client's request with that id
        return [i for i, (_, r) in self._owner.items() if r in wanted]

    # ------------------------------------------------------------------ outputs to batches
    def route(
        self, outputs: list[EngineCoreOutput], errors: list[tuple[str, Exception]]
    ) -> dict[str, ClientBatch]:
        """A step's outputs and errors, by client and under the client's ids; a request that
        finished or failed is forgotten."""
        batches: dict[str, ClientBatch] = {}
        for o in outputs:
            owner = self._owner.get(o.request_id)
            if owner is None:
                continue
            client, rid = owner
            if o.finished:
                del self._owner[o.request_id]
            o.request_id = rid
            batches.setdefault(client, ClientBatch()).outputs.append(o)
        for internal, error in errors:  # failed in the step (a grammar that does not compile)
            owner = self._owner.pop(internal, None)
            if owner is not None:
                client, rid = owner
                batches.setdefault(client, ClientBatch()).errors.append((rid, error))
        return batches

    def aborted(
        self, internal_ids: list[str], finals: dict[str, EngineCoreOutput]
    ) -> dict[str, ClientBatch]:
        """The final ABORT output of each aborted request still owned (the engine's own final
        from ``finals`` when it held the request), by client; each is forgotten."""
        batches: dict[str, ClientBatch] = {}
        for i in internal_ids:
            owner = self._owner.pop(i, None)
            if owner is not None:
                client, rid = owner
                final = finals.get(i) or EngineCoreOutput(rid, [], finish_reason=FinishReason.ABORT)
                final.request_id = rid  # the engine's own final carries the internal id
                batches.setdefault(client, ClientBatch()).outputs.append(final)
        return batches

    def fail_all(self, error: Exception) -> dict[str, ClientBatch]:
        """``error`` for every request in flight, by client; all are forgotten."""
        batches: dict[str, ClientBatch] = {}
        for client, rid in self._owner.values():
            batches.setdefault(client, ClientBatch()).errors.append((rid, error))
        self._owner.clear()
        return batches
