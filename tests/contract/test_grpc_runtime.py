"""Both services choose grpcio's polling I/O (protos/grpc_runtime.py) before grpc is imported,
and leave an operator's ``GRPC_EXPERIMENTS`` alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from protos.grpc_runtime import EXPERIMENTS, POLLING_IO, prefer_polling_io

ROOT = Path(__file__).resolve().parents[2]


def test_a_child_environment_gets_the_polling_io() -> None:
    env: dict[str, str] = {"PATH": "/bin"}
    assert prefer_polling_io(env) is None
    assert env[EXPERIMENTS] == POLLING_IO == "-event_engine_client,-event_engine_listener"


@pytest.mark.parametrize("operators", ["", "-event_engine_client", "event_engine_fork"])
def test_the_operators_setting_is_kept(operators: str) -> None:
    env = {EXPERIMENTS: operators}
    assert prefer_polling_io(env) is None
    assert env == {EXPERIMENTS: operators}


def test_too_late_in_a_process_that_imported_grpc(monkeypatch: pytest.MonkeyPatch) -> None:
    import grpc  # noqa: F401  (the test process has it already; be sure)

    monkeypatch.delenv(EXPERIMENTS, raising=False)
    warning = prefer_polling_io()
    assert warning is not None and "grpcio's default" in warning
    assert EXPERIMENTS not in os.environ  # setting it now would only mislead
    monkeypatch.setenv(EXPERIMENTS, "")  # the operator's choice: nothing to warn about
    assert prefer_polling_io() is None


# Runs an entrypoint's main with --help (it exits at argument parsing) and reports whether grpc
# was already imported when the entrypoint chose its I/O, and what the variable was then.
_PROBE = """
import json, os, sys
import protos.grpc_runtime as runtime
seen = []
choose = runtime.prefer_polling_io
def spy(environ=None):
    seen.append("grpc" in sys.modules)
    return choose(environ)
runtime.prefer_polling_io = spy
import importlib
entry = importlib.import_module(sys.argv[1])
try:
    entry.main(["--help"])
except SystemExit:
    pass
print(json.dumps({"calls": seen, "value": os.environ.get("GRPC_EXPERIMENTS")}))
"""


@pytest.mark.parametrize("entrypoint", ["frontend_svc.__main__", "engine_svc.__main__"])
@pytest.mark.parametrize("operators", [None, "event_engine_fork"])
def test_entrypoints_choose_before_grpc_is_imported(entrypoint: str, operators: str | None) -> None:
    env = {k: v for k, v in os.environ.items() if k != EXPERIMENTS}
    if operators is not None:
        env[EXPERIMENTS] = operators
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, entrypoint],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["calls"] == [False]  # called once, before anything imported grpc
    assert report["value"] == (POLLING_IO if operators is None else operators)


def _grpc_import_log(experiments: str) -> str:
    env = dict(os.environ, **{EXPERIMENTS: experiments})
    done = subprocess.run(
        [sys.executable, "-c", "import grpc"], capture_output=True, text=True, timeout=60, env=env
    )
    assert done.returncode == 0, done.stderr
    return done.stderr


def test_this_grpcio_still_has_the_polling_io() -> None:
    """A grpcio that dropped the experiments runs on EventEngine whatever is set (and logs one
    line): this fails then, so that an upgrade cannot undo the choice quietly."""
    control = _grpc_import_log("-no_such_experiment_tandem")
    assert "Unknown experiment: no_such_experiment_tandem" in control, control  # the log works
    log = _grpc_import_log(POLLING_IO)
    assert "Unknown experiment" not in log, (
        "this grpcio no longer has the experiments protos/grpc_runtime.py turns off: " + log
    )
