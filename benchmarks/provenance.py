"""Where a benchmark's figures came from: when, on what machine, by which command.

Every results JSON under benchmarks/results/ starts with these three fields, so runs of
different benchmarks on one machine can be told apart and set side by side.
"""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import sys
from pathlib import Path
from typing import Any


def machine() -> dict[str, Any]:
    """The CPU model and core count (from /proc/cpuinfo where there is one), OS and host."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu_model": model,
        "cores": os.cpu_count(),
        "platform": platform.platform(),
        "node": platform.node(),
    }


def provenance() -> dict[str, Any]:
    """``date`` (UTC), ``machine`` and ``command`` (this process's command line, quoted)."""
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
    }
