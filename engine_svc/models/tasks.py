"""What a checkpoint is and what it serves, read from its files alone (no torch).

    architecture                          heads           tasks
    Llama/Qwen2/Qwen3ForCausalLM          lm_head         generate, embed
    LlamaModel, Qwen2Model, Qwen3Model    none            embed
    *ForSequenceClassification            score           classify (+ score with one label)

A *ForCausalLM checkpoint saved without an ``lm_head`` tensor and without tied embeddings (an
embedding model exported from a base model) serves "embed" only. Weight names of base models
have no ``model.`` prefix; the loader strips it either way.

Embeddings pool as the checkpoint's sentence-transformers files say (``modules.json`` -> the
Pooling module's ``config.json``: ``pooling_mode_lasttoken`` / ``_mean_tokens`` / ``_cls_token``),
else LAST; an explicit ``--pooling-type`` overrides both. Matryoshka support comes from
config.json's ``matryoshka_dimensions`` / ``is_matryoshka`` (as vLLM reads them).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine_svc.core.pooling_params import GENERATE, ModelTasks, PoolingType
from protos.types import PoolingTask

FAMILIES = ("Llama", "Qwen2", "Qwen3")
_SUFFIXES = {"ForCausalLM": "lm", "Model": "none", "ForSequenceClassification": "classifier"}
SUPPORTED_ARCHITECTURES = tuple(f + s for s in _SUFFIXES for f in FAMILIES)

_ST_POOLING = "sentence_transformers.models.Pooling"
_ST_MODES = {
    "pooling_mode_lasttoken": PoolingType.LAST,
    "pooling_mode_mean_tokens": PoolingType.MEAN,
    "pooling_mode_cls_token": PoolingType.CLS,
}


@dataclass(frozen=True)
class CheckpointKind:
    """The architecture's family and which head the model has."""

    arch: str
    family: str  # "Llama", "Qwen2" or "Qwen3": the decoder's switches (models/llama.py)
    lm_head: bool  # a language-model head: the model generates
    num_labels: int  # outputs of the classifier head (``score``); 0: no classifier

    @property
    def causal_lm_arch(self) -> str:
        """The *ForCausalLM name of the family (what ``DecoderSpec`` switches on)."""
        return f"{self.family}ForCausalLM"


def architecture_of(cfg: dict[str, Any]) -> str:
    archs = cfg.get("architectures") or []
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return str(arch)
    raise ValueError(
        f"unsupported model architecture {archs or cfg.get('model_type')!r}; "
        f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def checkpoint_tensor_shapes(model_dir: str | Path) -> dict[str, list[int]]:
    """Name -> shape of every tensor in the checkpoint, from the safetensors headers only."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        paths = [model_dir / f for f in files]
    else:
        paths = sorted(model_dir.glob("*.safetensors"))
    shapes: dict[str, list[int]] = {}
    for path in paths:
        with path.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        for name, entry in header.items():
            if name != "__metadata__":
                shapes[name] = list(entry["shape"])
    return shapes


def checkpoint_kind(model_dir: str | Path, cfg: dict[str, Any]) -> CheckpointKind:
    arch = architecture_of(cfg)
    family = next(f for f in FAMILIES if arch.startswith(f))
    head = _SUFFIXES[arch.removeprefix(family)]
    if head == "none":
        return CheckpointKind(arch, family, lm_head=False, num_labels=0)
    shapes = checkpoint_tensor_shapes(model_dir)
    if head == "lm":
        tied = bool(cfg.get("tie_word_embeddings", False))
        has_head = tied or any(n.endswith("lm_head.weight") for n in shapes)
        return CheckpointKind(arch, family, lm_head=has_head, num_labels=0)
    score = next((s for n, s in shapes.items() if n.removeprefix("model.") == "score.weight"), None)
    if score is None or len(score) != 2:
        raise ValueError(f"{arch} checkpoint in {model_dir} has no score.weight [labels, hidden]")
    return CheckpointKind(arch, family, lm_head=False, num_labels=int(score[0]))


def model_tasks(
    kind: CheckpointKind,
    cfg: dict[str, Any],
    model_dir: str | Path,
    pooling_type: str | None = None,
) -> ModelTasks:
    """The tasks the checkpoint serves and its pooling facts. ``pooling_type``: the engine flag
    (None when not given)."""
    if kind.num_labels:
        tasks = [PoolingTask.CLASSIFY.value]
        if kind.num_labels == 1:
            tasks.append(PoolingTask.SCORE.value)
        return ModelTasks(tuple(tasks), labels=_labels(cfg, kind.num_labels))
    hidden = int(cfg["hidden_size"])
    if pooling_type is not None:
        pooling = PoolingType(pooling_type.upper())
    else:
        pooling = sentence_transformers_pooling(model_dir) or PoolingType.LAST
    mds = _matryoshka_dimensions(cfg, hidden)
    tasks = ([GENERATE] if kind.lm_head else []) + [PoolingTask.EMBED.value]
    return ModelTasks(
        supported_tasks=tuple(tasks),
        embedding_size=hidden,
        pooling_type=pooling,
        is_matryoshka=bool(mds) or bool(cfg.get("is_matryoshka", False)),
        matryoshka_dimensions=mds,
    )


def sentence_transformers_pooling(model_dir: str | Path) -> PoolingType | None:
    """The pooling of the checkpoint's sentence-transformers Pooling module; None without one.
    Raises ``ValueError`` for a mode Tandem does not implement (max, weighted mean ...)."""
    modules_path = Path(model_dir) / "modules.json"
    if not modules_path.is_file():
        return None
    modules = json.loads(modules_path.read_text())
    entry = next((m for m in modules if m.get("type") == _ST_POOLING), None)
    if entry is None:
        return None
    config_path = Path(model_dir) / str(entry.get("path", "")) / "config.json"
    if not config_path.is_file():
        return None
    config = json.loads(config_path.read_text())
    modes = [k for k, v in config.items() if k.startswith("pooling_mode_") and v is True]
    if not modes:
        return None
    if modes[0] not in _ST_MODES:
        raise ValueError(
            f"{config_path}: {modes[0]} is not supported; supported: "
            f"{', '.join(_ST_MODES)} (or pass --pooling-type LAST, MEAN or CLS)"
        )
    return _ST_MODES[modes[0]]


def _matryoshka_dimensions(cfg: dict[str, Any], hidden: int) -> tuple[int, ...]:
    mds = cfg.get("matryoshka_dimensions") or []
    if not isinstance(mds, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and 1 <= d <= hidden for d in mds
    ):
        raise ValueError(
            f"config.json matryoshka_dimensions must be a list of integers in [1, {hidden}], "
            f"got {mds!r}"
        )
    return tuple(mds)


def _labels(cfg: dict[str, Any], num_labels: int) -> tuple[str, ...]:
    id2label = cfg.get("id2label") or {}
    try:
        names = {int(k): str(v) for k, v in id2label.items()}
    except (AttributeError, ValueError):
        names = {}
    return tuple(names.get(i, f"LABEL_{i}") for i in range(num_labels))
