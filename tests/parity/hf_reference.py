"""transformers' own greedy generation, the ground truth for parity tests."""

from __future__ import annotations

from pathlib import Path

import torch


def load_hf(model_dir: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()


@torch.inference_mode()
def hf_greedy(
    model: torch.nn.Module, prompt: list[int], max_new_tokens: int, stop_at_eos: bool
) -> list[int]:
    """One prompt at a time (no padding) with an explicit all-ones attention mask: transformers
    otherwise infers a mask from pad_token_id and hides prompt tokens equal to it."""
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=model.config.eos_token_id if stop_at_eos else None,
        pad_token_id=model.config.pad_token_id,
    )
    tokens: list[int] = out[0, len(prompt) :].tolist()
    return tokens


@torch.inference_mode()
def hf_logits(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    """Logits for every position of one sequence, [len, vocab], float32."""
    ids = torch.tensor([tokens])
    return model(ids, attention_mask=torch.ones_like(ids)).logits[0].float()
