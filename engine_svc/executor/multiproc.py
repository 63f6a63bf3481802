"""The multi-process executor: one step run on ``size`` tensor-parallel ranks.

Rank 0 is a ``ModelRunner`` in the engine process: the scheduler's live requests are its, and
its results are the step's. Ranks 1..size-1 are worker processes (``worker_proc``), each
owning one device and its share of the KV cache; each step's scheduler output goes to them over
a pipe (``step_message``: what changed since the last step), then rank 0 runs it, the step's
collectives keeping the ranks together::

    EngineCore.step ─ schedule ─► MultiprocExecutor.execute ─┬─ pipe ─► worker 1: execute
                                                             ├─ pipe ─► worker N-1: execute
                                                             └────────► rank 0: execute ─► out

The KV cache has the same number of blocks on every rank (the smallest any rank fits). With
speculative decoding rank 0 proposes (and holds the draft model, whose KV it alone counts per
block); each row's proposals go to the workers with the step, and rank 0's verification is the
step's (``step_message``, ``worker_proc``).

A worker that dies is fatal: rank 0 would wait in a collective forever, so a watchdog thread
kills the other workers and hands a message naming the worker to ``on_worker_death``. By
default that ends the engine process at once (exit code 1); the gRPC server's handler first
reports NOT_SERVING and ends the open calls with the message, and the engine process ends
``FATAL_GRACE_S`` later whatever the handler did (or raised). Ranks left out of step (some
asleep, some awake after a sleep or wake that failed on some of them) are fatal the same way:
the executor ends the workers and the watchdog reports why. A worker whose engine is gone ends
itself.

Commands other than a step are answered by every worker, and every answer is read before the
next command (``_ask``). LoRA adapters are read and checked once, by rank 0, when they are
added; each host copy rank 0 takes goes to every worker then (``put_lora``), never read from
its directory by a worker at step time. The executor has the surface of a ``ModelRunner`` that
``EngineCore`` uses.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing as mp
import os
import pickle
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

import torch

from engine_svc.config import EngineConfig, KVCacheLayout
from engine_svc.core.errors import EngineDeadError
from engine_svc.core.scheduler import SchedulerOutput
from engine_svc.distributed import destroy_tensor_parallel, init_tensor_parallel
from engine_svc.executor.step_message import StepEncoder
from engine_svc.executor.worker_proc import cpu_threads, rank_device, worker_main
from engine_svc.lora.adapter import LoRAAdapter
from engine_svc.lora.errors import LoRAError
from engine_svc.lora.manager import LoRAManager
from engine_svc.lora.registry import Placement
from engine_svc.models.llama import DecoderSpec
from engine_svc.worker.model_runner import ModelRunner, ModelRunnerOutput

logger = logging.getLogger(__name__)

WORKER_DIED_EXIT_CODE = 1
FATAL_GRACE_S = 5.0  # how long an ``on_worker_death`` handler has before the process ends
_READY_TIMEOUT_S = 600.0
# Rank 0 failed a sleep or wake: how long the workers have to answer before they count as stuck
# (in a collective rank 0 never joined) and the engine ends.
_ANSWER_AFTER_FAILURE_S = 300.0


def exit_engine(message: str) -> None:
    """What a dead worker does to the engine by default: say why, and exit non-zero now."""
    logger.critical(message)
    print(f"tandem engine: {message}", file=sys.stderr, flush=True)
    os._exit(WORKER_DIED_EXIT_CODE)


class MultiprocExecutor:
    """``size`` tensor-parallel ranks behind the ``ModelRunner`` surface. ``on_worker_death``
    (public: a server sets its own): called from the watchdog thread with a message when a
    worker exits unasked; the process ends ``FATAL_GRACE_S`` after it returns."""

    def __init__(
        self,
        config: EngineConfig,
        max_model_len: int,
        size: int,
        on_worker_death: Callable[[str], None] = exit_engine,
    ) -> None:
        if size < 1:
            raise ValueError(f"the multi-process executor needs at least 1 rank, got {size}")
        self.size = size
        self.on_worker_death = on_worker_death
        self._closing = threading.Event()
        self._fatal: str | None = None  # why the executor ended its workers itself
        self._store_dir = tempfile.mkdtemp(prefix="tandem-tp-")
        init_method = f"file://{self._store_dir}/store"
        ctx = mp.get_context("spawn")
        self._procs: list[mp.process.BaseProcess] = []
        self._conns: list[Connection] = []
        for rank in range(1, size):
            ours, theirs = ctx.Pipe()
            args = (rank, size, init_method, config, max_model_len, theirs, os.getpid())
            proc = ctx.Process(
                target=worker_main, args=args, name=f"tandem-tp-rank{rank}", daemon=True
            )
            proc.start()
            theirs.close()
            self._procs.append(proc)
            self._conns.append(ours)
        atexit.register(self.shutdown)  # before multiprocessing's own exit handler terminates them
        self._watchdog = threading.Thread(target=self._watch, name="tp-watchdog", daemon=True)
        self._watchdog.start()

        try:
            self._start_rank0(config, max_model_len, init_method)
        except BaseException:
            self.shutdown()  # the workers fail too; their deaths are this error's, not news
            raise
        self._encoder = StepEncoder()
        logger.info("tensor parallelism: %d ranks (workers %s)", size, self.worker_pids)

    def _start_rank0(self, config: EngineConfig, max_model_len: int, init_method: str) -> None:
        """Rank 0's runner, built beside the workers' (their start-up runs collectives)."""
        device = rank_device(config, 0)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        else:
            torch.set_num_threads(cpu_threads(self.size))
        self.tp = init_tensor_parallel(0, self.size, init_method, device)
        self.rank0 = ModelRunner(config, max_model_len, self.tp)
        if self.rank0.lora is not None:
            self.rank0.lora.mirror = self  # every host copy rank 0 takes, the workers take
        for rank, conn in enumerate(self._conns, start=1):
            if not conn.poll(_READY_TIMEOUT_S):
                raise TimeoutError(f"tensor-parallel rank {rank} did not start")
            kind, blocks = conn.recv()
            if kind != "ready" or blocks != self.rank0.layout.num_blocks:
                raise RuntimeError(f"rank {rank} started with {blocks} KV blocks, rank 0 with "
                                   f"{self.rank0.layout.num_blocks}")  # fmt: skip

    # ------------------------------------------------------------------ what EngineCore reads
    @property
    def layout(self) -> KVCacheLayout:
        return self.rank0.layout

    @property
    def spec(self) -> DecoderSpec:
        return self.rank0.spec

    @property
    def dtype(self) -> torch.dtype:
        return self.rank0.dtype

    @property
    def device(self) -> torch.device:
        return self.rank0.device

    @property
    def lora(self) -> LoRAManager | None:
        """Rank 0's adapters: the engine adds, pins and removes them there, each host copy it
        takes going to the workers at once (``put_lora``), and its registry decides every
        rank's slots (``step_message``: the workers' follow)."""
        return self.rank0.lora

    def _lora_placement(self, so: SchedulerOutput) -> Placement | None:
        """Rank 0's slots for step ``so``, its adapters put there before the workers hear of
        it (rank 0's runner finds them in place: the same ids in the same order, no load)."""
        lora = self.rank0.lora
        if lora is None:
            return None
        needed = sorted({s.request.lora_id for s in so.scheduled if s.request.lora_id})
        if needed:
            lora.prepare(needed)
        return lora.placement()

    @property
    def sleep_level(self) -> int:
        return self.rank0.sleep_level

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self._procs if p.pid is not None]

    # ------------------------------------------------------------------ one step
    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        if not self._conns or (so.is_empty and not so.finished_ids and not so.preempted_ids):
            return self.rank0.execute(so)  # no worker, or nothing for them to know
        msg = self._encoder.encode(so, self._lora_placement(so))
        try:
            for conn in self._conns:
                conn.send(("step", msg))
            return self.rank0.execute(so)
        except Exception as e:  # a collective (or the pipe) failed: a worker may be gone
            death = self._death(timeout_s=2.0)
            if death is None:
                raise
            raise EngineDeadError(death) from e

    def sleep(self, level: int) -> None:
        self._on_every_rank(("sleep", level), lambda: self.rank0.sleep(level))

    def wake_up(self) -> None:
        self._on_every_rank(("wake", None), self.rank0.wake_up)

    def kv_cache_nbytes(self) -> int:
        """Rank 0's KV cache (each rank holds as much, but for a draft model's: rank 0's)."""
        return self.rank0.kv_cache_nbytes()

    def _on_every_rank(self, command: tuple[str, object], local: Callable[[], None]) -> None:
        """Sleep or wake every rank: the workers' command sent, rank 0's ``local`` run, then
        every worker's answer read (its sleep level after it, and its error if it failed),
        whatever ``local`` did. Ranks that end at different sleep levels cannot step together:
        the engine ends (EngineDeadError). Otherwise a failure on some rank is raised as it
        is (rank 0's, else the workers'): retryable, as on one rank."""
        # The workers first: waking up captures CUDA graphs, whose checks run collectives.
        self._send(command)
        error: BaseException | None = None
        try:
            local()
        except BaseException as e:  # noqa: BLE001 -- raised below, once the workers answered
            error = e
        wait_s = None if error is None else _ANSWER_AFTER_FAILURE_S
        levels = [self.rank0.sleep_level]
        failures = [] if error is None else [f"rank 0: {type(error).__name__}: {error}"]
        for rank, (kind, arg) in enumerate(self._answers(command[0], wait_s), start=1):
            if kind == "ok":
                levels.append(int(arg))
            else:
                message, level = arg
                levels.append(int(level))
                failures.append(f"rank {rank}: {message}")
        if len(set(levels)) > 1:
            raise self._fail(
                f"tensor-parallel ranks out of step after {command[0]!r}: sleep levels "
                f"{levels} by rank ({'; '.join(failures)})"
            ) from error
        if error is not None:
            raise error
        if failures:
            raise RuntimeError(f"{command[0]!r} failed on {'; '.join(failures)}")

    # ------------------------------------------------------------------ LoRA host copies
    def put_lora(self, lora_id: int, adapter: LoRAAdapter) -> None:
        """Every worker holds rank 0's host copy of adapter ``lora_id`` on return (rank 0 read
        and checked it: no worker reads an adapter directory), or none does and a LoRAError
        names the rank that could not take it."""
        if not self._conns:
            return
        # Plain pickle: multiprocessing's own would move rank 0's tensors to shared memory.
        blob = pickle.dumps(adapter, protocol=pickle.HIGHEST_PROTOCOL)
        answers = self._ask(("lora_put", (lora_id, blob)))
        failed = [(rank, arg) for rank, (kind, arg) in enumerate(answers, start=1) if kind != "ok"]
        if failed:
            self.drop_loras([lora_id])
            rank, why = failed[0]
            raise LoRAError(
                f"LoRA adapter {adapter.path}: tensor-parallel rank {rank} could not take it "
                f"({why}); not loaded on any rank"
            )

    def drop_loras(self, lora_ids: list[int]) -> None:
        """The workers let these host copies go, as rank 0 did (no answer: the pipe keeps the
        order, so the next step sees them gone)."""
        if self._conns:
            self._send(("lora_drop", list(lora_ids)))

    # ------------------------------------------------------------------ answered commands
    def _ask(self, command: tuple[str, object]) -> list[tuple[str, Any]]:
        """Send ``command`` to every worker and read every answer, in rank order."""
        self._send(command)
        return self._answers(command[0], None)

    def _send(self, command: tuple[str, object]) -> None:
        try:
            for conn in self._conns:
                conn.send(command)
        except OSError as e:  # a broken pipe: the worker is gone
            raise self._dead() from e

    def _answers(self, command: str, wait_s: float | None) -> list[tuple[str, Any]]:
        """Every worker's answer to ``command`` (all read, so that the next command never
        reads this one's); ``wait_s``: how long a worker may take (None: as long as it
        takes), else it is stuck and the engine ends."""
        answers: list[tuple[str, Any]] = []
        for rank, conn in enumerate(self._conns, start=1):
            try:
                if wait_s is not None and not conn.poll(wait_s):
                    raise self._fail(
                        f"tensor-parallel rank {rank} did not answer {command!r} within "
                        f"{wait_s:.0f}s; the ranks are out of step"
                    )
                answers.append(conn.recv())
            except (EOFError, OSError) as e:  # the worker is gone
                raise self._dead() from e
        return answers

    def _dead(self) -> EngineDeadError:
        death = self._death(timeout_s=2.0)
        return EngineDeadError(death or "a tensor-parallel worker's pipe closed")

    def _fail(self, reason: str) -> EngineDeadError:
        """The ranks cannot go on together: end the workers; the watchdog hands ``reason`` to
        ``on_worker_death`` as for a worker that died."""
        logger.critical(reason)
        self._fatal = reason
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        return EngineDeadError(reason)

    # ------------------------------------------------------------------ lifetime
    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop the workers and leave the group (idempotent)."""
        if self._closing.is_set():
            return
        self._closing.set()
        for conn in self._conns:
            try:
                conn.send(("stop", None))
            except (BrokenPipeError, OSError):
                pass
        for proc in self._procs:
            proc.join(timeout_s)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout_s)
        tp = getattr(self, "tp", None)  # None: start-up failed before joining the group
        if tp is not None:
            destroy_tensor_parallel(tp)
        shutil.rmtree(self._store_dir, ignore_errors=True)
        atexit.unregister(self.shutdown)

    def _death(self, timeout_s: float | None) -> str | None:
        """Wait up to ``timeout_s`` (None: for ever) for a worker to end; what to say of it."""
        by_sentinel = {p.sentinel: (rank, p) for rank, p in enumerate(self._procs, start=1)}
        ended = wait(list(by_sentinel), timeout_s)
        if not ended:
            return None
        rank, proc = by_sentinel[ended[0]]  # type: ignore[index]
        proc.join(1.0)
        return (
            f"tensor-parallel worker rank {rank} (pid {proc.pid}) exited with code "
            f"{proc.exitcode}; the engine cannot run without it"
        )

    def _watch(self) -> None:
        message = self._death(timeout_s=None)
        if self._closing.is_set() or message is None:
            return
        message = self._fatal or message  # the executor ended them itself: say why
        for other in self._procs:
            if other.is_alive():
                other.kill()
        shutil.rmtree(self._store_dir, ignore_errors=True)
        try:
            self.on_worker_death(message)  # the default does not return
        except Exception:  # noqa: BLE001 -- the engine ends all the same
            logger.exception("the worker-death handler failed")
        finally:
            time.sleep(FATAL_GRACE_S)
            exit_engine(message)


def make_model_runner(config: EngineConfig, max_model_len: int) -> ModelRunner | MultiprocExecutor:
    """The runner ``EngineCore`` drives: the in-process ``ModelRunner`` for one rank (the
    default, with nothing of the executor in its path), else the multi-process executor (also
    for one rank, asked for with ``distributed_executor_backend="mp"``: its group of one runs
    the same model, the executor's bookkeeping around it)."""
    size = config.tensor_parallel_size
    backend = config.distributed_executor_backend or ("uni" if size == 1 else "mp")
    if backend == "uni":
        return ModelRunner(config, max_model_len)
    return MultiprocExecutor(config, max_model_len, size)
