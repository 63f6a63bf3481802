"""buf lint (STANDARD) passes on the contract; skipped only where npm is missing (failed in CI)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.external_tools import require

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_buf_lint() -> None:
    if not (ROOT / ".cache/buf/node_modules/.bin/buf").exists():
        require("npm", "it installs @bufbuild/buf to lint the protos")
    result = subprocess.run(
        ["bash", str(ROOT / "scripts" / "buf_lint.sh")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
