"""Host-side CUDA API calls of a piece of work, counted by name with torch.profiler.

The profiler records each CUDA runtime and driver call the host makes (CUPTI's API records; CUDA
activity is asked for too, so that they are there whatever the torch build). ``CUDA_CALLS``
groups the names that matter for a host-bound step: kernel launches, CUDA graph launches,
copies, and the calls that make the host wait for the device. On the CPU every count is 0.

    counts = count_cuda_calls(lambda: [core.step() for _ in range(4)], "cuda")
    per_step(counts, 4)   # {"launches": ..., "graph_launches": ..., "copies": ...,
                          #  "syncs": ..., "calls": launches + graph launches + copies}
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable

import torch

CUDA_CALLS: dict[str, tuple[str, ...]] = {
    "launches": ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC"),
    "graph_launches": ("cudaGraphLaunch",),
    "copies": ("cudaMemcpyAsync", "cudaMemcpy"),
    "syncs": (
        "cudaStreamSynchronize",
        "cudaDeviceSynchronize",
        "cudaEventSynchronize",
        "cudaMemcpy",  # synchronous
    ),
}
CALLS = frozenset(CUDA_CALLS["launches"] + CUDA_CALLS["graph_launches"] + CUDA_CALLS["copies"])
_CUDA_API = re.compile(r"^cu(da)?[A-Z]")  # cudaLaunchKernel, cuLaunchKernelEx; not cutlass_*


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def count_cuda_calls(work: Callable[[], object], device: str) -> dict[str, int]:
    """Every CUDA runtime / driver call ``work()`` makes, by name, sorted."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(ProfilerActivity.CUDA)
    sync(device)  # before the window: this sync is not the work's
    with profile(activities=activities) as prof:
        work()
    counts: Counter[str] = Counter()
    for event in prof.key_averages():
        if _CUDA_API.match(event.key):
            counts[event.key] += event.count
    if device == "cuda" and counts["cudaDeviceSynchronize"]:
        # With CUDA activity, the profiler's exit synchronizes the device before it stops
        # recording: one call that is not the work's.
        counts["cudaDeviceSynchronize"] -= 1
    return dict(sorted((k, v) for k, v in counts.items() if v))


def per_step(counts: dict[str, int], steps: int) -> dict[str, float]:
    """The ``CUDA_CALLS`` groups per step, plus ``calls`` (launches, graph launches, copies)."""
    out = {
        group: sum(counts.get(n, 0) for n in names) / steps for group, names in CUDA_CALLS.items()
    }
    out["calls"] = sum(counts.get(n, 0) for n in CALLS) / steps
    return out
