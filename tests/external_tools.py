"""Tests that need a program from outside Python (npm, docker-compose, helm) call ``require``.

Where the program is missing the test is skipped, unless ``TANDEM_REQUIRE_TOOLS=1`` (set by
``.ci/run``): there a missing program fails the test, so CI can never pass by skipping.
"""

from __future__ import annotations

import os
import shutil

import pytest


def require(program: str, why: str) -> str:
    """The path of ``program`` on PATH; skip (or fail under TANDEM_REQUIRE_TOOLS=1) if absent."""
    path = shutil.which(program)
    if path is not None:
        return path
    message = f"{program} is not installed: {why}"
    if os.environ.get("TANDEM_REQUIRE_TOOLS") == "1":
        pytest.fail(message + " (TANDEM_REQUIRE_TOOLS=1)")
    pytest.skip(message)
