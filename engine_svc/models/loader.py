"""Load a Hugging Face checkpoint directory (config.json + *.safetensors) into our model code."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from engine_svc.models.llama import DecoderSpec, LlamaForCausalLM
from kernels.attention_backends import Kernels

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


def read_hf_config(model_dir: str | Path) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in model directory {model_dir}")
    cfg: dict[str, Any] = json.loads(path.read_text())
    return cfg


def architecture_of(cfg: dict[str, Any]) -> str:
    archs = cfg.get("architectures") or []
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return str(arch)
    raise ValueError(
        f"unsupported model architecture {archs or cfg.get('model_type')!r}; "
        f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def iter_safetensors(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint, sharded (model.safetensors.index.json) or not."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        paths = [model_dir / f for f in files]
    else:
        paths = sorted(model_dir.glob("*.safetensors"))
    if not paths:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    for path in paths:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                yield name, f.get_tensor(name)


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    kernels: Kernels | None = None,
) -> LlamaForCausalLM:
    cfg = read_hf_config(model_dir)
    spec = DecoderSpec.from_hf_config(cfg, architecture_of(cfg))
    with torch.device(device):
        model = LlamaForCausalLM(spec, max_positions, kernels)
    # Rotary tables stay float32; parameters take the serving dtype.
    for p in model.parameters():
        p.data = p.data.to(dtype)
    model.load_weights(iter_safetensors(model_dir))
    return model.eval()
