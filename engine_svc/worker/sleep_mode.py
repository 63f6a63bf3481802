"""Sleep mode for the model runner's tensors (vLLM's ``sleep`` / ``wake_up``).

    level 1   KV cache freed; weights copied to host memory (pinned) and freed on the device
    level 2   KV cache freed; weights dropped, read again from the checkpoint on wake up

The KV cache is the runner's to free and reallocate; this module handles the rest: the model's
parameters and buffers (rotary tables) and the LoRA slot tensors. A tensor is emptied in place
(``t.data = <empty>``), never replaced, so every module and view holder that refers to the
``Parameter`` object keeps referring to it, and it gets its storage back on wake up.

On the CPU the weights already live in host memory: level 1 leaves them alone (only the KV cache
goes). Level 2 drops the parameters everywhere (they are read again from the checkpoint); the
buffers and the LoRA slots are always kept in host memory rather than recomputed, so adapters in
device slots survive a sleep at either level.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from engine_svc.models.loader import checkpoint_tensors

SLEEP_LEVELS = (1, 2)


def check_sleep_level(level: int) -> int:
    """``level`` if it is a sleep level; ValueError naming ``level`` otherwise."""
    if level not in SLEEP_LEVELS:
        raise ValueError(f"level must be 1 or 2, got {level}")
    return level


@dataclass
class _Stashed:
    tensor: torch.Tensor  # the live tensor, emptied while asleep
    shape: torch.Size
    host: torch.Tensor | None  # its copy in host memory; None: read again from the checkpoint


@dataclass
class SleepingWeights:
    """What :func:`put_to_sleep` took off the device, and how to put it back."""

    level: int
    device: torch.device
    stashed: list[_Stashed] = field(default_factory=list)

    def wake_up(self, model: nn.Module, checkpoint: str | Path) -> None:
        """Give every emptied tensor its storage back on the device; at level 2, load the
        parameters from ``checkpoint`` again (``load_weights`` checks every one is provided).
        One that fails part way (no device memory) can be called again: nothing is forgotten
        until every tensor is back."""
        reload = False
        for s in self.stashed:
            if s.host is None:
                s.tensor.data = torch.empty(s.shape, dtype=s.tensor.dtype, device=self.device)
                reload = True
            else:
                s.tensor.data = s.host.to(self.device, non_blocking=True)
        if reload:
            with torch.no_grad():
                tp_size: int = model.plan.tp.size  # type: ignore[union-attr,assignment]
                # a sharded model reads its slices only
                model.load_weights(checkpoint_tensors(checkpoint, tp_size))  # type: ignore[operator]
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the host copies may go once this returns
        self.stashed.clear()


def put_to_sleep(
    level: int,
    model: nn.Module,
    extra: list[torch.Tensor],
    device: torch.device,
    checkpoint: str | Path,
) -> SleepingWeights:
    """Take the model's tensors (and ``extra`` ones: the LoRA slots) off ``device`` for sleep
    ``level``; the result puts them back. A failure part way (no pinned host memory for the
    copies) puts back what was taken (at level 2, from ``checkpoint``) before it is raised: the
    model is whole again, awake."""
    check_sleep_level(level)
    asleep = SleepingWeights(level, device)
    try:
        _take(asleep, model, extra)
    except BaseException:
        asleep.wake_up(model, checkpoint)
        raise
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
    return asleep


def _take(asleep: SleepingWeights, model: nn.Module, extra: list[torch.Tensor]) -> None:
    level, device = asleep.level, asleep.device
    params = _distinct(list(model.parameters()))
    kept = _distinct([*model.buffers(), *extra])
    for t in params:
        if level == 2:
            asleep.stashed.append(_Stashed(t, t.shape, None))
            t.data = torch.empty(0, dtype=t.dtype, device=device)
    if device.type == "cpu":
        return  # level 1 keeps the weights where they are: in host memory already
    for t in (params if level == 1 else []) + kept:
        host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
        host.copy_(t)
        asleep.stashed.append(_Stashed(t, t.shape, host))
        t.data = torch.empty(0, dtype=t.dtype, device=device)


def _distinct(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor once (a tied lm_head is the embedding)."""
    seen: set[int] = set()
    out = []
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out
