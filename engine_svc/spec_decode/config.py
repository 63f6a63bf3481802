"""The speculative config (vLLM's ``--speculative-config`` JSON, ``LLM(speculative_config=...)``):
which proposer, and how many tokens it proposes per step.

    {"method": "ngram", "num_speculative_tokens": k,
     "prompt_lookup_min": a, "prompt_lookup_max": b}       -> NgramConfig   (ngram.py)
    {"model": PATH, "num_speculative_tokens": k}             -> DraftModelConfig (draft_model.py)
    {"method": "draft_model", "model": PATH, "num_speculative_tokens": k}   (the same)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class NgramConfig:
    """``num_speculative_tokens`` (k), ``prompt_lookup_min`` and ``prompt_lookup_max`` of vLLM's
    speculative config."""

    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4

    def __post_init__(self) -> None:
        _check_k(self.num_speculative_tokens)
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                "prompt_lookup_min and prompt_lookup_max must satisfy 1 <= min <= max, got "
                f"{self.prompt_lookup_min} and {self.prompt_lookup_max}"
            )


@dataclass(frozen=True)
class DraftModelConfig:
    """A small model with the target's vocabulary proposes ``num_speculative_tokens`` tokens
    per step (vLLM's ``"model"`` key, method ``"draft_model"``). ``model``: its checkpoint
    directory; it runs on the target's device, in the target's dtype."""

    model: str
    num_speculative_tokens: int

    def __post_init__(self) -> None:
        _check_k(self.num_speculative_tokens)
        if not self.model:
            raise ValueError("the draft model's path must not be empty")


SpeculativeConfig = NgramConfig | DraftModelConfig


def _check_k(k: int) -> None:
    if k < 1:
        raise ValueError(f"num_speculative_tokens must be at least 1, got {k}")


def parse_speculative_config(text: str) -> SpeculativeConfig:
    """``--speculative-config`` (vLLM's JSON, see the module docstring). ValueError names what
    is wrong. n-gram: only one of the lookup bounds given, the other takes its value (as vLLM
    does); neither: 1..4. A ``"model"`` without a method is a draft model, as vLLM reads it."""
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--speculative-config is not JSON: {e}") from None
    if not isinstance(spec, dict):
        raise ValueError("--speculative-config must be a JSON object")
    method = spec.pop("method", None)
    if method is None and "model" in spec:
        method = "draft_model"
    if method not in ("ngram", "draft_model"):
        raise ValueError(
            f"--speculative-config method {method!r} is not supported; this engine has "
            '"ngram" and "draft_model" (a "model" path)'
        )
    k = spec.pop("num_speculative_tokens", None)
    if method == "draft_model":
        model = spec.pop("model", None)
        num = _int_k(spec, k)
        if not isinstance(model, str) or not model:
            raise ValueError('--speculative-config: a draft model needs "model" (a path)')
        return DraftModelConfig(model, num)
    lo, hi = spec.pop("prompt_lookup_min", None), spec.pop("prompt_lookup_max", None)
    num = _int_k(spec, k)
    for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool)):
            raise ValueError(f"--speculative-config: {name} must be an integer")
    if lo is None and hi is None:
        lo, hi = 1, 4
    lo, hi = (hi if lo is None else lo), (lo if hi is None else hi)
    return NgramConfig(num, lo, hi)


def _int_k(rest: dict[str, Any], k: object) -> int:
    """``num_speculative_tokens``, when no key is left over and it is an integer."""
    if rest:
        raise ValueError(f"--speculative-config: unknown keys {sorted(rest)}")
    if not isinstance(k, int) or isinstance(k, bool):
        raise ValueError("--speculative-config needs num_speculative_tokens (an integer)")
    return k
