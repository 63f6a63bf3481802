"""Tiny random-weight PEFT LoRA adapters for the LoRA tests, made with PEFT itself (no downloads):
the adapter directories are exactly what ``PeftModel.save_pretrained`` writes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(
    base_dir: Path,
    out_dir: Path,
    *,
    r: int,
    alpha: float,
    targets: list[str] | str,
    seed: int,
    **config: Any,
) -> Path:
    """Save a LoRA adapter of rank ``r`` for the checkpoint in ``base_dir`` into ``out_dir``.

    A and B are both random (``init_lora_weights=False``; PEFT's default leaves B zero, which
    would make every adapter the base model), scaled down so outputs stay in range."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    cfg = LoraConfig(
        r=r,
        lora_alpha=alpha,
        target_modules=targets,
        init_lora_weights=False,
        lora_dropout=0.0,
        **config,
    )
    torch.manual_seed(seed)
    peft_model = get_peft_model(model, cfg)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.mul_(0.5)
    peft_model.save_pretrained(str(out_dir))
    return out_dir


def load_peft(base_dir: Path, adapters: dict[str, Path]) -> Any:
    """transformers' model of ``base_dir`` with every adapter of ``adapters`` loaded by PEFT
    under its name (for mixed-batch forwards: ``adapter_names=[...]``, "__base__" for none)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32).eval()
    items = list(adapters.items())
    name, path = items[0]
    peft_model = PeftModel.from_pretrained(model, str(path), adapter_name=name)
    for name, path in items[1:]:
        peft_model.load_adapter(str(path), adapter_name=name)
    return peft_model.eval()
