"""A draft model made from a target checkpoint: its first layers, with the target's embeddings,
final norm and head (a "layer-skip" draft: same vocabulary, a fraction of the cost). Used by the
draft-model speculative decoding tests and ``benchmarks/spec_decode.py``."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from safetensors.torch import save_file

from engine_svc.models.loader import iter_safetensors

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def layer_prefix_draft(target: Path, out: Path, num_layers: int) -> Path:
    """Write the first ``num_layers`` layers of ``target`` as a checkpoint in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((target / "config.json").read_text())
    if not 1 <= num_layers <= cfg["num_hidden_layers"]:
        raise ValueError(f"num_layers must be in 1..{cfg['num_hidden_layers']}, got {num_layers}")
    cfg["num_hidden_layers"] = num_layers
    if isinstance(cfg.get("layer_types"), list):
        cfg["layer_types"] = cfg["layer_types"][:num_layers]
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    tensors = {
        name: t.contiguous()
        for name, t in iter_safetensors(target)
        if (m := _LAYER.search(name)) is None or int(m.group(1)) < num_layers
    }
    save_file(tensors, str(out / "model.safetensors"))
    for f in target.iterdir():  # tokenizer and generation config, as they are
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json",):
            if not f.name.endswith(".index.json"):
                shutil.copy(f, out / f.name)
    return out
