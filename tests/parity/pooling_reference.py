"""What the pooling parity tests share: the prompts they draw, the float32 tolerance, and
transformers' side of a pooled vector (a prompt's last hidden states, pooled LAST / MEAN / CLS
and L2-normalized as Tandem's pooler does)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import TypedDict

import numpy as np
import torch


class Tolerance(TypedDict):
    rtol: float
    atol: float


TOL = Tolerance(rtol=1e-4, atol=2e-5)  # float32 through two different implementations


def random_prompts(lengths: list[int], seed: int = 0, vocab: int = 384) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab) for _ in range(n)] for n in lengths]


def token_prompts(prompts: list[list[int]]) -> list[dict[str, list[int]]]:
    return [{"prompt_token_ids": p} for p in prompts]


def last_hidden_state(decoder: torch.nn.Module, prompt: Sequence[int]) -> torch.Tensor:
    """``decoder``'s last_hidden_state of one unpadded prompt, [len, hidden]. ``decoder`` is a
    transformers base model: an ``AutoModel``, or the ``.model`` inside a ``*ForCausalLM``
    (with PEFT's LoRA layers in it, the active adapter applies)."""
    ids = torch.tensor([list(prompt)])
    with torch.inference_mode():
        states: torch.Tensor = decoder(ids, attention_mask=torch.ones_like(ids)).last_hidden_state
    return states[0]


def pool_states(states: torch.Tensor, pooling: str) -> torch.Tensor:
    return {"LAST": states[-1], "MEAN": states.mean(0), "CLS": states[0]}[pooling]


def embedding(states: torch.Tensor, pooling: str, normalize: bool = True) -> np.ndarray:
    """The vector Tandem's ``embed`` returns for a prompt with these hidden states."""
    vec = pool_states(states, pooling)
    return (torch.nn.functional.normalize(vec, dim=-1) if normalize else vec).numpy()
