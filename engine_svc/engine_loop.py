"""The engine busy loop in its own thread, fed by a thread-safe input queue.

    gRPC handlers (asyncio) --submit/abort--> queue --> loop thread: drain, step(), route
    per-client sink  <--call_soon_threadsafe-- outputs of that client's requests, once per step

Other work on the engine (LoRA adapters added, removed, pinned; utility calls) goes through the
same queue as a call (``call``): it runs between two steps, in order with the requests queued
before and after it, and its result comes back on a future.

Sleep mode (``sleep`` / ``wake_up``): from the moment ``sleep`` is called the engine refuses new
requests (``Asleep``, an ``Unavailable``: health NOT_SERVING), while the ones already taken in
run to their end; once none is left the core goes to sleep and the future resolves. While asleep
the loop never steps, but it still drains its queue (calls, aborts) and keeps its heartbeat fresh,
so the stall detector never takes a sleeping engine for a stalled one. ``wake_up`` wakes it (or
cancels a sleep still waiting for its requests: that ``sleep`` future fails with
``SleepCancelled``).

Request ids are scoped per client: two clients may both send "req-1". Internally a request is
``"{client}/{id}"``; outputs go back under the client's own id.

The loop thread also *builds* the engine core, so that every torch operation of the engine runs on
this one thread. PyTorch's CPU kernels use OpenMP (libgomp), which gives each thread that starts
a parallel region a worker pool of its own; once more pool threads exist than cores, libgomp
sleeps at every barrier instead of spinning. Loading the model on the main thread and stepping on
this one did exactly that on a 2-core machine: 431 vs 602 output tok/s for the same workload, with
~45k futex sleeps instead of ~30 (benchmarks/results/serve_cpu.md).
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from engine_svc.core.engine_core import EngineCore
from engine_svc.core.errors import DuplicateRequestError
from engine_svc.core.outputs import EngineCoreOutput
from engine_svc.core.pooling_params import PoolingParams
from engine_svc.core.request import FinishReason
from engine_svc.core.sampling_params import SamplingParams
from engine_svc.core.scheduler import SchedulerStats
from engine_svc.worker.sleep_mode import check_sleep_level

logger = logging.getLogger(__name__)
T = TypeVar("T")

_IDLE_WAIT_S = 0.5  # an idle loop wakes this often, so its heartbeat stays fresh


@dataclass(frozen=True, slots=True)
class LoadFigures:
    """Cumulative counters plus the latest gauges, as every client message carries them. A
    snapshot: each step makes a new one (``after``), so a message built on the server's event
    loop while the loop thread steps on reads one step's figures, never a mix of two."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    # The LoRA adapters (names, sorted) of the running and of the waiting requests.
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()

    def after(self, s: SchedulerStats) -> LoadFigures:
        """These figures after a step whose scheduler stats are ``s``."""
        return LoadFigures(
            s.num_running,
            s.num_waiting,
            s.kv_cache_usage,
            self.prefix_cache_queries + s.prefix_cache_queries,
            self.prefix_cache_hits + s.prefix_cache_hits,
            self.num_preemptions + s.num_preemptions,
            # (Empty unless LoRA is on.)
            tuple(sorted(r)) if (r := s.running_lora_adapters) else (),
            tuple(sorted(w)) if (w := s.waiting_lora_adapters) else (),
        )


@dataclass
class ClientBatch:
    """What one client receives for one engine step (or several merged: ``step_tokens``)."""

    outputs: list[EngineCoreOutput] = field(default_factory=list)
    errors: list[tuple[str, Exception]] = field(default_factory=list)  # (request id, error)
    load: LoadFigures | None = None
    # Several steps merged (rpc/stream_outbox.py): this client's tokens in each, in order.
    step_tokens: tuple[int, ...] = ()


Sink = Callable[[ClientBatch], None]


class QueueFull(Exception):
    """The waiting queue is at --max-waiting."""


class Unavailable(Exception):
    """The engine takes no new work: shutting down, stalled, or its loop died."""


class Draining(Unavailable):
    """The engine is shutting down and takes no new work."""


class Asleep(Unavailable):
    """The engine sleeps, or is going to sleep, and takes no new work until woken up."""


class SleepCancelled(Exception):
    """A sleep still waiting for its requests to finish was cancelled by a wake up."""


@dataclass
class _Add:
    client: str
    request_id: str
    prompt: list[int]
    params: SamplingParams
    arrival_time: float | None
    priority: int
    pooling_params: PoolingParams | None = None
    lora_name: str | None = None


@dataclass
class _Abort:
    internal_ids: list[str]


