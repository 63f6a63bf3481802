"""Model FLOPs of a generation run, and torch's GEMM FLOP/s on the model's own matrix shapes.

Counting (the usual 2 x parameters x tokens, made exact for generation)::

    body      the matmul weights of the decoder layers, as the engine runs them
              (qkv_proj, o_proj, gate_up_proj, down_proj); norms and biases are not counted
    lm_head   vocab x hidden; with tied embeddings it is the embedding matrix, but the embedding
              lookup is a gather (0 FLOPs), so lm_head counts once, for the rows that produce
              logits only
    per request with prompt length p and output length o:
        body rows   p + o - 1     (every prompt token and every output token but the last, which
                                   is sampled and never fed back)
        logit rows  o             (the last prompt token, then each fed-back output token)
    FLOPs = 2 * body_params * body_rows + 2 * vocab * hidden * logit_rows

Attention's own products (QK^T and PV, which grow with the context) are not parameter FLOPs and
are left out; ``attention_flops`` gives them for reference. Only the work a request needs is
counted: a baseline that pads (static batching) does more, and gets no credit for it.

``gemm_flops_per_s`` runs one forward's worth of linear layers (every layer its own weights, so
the weights stream from memory as in the model) at a given number of token rows.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Linear:
    name: str
    in_features: int
    out_features: int

    @property
    def params(self) -> int:
        return self.in_features * self.out_features


def layer_linears(cfg: Mapping[str, Any]) -> list[Linear]:
    """One decoder layer's matmuls in the engine's fused layout (engine_svc/models/llama.py)."""
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    return [
        Linear("qkv_proj", hidden, (heads + 2 * kv_heads) * head_dim),
        Linear("o_proj", heads * head_dim, hidden),
        Linear("gate_up_proj", hidden, 2 * inter),
        Linear("down_proj", inter, hidden),
    ]


def body_linears(cfg: Mapping[str, Any]) -> list[Linear]:
    return layer_linears(cfg) * cfg["num_hidden_layers"]


def lm_head(cfg: Mapping[str, Any]) -> Linear:
    return Linear("lm_head", cfg["hidden_size"], cfg["vocab_size"])


@dataclass(frozen=True)
class RunFlops:
    """The model FLOPs of generating ``output_lens`` tokens after ``prompt_lens`` prompts."""

    body_params: int
    lm_head_params: int
    prompt_rows: int  # body rows of prompt tokens
    decode_rows: int  # body rows of fed-back output tokens
    logit_rows: int

    @property
    def prefill_flops(self) -> int:
        return 2 * self.body_params * self.prompt_rows

    @property
    def decode_flops(self) -> int:
        return 2 * self.body_params * self.decode_rows + 2 * self.lm_head_params * self.logit_rows

    @property
    def total(self) -> int:
        return self.prefill_flops + self.decode_flops


def run_flops(
    cfg: Mapping[str, Any], prompt_lens: Sequence[int], output_lens: Sequence[int]
) -> RunFlops:
    return RunFlops(
        body_params=sum(lin.params for lin in body_linears(cfg)),
        lm_head_params=lm_head(cfg).params,
        prompt_rows=sum(prompt_lens),
        decode_rows=sum(o - 1 for o in output_lens),
        logit_rows=sum(output_lens),
    )


def attention_flops(
    cfg: Mapping[str, Any], prompt_lens: Sequence[int], output_lens: Sequence[int]
) -> int:
    """QK^T and PV over the causal context of every body row (not counted in RunFlops)."""
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    # a row at position i (0-based) attends to i + 1 keys; rows are positions 0 .. p + o - 2
    keys = sum(
        (n := p + o - 1) * (n + 1) // 2 for p, o in zip(prompt_lens, output_lens, strict=True)
    )
    return 4 * heads * head_dim * keys * cfg["num_hidden_layers"]


def gemm_flops_per_s(
    linears: Sequence[Linear],
    num_tokens: int,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    min_seconds: float = 1.0,
    min_passes: int = 3,
) -> float:
    """torch's FLOP/s for ``F.linear`` of [num_tokens, in] rows through every one of ``linears``
    (each its own weight [out, in]) in turn: the median pass over at least ``min_passes`` passes
    and ``min_seconds``, after one warm-up pass."""
    gen = torch.Generator(device=device).manual_seed(0)
    weights = [
        torch.randn(lin.out_features, lin.in_features, generator=gen, device=device).to(dtype)
        for lin in linears
    ]
    inputs = {
        n: torch.randn(num_tokens, n, generator=gen, device=device).to(dtype)
        for n in {lin.in_features for lin in linears}
    }
    flops = 2 * num_tokens * sum(lin.params for lin in linears)

    def one_pass() -> float:
        start = time.perf_counter()
        for lin, w in zip(linears, weights, strict=True):
            F.linear(inputs[lin.in_features], w)
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    with torch.inference_mode():
        one_pass()
        times: list[float] = []
        while len(times) < min_passes or sum(times) < min_seconds:
            times.append(one_pass())
    return flops / statistics.median(times)


@dataclass(frozen=True)
class GemmRates:
    """GEMM FLOP/s at the two kinds of step a generation run is made of."""

    prefill_tokens: int  # rows of a prefill step (the engine's token budget)
    prefill_flops_per_s: float  # body matmuls at prefill_tokens rows
    decode_batch: int  # rows of a decode step
    decode_flops_per_s: float  # body matmuls and lm_head at decode_batch rows

    def bound_seconds(self, run: RunFlops) -> float:
        """Time torch's GEMMs would take for the run's FLOPs at these shapes, nothing else."""
        return (
            run.prefill_flops / self.prefill_flops_per_s
            + run.decode_flops / self.decode_flops_per_s
        )

    def effective_flops_per_s(self, run: RunFlops) -> float:
        return run.total / self.bound_seconds(run)


def measure_gemm_rates(
    cfg: Mapping[str, Any],
    prefill_tokens: int,
    decode_batch: int,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    min_seconds: float = 1.0,
) -> GemmRates:
    body = body_linears(cfg)
    return GemmRates(
        prefill_tokens=prefill_tokens,
        prefill_flops_per_s=gemm_flops_per_s(body, prefill_tokens, dtype, device, min_seconds),
        decode_batch=decode_batch,
        decode_flops_per_s=gemm_flops_per_s(
            [*body, lm_head(cfg)], decode_batch, dtype, device, min_seconds
        ),
    )


def median_rates(samples: Sequence[GemmRates]) -> GemmRates:
    """The median of several measurements of the same shapes (taken between a run's parts)."""
    return GemmRates(
        prefill_tokens=samples[0].prefill_tokens,
        prefill_flops_per_s=statistics.median(s.prefill_flops_per_s for s in samples),
        decode_batch=samples[0].decode_batch,
        decode_flops_per_s=statistics.median(s.decode_flops_per_s for s in samples),
    )
