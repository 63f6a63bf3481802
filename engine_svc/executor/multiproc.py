"""The multi-process executor: one step run on ``size`` tensor-parallel ranks.

Rank 0 is a ``ModelRunner`` in the engine process: the scheduler's live requests are its, and
its results are the step's. Ranks 1..size-1 are worker processes (``worker_proc``), each
owning one device and its share of the KV cache; each step's scheduler output goes to them over
a pipe (``step_message``: what changed since the last step), then rank 0 runs it, the step's
collectives keeping the ranks together::

    EngineCore.step ─ schedule ─► MultiprocExecutor.execute ─┬─ pipe ─► worker 1: execute
                                                             ├─ pipe ─► worker N-1: execute
                                                             └────────► rank 0: execute ─► out

The KV cache has the same number of blocks on every rank (the smallest any rank fits). A
worker that dies is fatal: rank 0 would wait in a collective forever, so a watchdog thread
kills the other workers and hands a message naming the worker to ``on_worker_death``. By
default that ends the engine process at once (exit code 1); the gRPC server's handler first
reports NOT_SERVING and ends the open calls with the message, and the engine process ends
``FATAL_GRACE_S`` later whatever the handler did. A worker whose engine is gone ends itself.
The executor has the surface of a ``ModelRunner`` that ``EngineCore`` uses.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, wait

import torch

from engine_svc.config import EngineConfig, KVCacheLayout
from engine_svc.core.errors import EngineDeadError
from engine_svc.core.scheduler import SchedulerOutput
from engine_svc.distributed import destroy_tensor_parallel, init_tensor_parallel
from engine_svc.executor.step_message import StepEncoder
from engine_svc.executor.worker_proc import cpu_threads, rank_device, worker_main
from engine_svc.lora.manager import LoRAManager
from engine_svc.lora.registry import Placement
from engine_svc.models.llama import DecoderSpec
from engine_svc.worker.model_runner import ModelRunner, ModelRunnerOutput

logger = logging.getLogger(__name__)

WORKER_DIED_EXIT_CODE = 1
FATAL_GRACE_S = 5.0  # how long an ``on_worker_death`` handler has before the process ends
_READY_TIMEOUT_S = 600.0


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
        """Rank 0's adapters: the engine adds, pins and removes them there, and its registry
        decides every rank's slots (``step_message``: the workers' follow)."""
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
        """Rank 0's KV cache (each rank holds as much)."""
        return self.rank0.kv_cache_nbytes()

    def _on_every_rank(self, command: tuple[str, object], local: Callable[[], None]) -> None:
        # The workers first: waking up captures CUDA graphs, whose checks run collectives.
        for conn in self._conns:
            conn.send(command)
        local()
        for rank, conn in enumerate(self._conns, start=1):
            kind, _ = conn.recv()
            if kind != "ok":
                raise RuntimeError(f"rank {rank} answered {kind!r} to {command[0]!r}")

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
        for other in self._procs:
            if other.is_alive():
                other.kill()
        shutil.rmtree(self._store_dir, ignore_errors=True)
        self.on_worker_death(message)  # the default does not return
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