@dataclass
class _Call:
    fn: Callable[[EngineCore], Any]
    future: concurrent.futures.Future[Any]


def _internal_id(client: str, request_id: str) -> str:
    """The engine's id for a client's request: ids are the client's own, so two clients may
    use the same one."""
    return f"{client}/{request_id}"


class EngineLoop:
    """Owns the loop thread. ``stall_timeout_s``: how long the loop may go without finishing a
    step (or an idle wait) before it counts as stalled: health NOT_SERVING, new work refused."""

    def __init__(
        self,
        build: Callable[[], EngineCore],
        max_waiting: int = 1024,
        stall_timeout_s: float = 60.0,
    ) -> None:
        if stall_timeout_s <= 0:
            raise ValueError(f"stall_timeout_s must be positive, got {stall_timeout_s}")
        self._build = build
        self.stall_timeout_s = stall_timeout_s
        # Monotonic time the loop last showed progress: a step finished, or an idle wait ended
        # (an idle loop wakes every _IDLE_WAIT_S). Written by the loop thread only.
        self._heartbeat = time.monotonic()
        self._built = threading.Event()
        self._build_error: BaseException | None = None
        self.core: EngineCore  # set by the loop thread before start() returns
        self.max_waiting = max_waiting
        self.load = LoadFigures(kv_cache_usage=0.0)
        self._inbox: queue.Queue[_Add | _Abort | _Call | None] = queue.Queue()
        self._closed = False  # the loop thread ended: calls are refused (under _lock)
        self._sinks: dict[str, Sink] = {}
        self._owner: dict[str, tuple[str, str]] = {}  # internal id -> (client, request id)
        self._pending_adds = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.draining = False
        # Sleep mode. _sleep_waiters / _sleep_pending under _lock; ``sleeping`` is written by
        # the loop thread (under _lock) and read anywhere.
        self._sleep_waiters: list[tuple[int, concurrent.futures.Future[None]]] = []
        self._sleep_pending = False
        self.sleeping = False
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    # ------------------------------------------------------------------ called from any thread
    def start(self) -> EngineCore:
        """Start the loop thread, wait until it has built the engine core, and return it.

        An error while building (a bad checkpoint, no memory) is raised here.
        """
        self._thread.start()
        self._built.wait()
        if self._build_error is not None:
            raise self._build_error
        return self.core

    def register(self, client: str, sink: Sink) -> None:
        with self._lock:
            self._sinks[client] = sink

    def unregister(self, client: str) -> None:
        """Forget a client and abort everything it still has in flight."""
        with self._lock:
            self._sinks.pop(client, None)
            mine = [i for i, (c, _) in self._owner.items() if c == client]
        if mine:
            self._inbox.put(_Abort(mine))

    def unavailable_reason(self) -> str | None:
        """Why the engine cannot take work now (None: it can). Health follows this."""
        if self.draining:
            return "the engine is shutting down"
        if self._built.is_set() and not self._thread.is_alive():
            return "the engine loop has stopped; see the engine log"
        if self.sleeping:
            return "the engine is asleep (Sleep); WakeUp wakes it"
        if self._sleep_pending:
            return "the engine is going to sleep (Sleep); WakeUp wakes it"
        age = time.monotonic() - self._heartbeat
        if age > self.stall_timeout_s:
            return f"the engine loop has made no progress for {age:.1f}s"
        return None

    def submit(
        self,
        client: str,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        pooling_params: PoolingParams | None = None,
        lora_name: str | None = None,
    ) -> None:
        """Queue a request (already validated; ``pooling_params`` set: a pooling request;
        ``lora_name``: its adapter, checked on the loop: NOT_FOUND arrives as its error).
        Raises QueueFull, Unavailable (Draining while shutting down), or ValueError for an id
        the client already has in flight."""
        if self.draining:
            raise Draining("the engine is shutting down")
        reason = self.unavailable_reason()
        if reason is not None:
            raise Unavailable(reason)
        internal = _internal_id(client, request_id)
        with self._lock:
            if self.sleeping or self._sleep_pending:  # checked again under the lock: see sleep()
                raise Asleep("the engine is asleep or going to sleep (Sleep); WakeUp wakes it")
            if internal in self._owner:
                raise DuplicateRequestError(f"request_id {request_id!r} is already in flight")
            if self.load.num_waiting + self._pending_adds >= self.max_waiting:
                raise QueueFull(f"the engine's waiting queue is full ({self.max_waiting} requests)")
            self._pending_adds += 1
            self._owner[internal] = (client, request_id)
        self._inbox.put(
            _Add(
                client,
                request_id,
                prompt,
                params,
                arrival_time,
                priority,
                pooling_params,
                lora_name,
            )
        )

    def call(self, fn: Callable[[EngineCore], T]) -> concurrent.futures.Future[T]:
        """Run ``fn(core)`` on the loop thread between two steps, in order with the requests
        queued around it; its result (or exception) arrives on the returned future. Raises
        Unavailable when the loop has stopped (a queued call is then failed with it too)."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._lock:
            if self._closed or self._build_error is not None or not self._thread.is_alive():
                raise Unavailable("the engine loop is not running")
            self._inbox.put(_Call(fn, future))
        return future

    def sleep(self, level: int) -> concurrent.futures.Future[None]:
        """Put the engine to sleep at ``level`` (1 or 2; ValueError otherwise) once the requests
        already taken in have finished; new ones are refused from now on. The future resolves
        when the engine sleeps (at once if it already does: sleeping again is a no-op), or
        fails with SleepCancelled (a wake up came first) or the core's error."""
        check_sleep_level(level)  # before anything is refused
        future: concurrent.futures.Future[None] = concurrent.futures.Future()
        with self._lock:
            if self._closed or self._build_error is not None or not self._thread.is_alive():
                raise Unavailable("the engine loop is not running")
            if self.sleeping:
                future.set_result(None)
                return future
            # A submit that passed its check before this line has counted itself in
            # _pending_adds already: the loop takes it in (and lets it finish) before sleeping.
            self._sleep_pending = True
            self._sleep_waiters.append((level, future))
            self._inbox.put(_Call(lambda core: None, concurrent.futures.Future()))  # wake it
        return future

    def wake_up(self) -> concurrent.futures.Future[None]:
        """Wake the engine (weights back, empty KV cache), or cancel a pending sleep; a no-op
        when awake. Resolves once it takes work again."""
        return self.call(lambda core: self._wake_up())

    @property
    def sleep_requested(self) -> bool:
        """Whether the engine sleeps or waits for its requests to finish to go to sleep."""
        return self.sleeping or self._sleep_pending

    @property
    def is_sleeping(self) -> bool:
        """Whether the engine sleeps now (False while a sleep waits for its requests)."""
        return self.sleeping

    def abort(self, client: str | None, request_ids: list[str]) -> int:
        """Abort by the client's ids (client None: match the id under any client)."""
        with self._lock:
            if client is not None:  # a Stream's abort: its internal ids, looked up directly
                hits = [
                    i for r in set(request_ids) if (i := _internal_id(client, r)) in self._owner
                ]
            else:  # the unary Abort rpc (rare): any client's request with that id
                wanted = set(request_ids)
                hits = [i for i, (_, r) in self._owner.items() if r in wanted]
        if hits:
            self._inbox.put(_Abort(hits))
        return len(hits)

    def has_requests(self, client: str) -> bool:
        with self._lock:
            return any(c == client for c, _ in self._owner.values())

    def num_in_flight(self) -> int:
        with self._lock:
            return len(self._owner)

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._inbox.put(None)
        self._thread.join(timeout)

    # ------------------------------------------------------------------ the loop thread
    def _run(self) -> None:
        try:
            self.core = self._build()
        except BaseException as e:
            self._build_error = e
            return
        finally:
            self._built.set()
        try:
            while not self._stop.is_set():
                self._heartbeat = time.monotonic()
                self._drain(block=not self.core.has_unfinished_requests())
                if self._stop.is_set():
                    break
                if self.core.has_unfinished_requests():
                    step = self.core.step()
                    self.load = self.load.after(step.stats)
                    self._route(step.outputs, step.errors)
                if self._sleep_pending:
                    self._try_sleep()
        except Exception:  # a bug in the engine: fail every request loudly, never hang them
            logger.exception("engine loop crashed; health is NOT_SERVING from now on")
            self._fail_all(RuntimeError("the engine loop crashed; see the engine log"))
        finally:
            self._refuse_calls()

    def _refuse_calls(self) -> None:
        """The loop is ending: calls still queued fail with Unavailable, later ones are
        refused by ``call`` itself."""
        with self._lock:
            self._closed = True
            waiters, self._sleep_waiters = self._sleep_waiters, []
        for _, future in waiters:
            if future.set_running_or_notify_cancel():
                future.set_exception(Unavailable("the engine loop has stopped"))
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, _Call) and item.future.set_running_or_notify_cancel():
                item.future.set_exception(Unavailable("the engine loop has stopped"))

    def _drain(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=_IDLE_WAIT_S) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        batches: dict[str, ClientBatch] = {}
        while item is not None:
            if isinstance(item, _Add):
                self._add(item, batches)
            elif isinstance(item, _Call):
                self._call(item)
            else:
                self._abort(item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
        self._deliver(batches)

    def _add(self, item: _Add, batches: dict[str, ClientBatch]) -> None:
        internal = _internal_id(item.client, item.request_id)
        with self._lock:
            self._pending_adds -= 1
            if internal not in self._owner:  # aborted before it reached the engine
                return
        try:
            self.core.add_request(
                internal,
                item.prompt,
                item.params,
                item.arrival_time,
                item.priority,
                item.pooling_params,
                item.lora_name,
            )
        except ValueError as e:
            with self._lock:
                self._owner.pop(internal, None)
            batches.setdefault(item.client, ClientBatch()).errors.append((item.request_id, e))

    def _call(self, item: _Call) -> None:
        if not item.future.set_running_or_notify_cancel():
            return  # its caller went away
        try:
            item.future.set_result(item.fn(self.core))
        except Exception as e:  # the caller's error to handle (an unknown adapter ...)
            item.future.set_exception(e)

    def _try_sleep(self) -> None:
        """Sleep now if no request is left (none running or waiting, none on its way in)."""
        with self._lock:
            if self._pending_adds or self.core.has_unfinished_requests():
                return
            waiters, self._sleep_waiters = self._sleep_waiters, []
        level = max(level for level, _ in waiters)
        error: Exception | None = None
        try:
            self.core.sleep(level)
        except Exception as e:  # a bad level (ValueError), or the runner failed
            error = e
        with self._lock:
            self._sleep_pending = False
            self.sleeping = error is None
        if error is None:
            self.load = self.load.after(self.core.scheduler.stats())
            logger.info("engine asleep (level %d)", level)
        elif not isinstance(error, ValueError):
            logger.error("the engine failed to go to sleep: %s", error)
        for _, future in waiters:
            if future.set_running_or_notify_cancel():
                if error is None:
                    future.set_result(None)
                else:
                    future.set_exception(error)

    def _wake_up(self) -> None:
        """On the loop thread: cancel a pending sleep, or wake the core."""
        with self._lock:
            waiters, self._sleep_waiters = self._sleep_waiters, []
            self._sleep_pending = False
        for _, future in waiters:
            if future.set_running_or_notify_cancel():
                future.set_exception(SleepCancelled("woken up before the engine went to sleep"))
        if self.sleeping:
            self.core.wake_up()
            with self._lock:
                self.sleeping = False
            logger.info("engine awake")

    def _abort(self, item: _Abort) -> None:
        """Abort in the engine; each owner still listening gets a final ABORT output."""
        finals = {o.request_id: o for o in self.core.abort_requests(item.internal_ids)}
        # Aborts free blocks and slots outside a step: refresh the gauges now, or an idle
        # engine keeps reporting (and admitting against) the figures of its last step.
        self.load = self.load.after(self.core.scheduler.stats())
        batches: dict[str, ClientBatch] = {}
        with self._lock:
            for i in item.internal_ids:
                owner = self._owner.pop(i, None)
                if owner is not None:
                    client, rid = owner
                    final = finals.get(i) or EngineCoreOutput(
                        rid, [], finish_reason=FinishReason.ABORT
                    )
                    final.request_id = rid  # the engine's own final carries the internal id
                    batches.setdefault(client, ClientBatch()).outputs.append(final)
        self._deliver(batches)

    def _route(self, outputs: list[EngineCoreOutput], errors: list[tuple[str, Exception]]) -> None:
        batches: dict[str, ClientBatch] = {}
        with self._lock:
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
        self._deliver(batches)

    def _deliver(self, batches: dict[str, ClientBatch]) -> None:
        for client, batch in batches.items():
            batch.load = self.load
            sink = self._sinks.get(client)
            if sink is not None:
                sink(batch)

    def _fail_all(self, error: Exception) -> None:
        batches: dict[str, ClientBatch] = {}
        with self._lock:
            for client, rid in self._owner.values():
                batches.setdefault(client, ClientBatch()).errors.append((rid, error))
            self._owner.clear()
        self._deliver(batches)

    # ------------------------------------------------------------------ shutdown
    def drain_and_abort(self, timeout_s: float) -> int:
        """Refuse new work, let in-flight requests finish for ``timeout_s``, abort the rest.

        Returns how many requests were aborted; their clients get a final ABORT output.
        """
        self.draining = True
        deadline = time.monotonic() + timeout_s
        while self.num_in_flight() and time.monotonic() < deadline:
            time.sleep(0.05)
        with self._lock:
            left = dict(self._owner)
        if not left:
            return 0
        self._inbox.put(_Abort(list(left)))  # their owners get a final ABORT output
        return len(left)
