"""The multi-process executor's answered commands and its watchdog, on the CPU without worker
processes: the executor's pipe goes to a thread running the real worker loop
(``worker_proc._serve``) over a fake runner, rank 0 is a fake runner too.

* Sleep and wake read every worker's answer whatever rank 0 did: a failure on every rank is
  raised (retryable) and the next command reads its own answers; a worker's failure is an
  answer, not its end; ranks left at different sleep levels end the engine (EngineDeadError).
* A LoRA adapter's host copy goes to the workers when rank 0 adds it: an add a worker cannot
  take is refused on every rank; a removed one goes on the workers too.
* The watchdog ends the process even when the worker-death handler raises.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from multiprocessing import Pipe
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest
import torch

from engine_svc.core.errors import EngineDeadError
from engine_svc.executor import multiproc, worker_proc
from engine_svc.executor.multiproc import MultiprocExecutor
from engine_svc.lora.adapter import ModelDims
from engine_svc.lora.config import LoRAConfig
from engine_svc.lora.errors import LoRAError
from engine_svc.lora.manager import LoRAManager
from engine_svc.models.llama import DecoderSpec
from engine_svc.models.loader import architecture_of, read_hf_config
from tests.lora_peft import make_adapter

pytestmark = pytest.mark.timeout(60)


@dataclass
class FakeRunner:
    """What the executor and the worker loop use of a ``ModelRunner`` for these commands."""

    sleep_level: int = 0
    lora: LoRAManager | None = None
    fail_sleep: int = 0  # how many of the next sleeps raise
    fail_wake: int = 0
    calls: list[str] = field(default_factory=list)

    def sleep(self, level: int) -> None:
        self.calls.append("sleep")
        if self.fail_sleep:
            self.fail_sleep -= 1
            raise RuntimeError("no host memory for the weights")
        self.sleep_level = level

    def wake_up(self) -> None:
        self.calls.append("wake")
        if self.fail_wake:
            self.fail_wake -= 1
            raise RuntimeError("CUDA out of memory")
        self.sleep_level = 0


@dataclass
class Ranks:
    executor: MultiprocExecutor
    rank0: FakeRunner
    worker: FakeRunner
    conn: Connection  # the executor's end
    thread: threading.Thread

    def sync(self) -> None:
        """Return once the worker has handled every command sent before (a no-op wake)."""
        assert [kind for kind, _ in self.executor._ask(("wake", None))] == ["ok"]


def _ranks(rank0: FakeRunner, worker: FakeRunner) -> Ranks:
    ex = MultiprocExecutor.__new__(MultiprocExecutor)  # no process, no group
    ours, theirs = Pipe()
    ex.size = 2
    ex.rank0 = rank0  # type: ignore[assignment]
    ex._conns = [ours]
    ex._procs = []
    ex._closing = threading.Event()
    ex._fatal = None
    thread = threading.Thread(target=worker_proc._serve, args=(worker, theirs), daemon=True)
    thread.start()
    return Ranks(ex, rank0, worker, ours, thread)


@pytest.fixture()
def ranks() -> Iterator[Ranks]:
    r = _ranks(FakeRunner(), FakeRunner())
    yield r
    if r.thread.is_alive():
        r.conn.send(("stop", None))
        r.thread.join(5)


# ------------------------------------------------------------------ sleep and wake
def test_a_wake_failing_on_every_rank_is_retryable_and_later_commands_read_their_answers(
    ranks: Ranks,
) -> None:
    ex = ranks.executor
    ex.sleep(1)
    assert ranks.rank0.sleep_level == ranks.worker.sleep_level == 1
    ranks.rank0.fail_wake = ranks.worker.fail_wake = 1  # no device memory on any rank
    with pytest.raises(RuntimeError, match="CUDA out of memory"):
        ex.wake_up()
    assert ranks.rank0.sleep_level == ranks.worker.sleep_level == 1  # all still asleep
    assert ranks.thread.is_alive()  # the worker answered: it did not end
    ex.wake_up()  # the retry reads its own answers, not the failed wake's
    assert ranks.rank0.sleep_level == ranks.worker.sleep_level == 0
    ex.sleep(2)
    assert ranks.rank0.sleep_level == ranks.worker.sleep_level == 2
    ex.wake_up()
    assert ranks.worker.calls == ["sleep", "wake", "wake", "sleep", "wake"]
    assert ex._fatal is None


def test_a_sleep_failing_on_every_rank_leaves_them_awake_and_can_be_retried(
    ranks: Ranks,
) -> None:
    ranks.rank0.fail_sleep = ranks.worker.fail_sleep = 1
    with pytest.raises(RuntimeError, match="no host memory"):
        ranks.executor.sleep(1)
    assert ranks.rank0.sleep_level == ranks.worker.sleep_level == 0
    ranks.executor.sleep(1)
    assert ranks.rank0.sleep_level == ranks.worker.sleep_level == 1


def test_a_worker_whose_wake_fails_answers_and_ranks_out_of_step_end_the_engine(
    ranks: Ranks,
) -> None:
    ex = ranks.executor
    ex.sleep(1)
    ranks.worker.fail_wake = 1  # rank 0 wakes, the worker stays asleep
    with pytest.raises(EngineDeadError, match=r"out of step after 'wake': sleep levels \[0, 1\]"):
        ex.wake_up()
    assert "rank 1: RuntimeError: CUDA out of memory" in (ex._fatal or "")
    assert ranks.thread.is_alive()  # it answered (the executor ends a real worker itself)


def test_rank_0s_failed_wake_beside_awake_workers_ends_the_engine(ranks: Ranks) -> None:
    ex = ranks.executor
    ex.sleep(1)
    ranks.rank0.fail_wake = 1
    with pytest.raises(EngineDeadError, match=r"sleep levels \[1, 0\].*rank 0: RuntimeError"):
        ex.wake_up()


# ------------------------------------------------------------------ LoRA host copies
@pytest.fixture(scope="module")
def adapter_dir(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tp_cmd_adapter") / "a"
    return make_adapter(tiny_models["llama"], out, r=4, alpha=8, targets=["q_proj"], seed=3)


def _manager(model_dir: Path) -> LoRAManager:
    cfg = read_hf_config(model_dir)
    dims = ModelDims.from_spec(DecoderSpec.from_hf_config(cfg, architecture_of(cfg)))
    config = LoRAConfig(max_loras=1, max_lora_rank=8)
    return LoRAManager(config, dims, torch.float32, torch.device("cpu"))


def test_an_add_a_worker_cannot_take_is_refused_on_every_rank(
    tiny_models: dict[str, Path], adapter_dir: Path
) -> None:
    rank0, worker = _manager(tiny_models["llama"]), _manager(tiny_models["llama"])
    r = _ranks(FakeRunner(lora=rank0), FakeRunner(lora=worker))
    try:
        rank0.mirror = r.executor
        keep = worker.keep
        failures = [MemoryError("cannot allocate 4 MiB")]

        def keep_once_failing(lora_id: int, adapter: Any) -> None:
            if failures:
                raise failures.pop()
            keep(lora_id, adapter)

        worker.keep = keep_once_failing  # type: ignore[method-assign]
        adapter = rank0.read(adapter_dir)
        with pytest.raises(LoRAError, match="tensor-parallel rank 1 could not take it"):
            rank0.add("a", adapter)
        r.sync()
        assert rank0.infos() == [] and rank0.host_ids == set() and worker.host_ids == set()
        info = rank0.add("a", adapter)  # it can now: every rank holds it
        r.sync()
        assert rank0.host_ids == worker.host_ids == {info.lora_id}
        held = next(iter(worker._host.values()))
        for key, m in adapter.modules.items():  # rank 0's copy, not one read by the worker
            assert torch.equal(held.modules[key].a, m.a) and torch.equal(held.modules[key].b, m.b)
        rank0.remove("a")
        r.sync()
        assert rank0.host_ids == worker.host_ids == set()
    finally:
        r.conn.send(("stop", None))
        r.thread.join(5)


# ------------------------------------------------------------------ the watchdog
def test_the_engine_ends_even_when_the_death_handler_raises(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    ex = MultiprocExecutor.__new__(MultiprocExecutor)
    ex._procs = []
    ex._closing = threading.Event()
    ex._fatal = None
    ex._store_dir = str(tmp_path / "store")
    ex._death = lambda timeout_s: "tensor-parallel worker rank 1 (pid 7) exited"  # type: ignore[method-assign]
    ended: list[str] = []
    monkeypatch.setattr(multiproc, "FATAL_GRACE_S", 0.01)
    monkeypatch.setattr(multiproc, "exit_engine", ended.append)

    def handler(message: str) -> None:
        raise RuntimeError("the server's handler broke")

    ex.on_worker_death = handler
    thread = threading.Thread(target=ex._watch)
    thread.start()
    thread.join(5)
    assert ended == ["tensor-parallel worker rank 1 (pid 7) exited"]
