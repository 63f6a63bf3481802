"""Read and check a PEFT LoRA adapter directory: ``adapter_config.json`` plus
``adapter_model.safetensors`` (or ``adapter_model.bin``, read with ``weights_only=True``).

What is served: LoRA (not DoRA) on the attention projections q/k/v/o and the MLP projections
gate/up/down of the decoder layers, without bias, ``modules_to_save`` or embedding adapters, each
module's rank at most ``--max-lora-rank``. Anything else is refused with a ``LoRAInvalidError``
that names the file and the key at fault, never half-loaded. Tensors are named as PEFT saves
them::

    base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight    [r, in_features]
    base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight    [out_features, r]

Each module's scaling is ``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with ``use_rslora``,
with ``rank_pattern`` / ``alpha_pattern`` overrides matched as PEFT matches them; the delta of a
module is ``scaling * x @ A.T @ B.T`` (``LoRAWeights`` folds the scaling into B on the device).

Reading computes nothing with torch (the tensors stay as the file holds them; the finiteness
check runs in numpy), so it may run on any thread without giving that thread an OpenMP pool of
its own (see loop/engine_loop.py: all the engine's torch work stays on the loop thread).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from engine_svc.lora.errors import LoRAInvalidError, LoRAPathNotFoundError

if TYPE_CHECKING:
    from engine_svc.models.llama import DecoderSpec

CONFIG_FILE = "adapter_config.json"
SAFETENSORS_FILE = "adapter_model.safetensors"
BIN_FILE = "adapter_model.bin"

# target module -> the decoder-layer block it lives in
TARGETS: dict[str, str] = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}
_ALL_LINEAR = "all-linear"  # PEFT's shorthand: every linear layer but the output head

_KEY = re.compile(
    r"^(?:base_model\.model\.)?(?P<module>model\.layers\.(?P<layer>\d+)\.(?P<block>\w+)\."
    r"(?P<target>\w+))\.lora_(?P<ab>[AB])(?:\.(?P<adapter>[\w-]+))?\.weight$"
)


@dataclass(frozen=True)
class ModelDims:
    """The shapes an adapter must match: layers, and (in, out) features of each target."""

    num_layers: int
    features: dict[str, tuple[int, int]]

    @classmethod
    def from_spec(cls, spec: DecoderSpec) -> ModelDims:
        return cls.of(
            spec.num_layers,
            spec.hidden_size,
            spec.intermediate_size,
            spec.num_heads,
            spec.num_kv_heads,
            spec.head_dim,
        )

    @classmethod
    def of(
        cls,
        num_layers: int,
        hidden_size: int,
        intermediate_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
    ) -> ModelDims:
        q, kv = num_heads * head_dim, num_kv_heads * head_dim
        return cls(
            num_layers,
            {
                "q_proj": (hidden_size, q),
                "k_proj": (hidden_size, kv),
                "v_proj": (hidden_size, kv),
                "o_proj": (q, hidden_size),
                "gate_proj": (hidden_size, intermediate_size),
                "up_proj": (hidden_size, intermediate_size),
                "down_proj": (intermediate_size, hidden_size),
            },
        )


@dataclass(frozen=True)
class LoRAModule:
    """One adapted linear: delta = scaling * x @ a.T @ b.T (the file's tensors and dtype)."""

    a: torch.Tensor  # [rank, in_features]
    b: torch.Tensor  # [out_features, rank]
    scaling: float

    @property
    def rank(self) -> int:
        return int(self.a.shape[0])


@dataclass(frozen=True)
class LoRAAdapter:
    """An adapter's weights in host memory, checked against the model."""

    path: str
    rank: int  # the config's ``r``
    targets: tuple[str, ...]  # the targets it has weights for, in TARGETS order
    modules: dict[tuple[int, str], LoRAModule]  # (layer, target) -> weights

    @property
    def nbytes(self) -> int:
        return sum(
            m.a.numel() * m.a.element_size() + m.b.numel() * m.b.element_size()
            for m in self.modules.values()
        )


def load_adapter(path: str | Path, dims: ModelDims, max_rank: int) -> LoRAAdapter:
    """Read the PEFT adapter in directory ``path`` into host memory (thread-safe).

    Raises LoRAInvalidError naming the file (and key) for anything that cannot be served."""
    directory = Path(path)
    if not directory.exists():
        raise LoRAPathNotFoundError(f"{directory}: no such adapter directory")
    if not directory.is_dir():
        raise LoRAInvalidError(f"{directory}: not a directory (a PEFT adapter is a directory)")
    config = _read_config(directory / CONFIG_FILE, max_rank)
    weights_file, tensors = _read_tensors(directory)
    modules = _modules(weights_file, tensors, config, dims, max_rank)
    targets = tuple(t for t in TARGETS if any(t == tt for _, tt in modules))
    return LoRAAdapter(str(directory), config.r, targets, modules)


# ---------------------------------------------------------------------- adapter_config.json
@dataclass(frozen=True)
class _Config:
    file: Path
    r: int
    alpha: float
    rslora: bool
    target_modules: list[str] | str
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, float]


