"""Tensor parallelism's processes end together: a killed worker ends the engine at once with a
message naming it (exit code 1, no hang in a collective), and a killed engine leaves no worker
behind. 2 ranks on the CPU (gloo)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(120)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not reaped yet) is gone too.
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"


def _wait_gone(pid: int, timeout: float) -> float:
    start = time.monotonic()
    while _alive(pid):
        assert time.monotonic() - start < timeout, f"pid {pid} still alive after {timeout}s"
        time.sleep(0.05)
    return time.monotonic() - start


@pytest.fixture()
def tp_engine(tiny_models: dict[str, Path]) -> Iterator[tuple[subprocess.Popen[str], int]]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.chaos.tp_engine_proc", str(tiny_models["llama"])],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    worker = 0
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # once the engine is ready
        assert line.startswith("pids"), (line, proc.stderr.read() if proc.stderr else "")
        _, _, worker_pid = line.split()
        worker = int(worker_pid)
        time.sleep(0.5)  # generating
        yield proc, worker
    finally:
        for pid in (proc.pid, worker):
            if pid and _alive(pid):
                os.kill(pid, signal.SIGKILL)
        proc.wait(10)


def test_a_killed_worker_ends_the_engine_with_a_message(
    tp_engine: tuple[subprocess.Popen[str], int],
) -> None:
    proc, worker = tp_engine
    os.kill(worker, signal.SIGKILL)
    assert proc.wait(timeout=10) == 1
    assert proc.stderr is not None
    err = proc.stderr.read()
    assert f"tensor-parallel worker rank 1 (pid {worker}) exited with code -9" in err, err


def test_a_killed_engine_leaves_no_worker(tp_engine: tuple[subprocess.Popen[str], int]) -> None:
    proc, worker = tp_engine
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)
    assert _wait_gone(worker, timeout=5) < 5
