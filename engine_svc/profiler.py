"""The torch profiler over the engine's steps (vLLM's ``start_profile`` / ``stop_profile``).

Started and stopped on the engine loop thread, between two steps, so a trace holds whole steps:
CPU activity always, CUDA kernels too on a CUDA engine. ``stop`` writes a Chrome trace (open it
in Perfetto or chrome://tracing) into the profile directory (``--profile-dir`` or
``TANDEM_PROFILE_DIR``) and returns its path.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)


class ProfilerError(RuntimeError):
    """A profile cannot start or stop now: no profile directory, or not in the right state."""


class EngineProfiler:
    def __init__(self, directory: str | None, device: torch.device) -> None:
        self.directory = directory
        self.device = device
        self._profile: torch.profiler.profile | None = None

    @property
    def running(self) -> bool:
        return self._profile is not None

    def start(self) -> None:
        """Start profiling. ProfilerError without a directory or while a profile runs."""
        if self.directory is None:
            raise ProfilerError(
                "profiling is off: start the engine with --profile-dir DIR "
                "(or TANDEM_PROFILE_DIR) to enable it"
            )
        if self._profile is not None:
            raise ProfilerError("a profile is already running; stop it first")
        Path(self.directory).mkdir(parents=True, exist_ok=True)  # fail here, not at stop
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        profile = torch.profiler.profile(activities=activities, record_shapes=True)
        profile.start()
        self._profile = profile
        logger.info("profiler started; the trace goes to %s", self.directory)

    def stop(self) -> str:
        """Stop profiling and write the trace; returns its path. ProfilerError when no profile
        runs."""
        profile = self._profile
        if profile is None:
            raise ProfilerError("no profile is running; start one first")
        self._profile = None
        profile.stop()
        assert self.directory is not None  # start() checked it
        path = Path(self.directory) / f"tandem-engine-{os.getpid()}-{time.time_ns()}.trace.json"
        profile.export_chrome_trace(str(path))
        logger.info("profiler stopped; trace written to %s", path)
        return str(path)