def _read_config(file: Path, max_rank: int) -> _Config:
    if not file.is_file():
        raise LoRAInvalidError(f"{file}: missing (a PEFT adapter directory needs {CONFIG_FILE})")
    try:
        raw = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoRAInvalidError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise LoRAInvalidError(f"{file}: expected a JSON object")

    def bad(key: str, why: str) -> LoRAInvalidError:
        return LoRAInvalidError(f"{file}: {key} {why}")

    peft_type = raw.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise bad("peft_type", f"is {peft_type!r}; only LORA adapters are served")
    r = raw.get("r", 8)
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise bad("r", f"must be a positive integer, got {r!r}")
    if r > max_rank:
        raise bad("r", f"= {r} exceeds --max-lora-rank {max_rank}")
    alpha = raw.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise bad("lora_alpha", f"must be a number, got {alpha!r}")
    if raw.get("bias", "none") != "none":
        raise bad("bias", f"is {raw.get('bias')!r}; only 'none' is served (no LoRA bias)")
    if raw.get("lora_bias"):
        raise bad("lora_bias", "is set; LoRA bias is not served")
    if raw.get("modules_to_save"):
        saved = raw["modules_to_save"]
        raise bad("modules_to_save", f"is {saved!r}; fully trained modules are not served")
    if raw.get("use_dora"):
        raise bad("use_dora", "is set; DoRA adapters are not served")
    if raw.get("fan_in_fan_out"):
        raise bad("fan_in_fan_out", "is set; only nn.Linear-style (out, in) weights are served")
    if raw.get("layer_replication"):
        raise bad("layer_replication", "is set; not served")
    if raw.get("target_parameters"):
        raise bad("target_parameters", "is set; only target_modules are served")
    if raw.get("trainable_token_indices"):
        raise bad("trainable_token_indices", "is set; trained token embeddings are not served")
    if raw.get("alora_invocation_tokens"):
        raise bad("alora_invocation_tokens", "is set; activated LoRA (aLoRA) is not served")
    targets = raw.get("target_modules")
    if isinstance(targets, list):
        for t in targets:
            if not isinstance(t, str):
                raise bad("target_modules", f"must list module names, got {t!r}")
            short = t.rsplit(".", 1)[-1]
            if short not in TARGETS and t != _ALL_LINEAR:
                raise bad(
                    "target_modules",
                    f"names {t!r}, which is not a served module (served: {', '.join(TARGETS)})",
                )
    elif targets is not None and not isinstance(targets, str):
        raise bad("target_modules", f"must be a list or a regular expression, got {targets!r}")
    rank_pattern = _pattern(raw, "rank_pattern", file)
    for key, value in rank_pattern.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise bad("rank_pattern", f"{key!r}: rank must be a positive integer, got {value!r}")
        if value > max_rank:
            raise bad("rank_pattern", f"{key!r}: rank {value} exceeds --max-lora-rank {max_rank}")
    alpha_pattern = _pattern(raw, "alpha_pattern", file)
    for key, value in alpha_pattern.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise bad("alpha_pattern", f"{key!r}: alpha must be a number, got {value!r}")
    return _Config(
        file,
        r,
        float(alpha),
        bool(raw.get("use_rslora", False)),
        targets if targets is not None else [],
        rank_pattern,
        {k: float(v) for k, v in alpha_pattern.items()},
    )


def _pattern(raw: dict[str, Any], key: str, file: Path) -> dict[str, Any]:
    value = raw.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise LoRAInvalidError(f"{file}: {key} must be an object, got {value!r}")
    return value


