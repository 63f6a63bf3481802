"""Host arrays to the device without making the host wait.

A copy from pageable host memory makes the CPU wait until the GPU has taken the bytes (torch
synchronizes the stream for it), so every such copy in a step is a host sync. ``upload`` copies
through pinned memory from torch's caching host allocator, non-blocking: the host goes on at
once, and the allocator keeps the pinned block out of reuse until the copy has run (it records
an event on the stream). The model's own inputs go through ``step_inputs.StepBuffers``
instead, whose device memory must stay put for CUDA graphs.
"""

from __future__ import annotations

import numpy as np
import torch


def upload(values: np.ndarray | list[int], device: torch.device) -> torch.Tensor:
    """A new device tensor holding ``values`` (the copy may still be in flight: use it on the
    current stream). On the CPU, a copy the caller owns."""
    host = torch.from_numpy(np.ascontiguousarray(values))
    if device.type == "cpu":
        return host.clone()
    return host.pin_memory().to(device, non_blocking=True)
