"""Which device and dtype the engine runs in, resolved once from the config."""

from __future__ import annotations

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(
    name: str, device: torch.device, checkpoint_dtype: str | None = None
) -> torch.dtype:
    """The serving dtype for ``--dtype name`` on ``device``.

    ``checkpoint_dtype`` is what the checkpoint's config.json records (``dtype`` or
    ``torch_dtype``; ``loader.checkpoint_dtype``), None when it names none. An explicit name wins;
    ``auto`` follows the checkpoint, as vLLM does:

        checkpoint     CUDA       CPU (any other device)
        bfloat16       bfloat16   bfloat16
        float16        float16    bfloat16  (CPU: no fp16 decode kernel; ~1.3x slower end to
                                            end, benchmarks/results/cpu_dtype.md)
        float32        bfloat16   float32   (GPU: downcast, like vLLM)
        none           bfloat16   float32
    """
    if name != "auto":
        return _DTYPES[name]
    if checkpoint_dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    recorded = _DTYPES.get(checkpoint_dtype.removeprefix("torch."))
    if recorded is None:
        raise ValueError(
            f"checkpoint dtype {checkpoint_dtype!r} is not one of {', '.join(_DTYPES)}; "
            "pass --dtype explicitly"
        )
    if device.type == "cuda":
        return torch.bfloat16 if recorded == torch.float32 else recorded
    return torch.bfloat16 if recorded == torch.float16 else recorded
