"""Every environment variable the engine reads, in one place, all under the TANDEM_ prefix."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Where the embedded default model is built (TANDEM_CACHE_DIR, default ~/.cache/tandem)."""
    return Path(os.environ.get("TANDEM_CACHE_DIR", Path.home() / ".cache" / "tandem"))


def log_level() -> str:
    return os.environ.get("TANDEM_LOG_LEVEL", "INFO").upper()


def profile_dir() -> str | None:
    """Where StartProfile / StopProfile write torch profiler traces (TANDEM_PROFILE_DIR, the
    default of --profile-dir; unset: profiling is off). vLLM's VLLM_TORCH_PROFILER_DIR."""
    return os.environ.get("TANDEM_PROFILE_DIR") or None
