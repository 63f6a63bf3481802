"""Load a Hugging Face checkpoint directory (config.json + *.safetensors) into our model code."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from engine_svc.distributed import SINGLE, TPGroup
from engine_svc.models.llama import DecoderSpec, LlamaForCausalLM
from engine_svc.models.parallel import TensorSlice
from engine_svc.models.tasks import SUPPORTED_ARCHITECTURES, architecture_of, checkpoint_kind
from kernels.attention_backends import Kernels

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "architecture_of",
    "checkpoint_dtype",
    "checkpoint_tensors",
    "iter_safetensor_slices",
    "iter_safetensors",
    "load_model",
    "read_hf_config",
]


def read_hf_config(model_dir: str | Path) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in model directory {model_dir}")
    cfg: dict[str, Any] = json.loads(path.read_text())
    return cfg


def checkpoint_dtype(model_dir: str | Path) -> str | None:
    """The dtype config.json records for the weights (``dtype``, or the older ``torch_dtype``),
    e.g. ``"bfloat16"``; None when it names none."""
    cfg = read_hf_config(model_dir)
    name = cfg.get("dtype") or cfg.get("torch_dtype")
    return str(name) if name else None


def iter_safetensors(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint, sharded (model.safetensors.index.json) or not."""
    for path in _safetensors_files(model_dir):
        # safe_open maps the file: its pages count in RSS while it is open (file-backed and
        # reclaimable), but nothing is copied until a tensor is asked for.
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                yield name, f.get_tensor(name)


def iter_safetensor_slices(model_dir: str | Path) -> Iterator[tuple[str, TensorSlice]]:
    """Every tensor of the checkpoint as a slice not read yet (``safe_open(...).get_slice``),
    valid until the next one is asked for: a tensor-parallel rank indexes it to read its own
    rows or columns only."""
    for path in _safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                yield name, f.get_slice(name)


def _safetensors_files(model_dir: str | Path) -> list[Path]:
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        paths = [model_dir / f for f in files]
    else:
        paths = sorted(model_dir.glob("*.safetensors"))
    if not paths:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    return paths


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    kernels: Kernels | None = None,
    tp: TPGroup = SINGLE,
) -> LlamaForCausalLM:
    """Build the model for ``model_dir`` with its parameters in ``dtype`` on ``device``; with a
    tensor-parallel group of more than one rank, this rank's shard of it.

    Never builds a float32 copy first: the model is constructed on the meta device (no memory,
    no random init), each parameter is then allocated empty in ``dtype`` on ``device``, and the
    checkpoint tensors are copied in one at a time (cast on the copy). Peak anonymous memory is
    about the weights in ``dtype`` plus one checkpoint tensor (the mapped checkpoint file comes
    on top, as page cache). The rotary tables are computed in float32 on
    ``device``. A parameter the checkpoint does not provide is an error, never left uninitialised.
    A rank of a sharded model reads only its slice of each sharded tensor from the file.
    """
    cfg = read_hf_config(model_dir)
    kind = checkpoint_kind(model_dir, cfg)
    spec = DecoderSpec.from_hf_config(cfg, kind.arch)
    with torch.device("meta"):
        model = LlamaForCausalLM(spec, max_positions, kernels, kind.lm_head, kind.num_labels, tp)
    _materialise_empty(model, dtype, device)
    model.rotary_emb.init_tables(device)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"tensors left on the meta device after materialising: {left[:8]}")
    model.load_weights(checkpoint_tensors(model_dir, tp.size))  # raises if one is missing
    return model.eval()


def checkpoint_tensors(
    model_dir: str | Path, tp_size: int
) -> Iterator[tuple[str, torch.Tensor]] | Iterator[tuple[str, TensorSlice]]:
    """What ``load_weights`` reads: whole tensors for one rank, slices (each rank reads its own
    part of each tensor from the file) for several."""
    return iter_safetensors(model_dir) if tp_size == 1 else iter_safetensor_slices(model_dir)


def _materialise_empty(model: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """Replace every (meta) parameter by an uninitialised one of ``dtype`` on ``device``.

    Tied parameters (lm_head sharing the embedding) stay one tensor: each distinct parameter is
    allocated once. ``Module.to_empty`` would untie them and cannot change the dtype.
    """
    made: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if id(param) not in made:
                empty = torch.empty(param.shape, dtype=dtype, device=device)
                made[id(param)] = nn.Parameter(empty, requires_grad=param.requires_grad)
            setattr(module, name, made[id(param)])