def _pattern_value(pattern: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's rule (``get_pattern_key``): the first key that matches the end of the module's
    dotted name (at a dot boundary) gives the value."""
    for key, value in pattern.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


# ---------------------------------------------------------------------- the weights file
def _read_tensors(directory: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    st, binary = directory / SAFETENSORS_FILE, directory / BIN_FILE
    if st.is_file():
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return st, load_file(str(st), device="cpu")
        except (SafetensorError, OSError, ValueError) as e:
            raise LoRAInvalidError(f"{st}: cannot be read as safetensors ({e})") from None
    if binary.is_file():
        try:
            loaded = torch.load(str(binary), map_location="cpu", weights_only=True)
        except Exception as e:  # torch raises many kinds for a bad or unsafe pickle
            raise LoRAInvalidError(
                f"{binary}: cannot be read with torch.load(weights_only=True) ({e})"
            ) from None
        if not isinstance(loaded, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in loaded.items()
        ):
            raise LoRAInvalidError(f"{binary}: expected a dict of tensor names to tensors")
        return binary, loaded
    raise LoRAInvalidError(
        f"{st}: missing (a PEFT adapter directory needs {SAFETENSORS_FILE} or {BIN_FILE})"
    )


def _modules(
    file: Path,
    tensors: dict[str, torch.Tensor],
    config: _Config,
    dims: ModelDims,
    max_rank: int,
) -> dict[tuple[int, str], LoRAModule]:
    pairs: dict[tuple[int, str], dict[str, tuple[str, torch.Tensor]]] = {}
    names: dict[tuple[int, str], str] = {}
    for key, tensor in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise LoRAInvalidError(f"{file}: tensor {key!r} is not served ({_why(key)})")
        target, layer = m["target"], int(m["layer"])
        if TARGETS.get(target) != m["block"]:
            raise LoRAInvalidError(
                f"{file}: tensor {key!r} adapts {m['block']}.{target}, which the model does not "
                f"have (served: {', '.join(f'{b}.{t}' for t, b in TARGETS.items())})"
            )
        if layer >= dims.num_layers:
            raise LoRAInvalidError(
                f"{file}: tensor {key!r} is for layer {layer}; the model has {dims.num_layers}"
            )
        side = pairs.setdefault((layer, target), {})
        if m["ab"] in side:
            raise LoRAInvalidError(f"{file}: tensor {key!r} repeats {side[m['ab']][0]!r}")
        side[m["ab"]] = (key, tensor)
        names[(layer, target)] = m["module"]
    if not pairs:
        raise LoRAInvalidError(f"{file}: holds no LoRA weights")

    modules = {}
    for (layer, target), side in sorted(pairs.items()):
        for ab, other in (("A", "B"), ("B", "A")):
            if ab not in side:
                raise LoRAInvalidError(
                    f"{file}: tensor {side[other][0]!r} has no lora_{ab} partner"
                )
        (a_key, a), (b_key, b) = side["A"], side["B"]
        in_f, out_f = dims.features[target]
        for key, t in ((a_key, a), (b_key, b)):
            if t.ndim != 2 or t.dtype not in _FLOATS:
                raise LoRAInvalidError(
                    f"{file}: tensor {key!r} must be a 2-D floating-point matrix (float32, "
                    f"bfloat16, float16), got {tuple(t.shape)} {t.dtype}"
                )
        rank = a.shape[0]
        if tuple(a.shape) != (rank, in_f):
            raise LoRAInvalidError(
                f"{file}: tensor {a_key!r} has shape {tuple(a.shape)}; the model's {target} "
                f"needs [rank, {in_f}]"
            )
        if tuple(b.shape) != (out_f, rank):
            raise LoRAInvalidError(
                f"{file}: tensor {b_key!r} has shape {tuple(b.shape)}; with lora_A's rank "
                f"{rank} the model's {target} needs [{out_f}, {rank}]"
            )
        if rank > max_rank:
            raise LoRAInvalidError(
                f"{file}: tensor {a_key!r} has rank {rank}, above --max-lora-rank {max_rank}"
            )
        module = names[(layer, target)]
        expected = _pattern_value(config.rank_pattern, module, config.r)
        if rank != expected:
            raise LoRAInvalidError(
                f"{file}: tensor {a_key!r} has rank {rank}; {config.file.name} says {expected}"
            )
        alpha = _pattern_value(config.alpha_pattern, module, config.alpha)
        scaling = alpha / math.sqrt(rank) if config.rslora else alpha / rank
        for key, t in ((a_key, a), (b_key, b)):
            if not _finite(t):
                raise LoRAInvalidError(f"{file}: tensor {key!r} holds NaN or infinite values")
        modules[(layer, target)] = LoRAModule(a, b, float(scaling))
    return modules


_FLOATS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
# exponent bits of the 16-bit float formats: all ones means inf or NaN
_EXPONENT_16 = {torch.bfloat16: 0x7F80, torch.float16: 0x7C00}


def _finite(t: torch.Tensor) -> bool:
    """No inf or NaN in ``t``, checked with numpy (no torch kernel runs on this thread)."""
    mask = _EXPONENT_16.get(t.dtype)
    if mask is None:
        return bool(np.isfinite(t.numpy()).all())
    bits = t.view(torch.int16).numpy()  # a reinterpretation, not a kernel
    return not bool(np.any((bits & mask) == mask))


def _why(key: str) -> str:
    if "lora_embedding" in key or "embed_tokens" in key:
        return "embedding adapters are not served"
    if "lm_head" in key:
        return "the output head is not adapted"
    if "modules_to_save" in key:
        return "fully trained modules are not served"
    if key.endswith(".bias"):
        return "LoRA bias is not served"
    if "lora_magnitude_vector" in key:
        return "DoRA adapters are not served"
    return (
        "expected base_model.model.model.layers.N.{self_attn|mlp}.<module>.lora_{A|B}.weight "
        f"with <module> one of {', '.join(TARGETS)}"
    )
