"""The engine busy loop in its own thread, fed by a thread-safe input queue.

    gRPC handlers (asyncio) --submit/abort--> queue --> loop thread: drain, step(), route
    per-client sink  <--call_soon_threadsafe-- outputs of that client's requests, once per step

Other work on the engine (LoRA adapters added, removed, pinned; utility calls) goes through the
same queue as a call (``call``): it runs between two steps, in order with the requests queued
before and after it, and its result comes back on a future.

The rest of the loop's state has a module each beside this one: the clients and their request
ids (``clients.py``), sleep mode (``sleep.py``), stall detection and draining (``liveness.py``).

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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from engine_svc.config import ServerConfig
from engine_svc.core.errors import DuplicateRequestError, EngineDeadError
from engine_svc.core.outputs import EngineCoreOutput
from engine_svc.core.pooling_params import PoolingParams
from engine_svc.core.sampling_params import SamplingParams
from engine_svc.engine_core import EngineCore
from engine_svc.loop.clients import (
    ClientBatch,
    Clients,
    Sink,
    internal_id,
    load_after,
    load_with_gauges,
)
from engine_svc.loop.errors import Asleep, Draining, QueueFull, SleepCancelled, Unavailable
from engine_svc.loop.liveness import Heartbeat
from engine_svc.loop.sleep import SleepMode, settle
from engine_svc.worker.sleep_mode import check_sleep_level
from protos.types import LoadFigures

logger = logging.getLogger(__name__)
T = TypeVar("T")

_IDLE_WAIT_S = 0.5  # an idle loop wakes this often, so its heartbeat stays fresh


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


class EngineLoop:
    """Owns the loop thread. ``stall_timeout_s``: how long the loop may go without finishing a
    step (or an idle wait) before it counts as stalled: health NOT_SERVING, new work refused."""

    def __init__(
        self,
        build: Callable[[], EngineCore],
        max_waiting: int = ServerConfig.max_waiting,
        stall_timeout_s: float = ServerConfig.stall_timeout_s,
    ) -> None:
        self.heartbeat = Heartbeat(stall_timeout_s)  # the stall detector
        self._build = build
        self._built = threading.Event()
        self._build_error: BaseException | None = None
        self.core: EngineCore  # set by the loop thread before start() returns
        self.max_waiting = max_waiting
        self.load = LoadFigures(kv_cache_usage=0.0)
        self._inbox: queue.Queue[_Add | _Abort | _Call | None] = queue.Queue()
        # Under _lock: the clients and their requests, the requests on their way in (submitted,
        # not yet taken in by the loop), sleep mode's changes, and whether the loop has ended.
        self._lock = threading.Lock()
        self._clients = Clients()
        self._pending_adds = 0
        self._sleep = SleepMode()
        self._closed = False  # the loop thread ended: calls are refused
        self._stop = threading.Event()
        self.draining = False
        self.failure: str | None = None  # set by ``fail``: the engine cannot go on
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
            self._clients.register(client, sink)

    def unregister(self, client: str) -> None:
        """Forget a client and abort everything it still has in flight."""
        with self._lock:
            mine = self._clients.unregister(client)
        if mine:
            self._inbox.put(_Abort(mine))

    def fail(self, reason: str) -> None:
        """The engine cannot go on (a tensor-parallel worker died): from now on health is
        NOT_SERVING with ``reason``, new work is refused, and requests the loop fails get it."""
        self.failure = reason

    def unavailable_reason(self) -> str | None:
        """Why the engine cannot take work now (None: it can). Health follows this."""
        if self.failure is not None:
            return self.failure
        if self.draining:
            return "the engine is shutting down"
        if self._built.is_set() and not self._thread.is_alive():
            return "the engine loop has stopped; see the engine log"
        if self._sleep.asleep:
            return "the engine is asleep (Sleep); WakeUp wakes it"
        if self._sleep.pending:
            return "the engine is going to sleep (Sleep); WakeUp wakes it"
        return self.heartbeat.stall_reason()

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
        internal = internal_id(client, request_id)
        with self._lock:
            if self._sleep.requested:  # checked again under the lock: see sleep()
                raise Asleep("the engine is asleep or going to sleep (Sleep); WakeUp wakes it")
            if internal in self._clients:
                raise DuplicateRequestError(f"request_id {request_id!r} is already in flight")
            if self.load.num_waiting + self._pending_adds >= self.max_waiting:
                raise QueueFull(f"the engine's waiting queue is full ({self.max_waiting} requests)")
            self._pending_adds += 1
            self._clients.add(internal, client, request_id)
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
        with self._lock:
            if self._closed or self._build_error is not None or not self._thread.is_alive():
                raise Unavailable("the engine loop is not running")
            # A submit that passed its check before this line has counted itself in
            # _pending_adds already: the loop takes it in (and lets it finish) before sleeping.
            future = self._sleep.ask(level)
            if not future.done():
                self._inbox.put(_Call(lambda core: None, concurrent.futures.Future()))  # wake it
        return future

    def wake_up(self) -> concurrent.futures.Future[None]:
        """Wake the engine (weights back, empty KV cache), or cancel a pending sleep; a no-op
        when awake. Resolves once it takes work again."""
        return self.call(lambda core: self._wake_up())

    @property
    def sleep_requested(self) -> bool:
        """Whether the engine sleeps or waits for its requests to finish to go to sleep."""
        return self._sleep.requested

    @property
    def is_sleeping(self) -> bool:
        """Whether the engine sleeps now (False while a sleep waits for its requests)."""
        return self._sleep.asleep

    def abort(self, client: str | None, request_ids: list[str]) -> int:
        """Abort by the client's ids (client None: match the id under any client)."""
        with self._lock:
            hits = self._clients.find(client, request_ids)
        if hits:
            self._inbox.put(_Abort(hits))
        return len(hits)

    def has_requests(self, client: str) -> bool:
        with self._lock:
            return self._clients.has_requests(client)

    def num_in_flight(self) -> int:
        with self._lock:
            return len(self._clients)

    def abort_all(self) -> int:
        """Abort every request in flight (``liveness.drain_and_abort``, at shutdown); returns
        how many. Their clients get a final ABORT output."""
        with self._lock:
            left = self._clients.in_flight()
        if left:
            self._inbox.put(_Abort(left))
        return len(left)

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
                self.heartbeat.beat()
                self._drain(block=not self.core.has_unfinished_requests())
                if self._stop.is_set():
                    break
                if self.core.has_unfinished_requests():
                    step = self.core.step()
                    self.load = load_after(self.load, step.stats)
                    self._route(step.outputs, step.errors)
                if self._sleep.pending:
                    self._try_sleep()
        except EngineDeadError as e:  # a worker died: not a bug here, and nothing to retry
            self.fail(str(e))
            logger.error("engine loop stopped: %s", e)
            self._fail_all(Unavailable(str(e)))
        except Exception:  # a bug in the engine: fail every request loudly, never hang them
            if self.failure is not None:  # the step failed after the engine did
                logger.error("engine loop stopped: %s", self.failure)
                self._fail_all(Unavailable(self.failure))
            else:
                logger.exception("engine loop crashed; health is NOT_SERVING from now on")
                self._fail_all(RuntimeError("the engine loop crashed; see the engine log"))
        finally:
            self._refuse_calls()

    def _refuse_calls(self) -> None:
        """The loop is ending: calls still queued fail with Unavailable, later ones are
        refused by ``call`` itself."""
        with self._lock:
            self._closed = True
            waiters = self._sleep.take_waiters()
        settle(waiters, lambda: Unavailable("the engine loop has stopped"))
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
        internal = internal_id(item.client, item.request_id)
        with self._lock:
            self._pending_adds -= 1
            if internal not in self._clients:  # aborted before it reached the engine
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
                checked=True,  # by the gRPC layer, with the contract's rule (``submit``)
            )
        except ValueError as e:
            with self._lock:
                self._clients.forget(internal)
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
            level, waiters = self._sleep.take()
        error: Exception | None = None
        try:
            self.core.sleep(level)
        except Exception as e:  # a bad level (ValueError), or the runner failed
            error = e
        with self._lock:
            self._sleep.went_to_sleep(error is None)
        if error is None:
            self.load = load_with_gauges(self.load, self.core.scheduler.stats())
            logger.info("engine asleep (level %d)", level)
        elif not isinstance(error, ValueError):
            logger.error("the engine failed to go to sleep: %s", error)
        settle(waiters, None if error is None else lambda: error)

    def _wake_up(self) -> None:
        """On the loop thread: cancel a pending sleep, or wake the core."""
        with self._lock:
            waiters = self._sleep.cancel()
        settle(waiters, lambda: SleepCancelled("woken up before the engine went to sleep"))
        if self._sleep.asleep:
            self.core.wake_up()
            with self._lock:
                self._sleep.woke_up()
            logger.info("engine awake")

    def _abort(self, item: _Abort) -> None:
        """Abort in the engine; each owner still listening gets a final ABORT output."""
        finals = {o.request_id: o for o in self.core.abort_requests(item.internal_ids)}
        # Aborts free blocks and slots outside a step: refresh the gauges now, or an idle
        # engine keeps reporting (and admitting against) the figures of its last step.
        self.load = load_with_gauges(self.load, self.core.scheduler.stats())
        with self._lock:
            batches = self._clients.aborted(item.internal_ids, finals)
        self._deliver(batches)

    def _route(self, outputs: list[EngineCoreOutput], errors: list[tuple[str, Exception]]) -> None:
        with self._lock:
            batches = self._clients.route(outputs, errors)
        self._deliver(batches)

    def _deliver(self, batches: dict[str, ClientBatch]) -> None:
        self._clients.deliver(batches, self.load)

    def _fail_all(self, error: Exception) -> None:
        with self._lock:
            batches = self._clients.fail_all(error)
        self._deliver(batches)
