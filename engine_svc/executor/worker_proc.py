"""A tensor-parallel worker process: one rank's ``ModelRunner`` running the steps the engine
sends it.

The engine (rank 0) sends over a pipe::

    ("step", StepMessage)    run it (no answer: the step's collectives keep the ranks in step,
                             and rank 0's results are the step's)
    ("sleep", level)         put the runner to sleep, answer ("ok", sleep level after it) or
                             ("error", (message, sleep level after it)): rank 0 decides
    ("wake", None)           wake it up, answered as "sleep"
    ("lora_put", (id, blob)) hold rank 0's host copy of a LoRA adapter (``blob``: it pickled),
                             answer ("ok", None) or ("error", message)
    ("lora_drop", ids)       let these host copies go (no answer)
    ("stop", None)           leave the group and exit 0

After start-up it answers ("ready", number of KV blocks). Any other error ends the process
with a non-zero code, which the engine's watchdog sees; an engine that is gone (the pipe
closes, or the process that started this one is no longer its parent) ends it too: no orphan.
SIGINT and SIGTERM are ignored: sent to the whole process group (Ctrl-C, systemd's
KillMode=control-group), they are the engine's to act on, and it stops its workers itself.
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import signal
import threading
import time
from multiprocessing.connection import Connection

import numpy as np
import torch

from engine_svc.config import EngineConfig
from engine_svc.distributed import destroy_tensor_parallel, init_tensor_parallel
from engine_svc.executor.step_message import RequestMirrors, StepMessage
from engine_svc.worker.device import resolve_device
from engine_svc.worker.input_batch import InputBatch
from engine_svc.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

_PARENT_POLL_S = 0.5


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    """The device rank ``rank`` owns: GPU ``rank`` on CUDA, the CPU otherwise."""
    device = resolve_device(config.device)
    return torch.device("cuda", rank) if device.type == "cuda" else device


def cpu_threads(size: int) -> int:
    """Threads per rank when ``size`` ranks share this machine's CPUs."""
    return max(1, (os.cpu_count() or 1) // size)


def worker_main(
    rank: int,
    size: int,
    init_method: str,
    config: EngineConfig,
    max_model_len: int,
    conn: Connection,
    parent_pid: int,
) -> None:
    """The worker process's entry point (``multiprocessing`` spawn target)."""
    # A stop signal to the group must not kill a worker before the engine drains: the engine
    # stops it (the pipe), and it ends itself if the engine is gone (the parent watch).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format=f"[tp rank {rank}] %(levelname)s %(message)s")
    _exit_with_parent(parent_pid, init_method)
    device = rank_device(config, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(cpu_threads(size))
    tp = init_tensor_parallel(rank, size, init_method, device)
    try:
        runner = ModelRunner(config, max_model_len, tp)
        conn.send(("ready", runner.layout.num_blocks))
        _serve(runner, conn)
    except EOFError:
        logger.error("the engine closed its pipe: exiting")
        _remove_store(init_method)
        os._exit(1)
    except BaseException:  # the engine dies of it too (its watchdog), perhaps before cleaning up
        _remove_store(init_method)
        raise
    finally:
        destroy_tensor_parallel(tp)


def _serve(runner: ModelRunner, conn: Connection) -> None:
    mirrors = RequestMirrors()
    while True:
        kind, arg = conn.recv()
        if kind == "step":
            assert isinstance(arg, StepMessage)
            so = mirrors.decode(arg)
            if runner.lora is not None:  # rank 0's slots, before the runner maps tokens
                runner.lora.follow(arg.lora)
            else:
                assert arg.lora is None, "rank 0 serves LoRA adapters: so does this rank"
            _take_rank0_tokens(runner.input_batch, arg, mirrors)
            out = runner.execute(so)
            mirrors.keep_prompt_logprobs(out.prompt_logprobs)  # type: ignore[arg-type]
        elif kind in ("sleep", "wake"):
            try:
                if kind == "sleep":
                    runner.sleep(int(arg))
                else:
                    runner.wake_up()
            except Exception as e:  # noqa: BLE001 -- retryable as on rank 0: the engine decides
                logger.exception("%s failed", kind)
                conn.send(("error", (f"{type(e).__name__}: {e}", runner.sleep_level)))
            else:
                conn.send(("ok", runner.sleep_level))
        elif kind == "lora_put":
            lora_id, blob = arg
            try:
                assert runner.lora is not None, "rank 0 serves LoRA adapters: so does this rank"
                runner.lora.keep(lora_id, pickle.loads(blob))
            except Exception as e:  # noqa: BLE001 -- the add is refused on every rank
                logger.exception("LoRA adapter %d: cannot take rank 0's host copy", lora_id)
                conn.send(("error", f"{type(e).__name__}: {e}"))
            else:
                conn.send(("ok", None))
        elif kind == "lora_drop":
            if runner.lora is not None:
                runner.lora.discard(arg)
        elif kind == "stop":
            return
        else:
            raise ValueError(f"unknown command {kind!r}")


def _take_rank0_tokens(batch: InputBatch, msg: StepMessage, mirrors: RequestMirrors) -> None:
    """Rank 0 samples (and verifies proposals). This rank's runner did too, from the same
    gathered logits, so its tokens are mostly rank 0's; where they are not (this rank could not
    apply what rank 0 did: a grammar's mask, a draft model's q; or its random state drifted: rank
    0's draft draws from a seeded request's generator), rank 0's tokens, which this step's
    message brings, replace them before any is fed to the model. After a verification the two
    may differ in number too (rank 0 accepted 3 proposals, this rank 1): the row takes rank 0's
    count::

        batch.token_ids[row]   prompt ... | known to both | emitted by this rank |
                                                          start                  n
        becomes                prompt ... | known to both | msg's new tokens |
                                                          start              num_tokens (rank 0's)

    A row with penalties whose tokens changed counts its output again from the mirror (what
    rank 0's row holds). Every collective's shape comes from the message, never from these
    tokens, so a worker's own draws change nothing rank 0 waits on.
    """
    for rid, tokens in msg.new_token_runs():
        row = batch.row_of.get(rid)
        if row is None:
            continue
        request = mirrors.requests[rid]
        end = request.num_tokens
        start = end - len(tokens)
        n = int(batch.num_tokens[row])
        if n <= start:  # this rank emitted nothing where rank 0 did: out of step
            raise RuntimeError(f"request {rid}: this rank holds {n} tokens, rank 0 {end}")
        stale = bool(batch.has_penalty[row]) and (
            n != end or not np.array_equal(batch.token_ids[row, start:end], tokens)
        )
        batch.token_ids[row, start:end] = tokens
        batch.num_tokens[row] = end
        if stale:  # its device-side counts are of this rank's tokens
            with torch.inference_mode():  # (the runner made them inside it)
                batch.count_penalties(row, request)


def _exit_with_parent(parent_pid: int, init_method: str) -> None:
    """End this process as soon as the engine that started it is gone (even while a collective
    blocks the main thread), removing the group's file store the engine could not."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(_PARENT_POLL_S)
        _remove_store(init_method)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _remove_store(init_method: str) -> None:
    """The group's file store, which an engine that is gone could not remove."""
    if init_method.startswith("file://"):
        shutil.rmtree(os.path.dirname(init_method.removeprefix("file://")), ignore_errors=True)
