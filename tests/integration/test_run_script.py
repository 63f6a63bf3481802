"""``scripts/run.sh``: arguments before a lone ``--`` go to the engine, those after it to the
gateway; whichever process stops first stops the other, and the script exits with its status.

The split is read from the dry run (``TANDEM_RUN_DRY_RUN=1``); the stops run the real script
(without setup.sh: the venv is the one running these tests)."""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.integration.harness import free_port

pytestmark = pytest.mark.timeout(90)

ROOT = Path(__file__).resolve().parents[2]
RUN = ROOT / "scripts" / "run.sh"
PY = [".venv/bin/python", "-m"]


def dry_run(*args: str, **env: str) -> tuple[list[str], list[str]]:
    """The engine's and the gateway's command lines for these arguments."""
    environ = {
        k: v for k, v in os.environ.items() if not k.startswith("TANDEM_") or k == "TANDEM_HOME"
    }
    r = subprocess.run(
        ["bash", str(RUN), *args],
        env={**environ, **env, "TANDEM_RUN_DRY_RUN": "1"},
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    commands = dict(line.split(": ", 1) for line in r.stdout.splitlines())
    return shlex.split(commands["engine"]), shlex.split(commands["gateway"])


def test_arguments_without_a_double_dash_all_go_to_the_engine() -> None:
    engine, gateway = dry_run("--model", "/models/my model", "--max-model-len", "512")
    assert engine == [*PY, "engine_svc", "--port", "50051"] + [
        "--model",
        "/models/my model",
        "--max-model-len",
        "512",
    ]
    assert gateway == [*PY, "frontend_svc", "--engine", "127.0.0.1:50051", "--port", "8000"]


def test_arguments_after_a_lone_double_dash_go_to_the_gateway() -> None:
    engine, gateway = dry_run(
        "--model", "/m", "--", "--api-key", "k k", "--api-server-count", "2", "--", "x"
    )
    assert engine == [*PY, "engine_svc", "--port", "50051", "--model", "/m"]
    assert gateway[7:] == ["--api-key", "k k", "--api-server-count", "2", "--", "x"]
    engine, gateway = dry_run("--", "--port", "9000")  # gateway flags only
    assert engine == [*PY, "engine_svc", "--port", "50051"]
    assert gateway[3:] == ["--engine", "127.0.0.1:50051", "--port", "9000", "--port", "9000"]


def test_the_ports_follow_the_flags_and_the_environment() -> None:
    engine, gateway = dry_run("--port=6000", "--", "--port", "9000")
    assert engine[3:5] == ["--port", "6000"]
    assert gateway[3:7] == ["--engine", "127.0.0.1:6000", "--port", "9000"]
    engine, gateway = dry_run(TANDEM_ENGINE_PORT="6001", TANDEM_PORT="9001")
    assert engine[3:5] == ["--port", "6001"]
    assert gateway[3:7] == ["--engine", "127.0.0.1:6001", "--port", "9001"]


def start(*args: str, **env: str) -> subprocess.Popen[str]:
    """The real script, in a process group of its own (so that none of it is left behind)."""
    environ = {
        **os.environ,
        "TANDEM_SKIP_SETUP": "1",
        "TANDEM_ENGINE_PORT": str(free_port()),
        "TANDEM_PORT": str(free_port()),
        **env,
    }
    return subprocess.Popen(
        ["bash", str(RUN), *args],
        env=environ,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def finish(proc: subprocess.Popen[str], timeout: float = 60) -> tuple[int, str]:
    """Its exit status and output, once nothing of its process group is left."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        leftovers = _group_alive(proc.pid)
        if leftovers:
            os.killpg(proc.pid, signal.SIGKILL)
    assert not leftovers, "run.sh left processes behind"
    return proc.returncode, out


def _group_alive(pgid: int) -> bool:
    deadline = time.monotonic() + 5  # a child reaped a moment after the script
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        time.sleep(0.05)
    return True


def test_a_taken_http_port_stops_the_engine_and_fails(cache_dir: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = start(TANDEM_PORT=str(port), TANDEM_CACHE_DIR=str(cache_dir))
        status, out = finish(proc)
    assert status == 1, out
    assert (
        f"cannot serve on 127.0.0.1:{port}: Address already in use: another process listens "
        "there (stop it or choose another --port)"
    ) in out
    assert out.rstrip().endswith("run.sh: the gateway exited with status 1; stopping the engine")
    assert "Traceback" not in out


def test_an_engine_that_fails_stops_the_gateway(cache_dir: Path) -> None:
    status, out = finish(start("--no-such-flag", TANDEM_CACHE_DIR=str(cache_dir)))
    assert status == 2, out  # argparse's, from the engine
    assert "unrecognized arguments: --no-such-flag" in out
    assert "run.sh: the engine exited with status 2; stopping the gateway" in out


def test_sigterm_stops_both(cache_dir: Path) -> None:
    proc = start(TANDEM_CACHE_DIR=str(cache_dir))
    assert proc.stdout is not None
    assert proc.stdout.readline().startswith("gateway: http://127.0.0.1:")  # both started
    time.sleep(1)
    proc.send_signal(signal.SIGTERM)
    status, _ = finish(proc)
    assert status == 143
