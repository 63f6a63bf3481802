"""scripts/setup.sh and the packaging metadata it installs from.

The license stays an SPDX string (a TOML table makes setuptools warn on every install). setup.sh
runs its installs only when they are due: a fresh venv, a changed pyproject.toml or torch pin, a
venv that no longer finds the packages, or a previous install that failed. Its runs here are on a
copy of the script with a fake python: ``-m venv`` makes the venv, ``-m pip`` logs the call and
writes stub packages (or fails, when told to), anything else runs the real interpreter without
site-packages on the stubs.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.deploy.conftest import REPO

tomllib = pytest.importorskip("tomllib")

FAKE_PYTHON = """#!/bin/sh
echo "$*" >>"$FAKE_LOG"
if [ "$1" = -m ] && [ "$2" = venv ]; then
  mkdir -p "$3/bin" && cp "$0" "$3/bin/python" && exit 0
fi
if [ "$1" = -m ] && [ "$2" = pip ]; then
  [ -n "$FAKE_PIP_FAILS" ] && exit 1
  for m in torch transformers engine_svc; do
    mkdir -p "$FAKE_SITE/$m" && echo "__version__ = 'stub'" >"$FAKE_SITE/$m/__init__.py"
  done
  exit 0
fi
[ "$1" = -I ] && shift  # -I would drop PYTHONPATH, where the stubs are
PYTHONPATH="$FAKE_SITE" exec "$REAL_PYTHON" -S "$@"
"""


def test_license_is_an_spdx_string() -> None:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert pyproject["project"]["license"] == "Apache-2.0"
    # setuptools reads a string license as SPDX from 77 on (older ones reject it).
    assert "setuptools>=77" in pyproject["build-system"]["requires"]


class Checkout:
    """A copy of setup.sh and pyproject.toml in a temporary tree, run with the fake python."""

    def __init__(self, root: Path) -> None:
        self.root = root
        (root / "scripts").mkdir()
        shutil.copy2(REPO / "scripts" / "setup.sh", root / "scripts" / "setup.sh")
        shutil.copy2(REPO / "pyproject.toml", root / "pyproject.toml")
        self.fake = root / "fake-python3"
        self.fake.write_text(FAKE_PYTHON)
        self.fake.chmod(0o755)
        self.log = root / "calls.log"
        self.site = root / "site"
        self.stamp = root / ".venv" / "tandem-setup.stamp"

    def run(self, **env: str) -> subprocess.CompletedProcess[str]:
        self.log.write_text("")
        full_env = {
            **{k: v for k, v in os.environ.items() if k != "TANDEM_TORCH"},
            "PYTHON": str(self.fake),
            "FAKE_LOG": str(self.log),
            "FAKE_SITE": str(self.site),
            "REAL_PYTHON": sys.executable,
            **env,
        }
        return subprocess.run(
            ["bash", str(self.root / "scripts" / "setup.sh")],
            env=full_env,
            capture_output=True,
            text=True,
            timeout=60,
        )

    def installs(self) -> list[str]:
        """The arguments of each ``pip install`` of the last run."""
        lines = self.log.read_text().splitlines()
        return [line.removeprefix("-m pip install -q ") for line in lines if " pip " in line]


@pytest.fixture()
def checkout(tmp_path: Path) -> Checkout:
    return Checkout(tmp_path)


def test_installs_once_then_skips(checkout: Checkout) -> None:
    first = checkout.run()
    assert first.returncode == 0, first.stderr
    assert checkout.installs() == ["--upgrade pip", "torch==2.13.0", "-e .[dev]"]
    assert "tandem ready: torch stub" in first.stdout
    assert checkout.stamp.exists()

    second = checkout.run()
    assert second.returncode == 0, second.stderr
    assert checkout.installs() == []
    assert "installed already" in second.stdout
    assert second.stderr == ""


def test_a_changed_pyproject_or_torch_pin_installs_again(checkout: Checkout) -> None:
    assert checkout.run().returncode == 0
    pyproject = checkout.root / "pyproject.toml"
    pyproject.write_text(pyproject.read_text() + "\n# a change\n")
    assert checkout.run().returncode == 0
    assert "-e .[dev]" in checkout.installs()
    assert checkout.run().returncode == 0
    assert checkout.installs() == []

    assert checkout.run(TANDEM_TORCH="torch==2.12.0").returncode == 0
    assert "torch==2.12.0" in checkout.installs()


def test_a_venv_that_lost_a_package_installs_again(checkout: Checkout) -> None:
    assert checkout.run().returncode == 0
    shutil.rmtree(checkout.site / "engine_svc")
    result = checkout.run()
    assert result.returncode == 0, result.stderr
    assert "-e .[dev]" in checkout.installs()
    assert (checkout.site / "engine_svc").exists()


def test_a_venv_without_python_is_made_again(checkout: Checkout) -> None:
    assert checkout.run().returncode == 0
    (checkout.root / ".venv" / "bin" / "python").unlink()
    assert checkout.run().returncode == 0
    assert checkout.log.read_text().splitlines()[0] == "-m venv .venv"
    assert len(checkout.installs()) == 3


def test_a_failed_install_leaves_no_stamp(checkout: Checkout) -> None:
    assert checkout.run().returncode == 0  # the stubs exist from here on
    checkout.stamp.unlink()
    failed = checkout.run(FAKE_PIP_FAILS="1")
    # The packages still import, so this run goes on, but the next one tries the install again.
    assert failed.returncode == 0
    assert "the next run tries it again" in failed.stderr
    assert not checkout.stamp.exists()
    assert checkout.run().returncode == 0
    assert len(checkout.installs()) == 3
    assert checkout.stamp.exists()
