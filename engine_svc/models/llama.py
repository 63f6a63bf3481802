"""Llama-family decoder (Llama 2/3, Qwen2, Qwen3) over the paged KV cache.

The three architectures differ only in small switches read from the Hugging Face config:

    Llama   optional attention/mlp bias, Llama-3 rope scaling, optional tied embeddings
    Qwen2   bias on q/k/v projections
    Qwen3   RMSNorm on each head of q and k before rotary (q_norm / k_norm)

The same module serves the family's base models (no head: embeddings only) and sequence
classifiers (``score``: hidden -> num_labels, no bias, on the final-norm state); see
``models/tasks.py``.

q/k/v and gate/up projections are fused into one matmul each; the loader splits checkpoint
tensors into the fused weights.

LoRA: with adapters served (``attach_lora``), each of the four linears of a layer holds its
slots of the stacked adapter weights, and a step's ``LoRAMapping`` (which slot each token uses,
built by the model runner) is passed down with the attention metadata; the adapters' deltas are
added to the linears' outputs (``engine_svc.lora.ops``). A step with no adapter token passes
None and runs exactly the base model. Sharded, each rank's slots hold the slice of the adapter
that goes with its shard (``lora.weights``), and o / down add their delta to the partial sum
before the all-reduce.

Tensor parallelism: built with a ``TPGroup`` of more than one rank, the model holds this rank's
shard (``models/parallel.py``: column-parallel q/k/v and gate/up, row-parallel o and down with
one all-reduce each, the vocabulary split over ranks) and loads only that slice of each
checkpoint tensor. Built with ``SINGLE`` (the default) it is the unsharded model, layer for
layer.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from engine_svc.distributed import SINGLE, TPGroup, all_reduce
from engine_svc.models.layers import PagedAttention, RMSNorm, RotaryEmbedding
from engine_svc.models.parallel import (
    CheckpointTensor,
    ShardPlan,
    read_cut,
    row_parallel_linear,
    vocab_embedding,
    vocab_lm_head,
)
from kernels import reference_norm_rope
from kernels.attention_backends import Kernels, TorchAttention
from kernels.attention_metadata import AttentionMetadata

if TYPE_CHECKING:
    from engine_svc.lora.ops import LoRAMapping
    from engine_svc.lora.weights import LoRALinearStack, LoRAWeights

KVCache = tuple[torch.Tensor, torch.Tensor]
CosSin = tuple[torch.Tensor, torch.Tensor]  # RotaryEmbedding.lookup: once per forward


@dataclass(frozen=True)
class RopeInputs:
    """What each layer's rotary embedding needs: the positions, and cos/sin looked up at them
    once per forward (None when the fused kernel reads the tables itself)."""

    positions: torch.Tensor
    cos_sin: CosSin | None


@dataclass(frozen=True)
class DecoderSpec:
    """The architecture facts the model needs, read once from config.json."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: dict[str, Any]
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], arch: str) -> DecoderSpec:
        """``arch``: any architecture of the Llama, Qwen2 or Qwen3 family (its prefix decides)."""
        family = next((f for f in ("Qwen2", "Qwen3", "Llama") if arch.startswith(f)), arch)
        num_heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        rope = dict(cfg.get("rope_parameters") or {})
        if not rope:
            rope = dict(cfg.get("rope_scaling") or {})
            rope.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
        rope.setdefault("rope_type", rope.get("type", "default"))
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {cfg.get('hidden_act')!r}; only silu")
        if cfg.get("use_sliding_window", False):
            raise ValueError("sliding-window attention is not supported")
        attention_bias = bool(cfg.get("attention_bias", False))
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or hidden // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope=rope,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=family == "Qwen2" or attention_bias,
            o_bias=family == "Llama" and attention_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=family == "Qwen3",
        )

    def shard_plan(self, tp: TPGroup) -> ShardPlan:
        """This rank's share of the model over ``tp`` (all of it for ``SINGLE``)."""
        return ShardPlan.build(
            tp,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.intermediate_size,
            self.vocab_size,
        )


class Attention(nn.Module):
    """``plan``: this rank's heads (None: all of them, one process)."""

    def __init__(
        self,
        spec: DecoderSpec,
        rotary: RotaryEmbedding,
        kernels: Kernels,
        plan: ShardPlan | None = None,
    ) -> None:
        super().__init__()
        plan = plan or spec.shard_plan(SINGLE)
        self.tp = plan.tp
        self.num_heads, self.num_kv_heads, self.head_dim = (
            plan.num_heads,
            plan.num_kv_heads,
            spec.head_dim,
        )
        self.q_size = self.num_heads * spec.head_dim
        self.kv_size = self.num_kv_heads * spec.head_dim
        self.qkv_proj = nn.Linear(spec.hidden_size, self.q_size + 2 * self.kv_size, spec.qkv_bias)
        self.o_proj = row_parallel_linear(self.q_size, spec.hidden_size, spec.o_bias, plan)
        norm = kernels.rms_norm
        self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, norm) if spec.qk_norm else None
        self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, norm) if spec.qk_norm else None
        self.rotary = rotary  # shared by every layer: one cos/sin table per model
        self.attn = PagedAttention(
            self.num_heads, self.num_kv_heads, spec.head_dim, kernels.attention
        )
        # q/k norm, rotary and the KV-cache write in one kernel (CUDA); None: torch ops.
        self._fused_prologue = kernels.qk_norm_rope_kv
        self.qkv_lora: LoRALinearStack | None = None  # set by attach_lora
        self.o_lora: LoRALinearStack | None = None

    def forward(
        self,
        rope: RopeInputs,
        x: torch.Tensor,
        kv: KVCache,
        meta: AttentionMetadata,
        lora: LoRAMapping | None = None,
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        if lora is not None and self.qkv_lora is not None:
            self.qkv_lora.apply(qkv, x, lora)
        if rope.cos_sin is None:
            out = self._fused(qkv, rope.positions, kv, meta)
        else:
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = q.view(t, self.num_heads, self.head_dim)
            k = k.view(t, self.num_kv_heads, self.head_dim)
            v = v.view(t, self.num_kv_heads, self.head_dim)
            if self.q_norm is not None and self.k_norm is not None:
                q, k = self.q_norm.norm(q), self.k_norm.norm(k)
            q, k = self.rotary.rotate(q, k, rope.cos_sin)
            out = self.attn(q, k, v, kv, meta)
        out = out.reshape(t, self.q_size)
        y = self.o_proj(out)
        if lora is not None and self.o_lora is not None:
            self.o_lora.apply(y, out, lora)
        return all_reduce(y, self.tp)  # row-parallel: the ranks' partial sums

    def _fused(
        self, qkv: torch.Tensor, positions: torch.Tensor, kv: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        """The prologue in one kernel (q/k norm, rotary, K/V into the cache), then attention."""
        assert self._fused_prologue is not None
        q_norm, k_norm = self.q_norm, self.k_norm
        q = self._fused_prologue(
            qkv,
            positions,
            self.rotary.cos,
            self.rotary.sin,
            None if q_norm is None else q_norm.weight,
            None if k_norm is None else k_norm.weight,
            q_norm.eps if q_norm is not None else 0.0,
            kv[0],
            kv[1],
            meta.slot_mapping,
            self.num_heads,
            self.num_kv_heads,
        )
        # k (rotated) and v as the prologue left them in qkv: what the cache now holds.
        t = qkv.shape[0]
        k, v = qkv[:, self.q_size :].split(self.kv_size, dim=-1)
        new_kv = (
            k.view(t, self.num_kv_heads, self.head_dim),
            v.view(t, self.num_kv_heads, self.head_dim),
        )
        return self.attn.attend(q, kv, meta, new_kv)


class MLP(nn.Module):
    """``plan``: this rank's share of the intermediate size (None: all of it, one process)."""

    def __init__(self, spec: DecoderSpec, kernels: Kernels, plan: ShardPlan | None = None) -> None:
        super().__init__()
        plan = plan or spec.shard_plan(SINGLE)
        self.tp = plan.tp
        inter = plan.intermediate_size
        self.gate_up_proj = nn.Linear(spec.hidden_size, 2 * inter, spec.mlp_bias)
        self.down_proj = row_parallel_linear(inter, spec.hidden_size, spec.mlp_bias, plan)
        self._silu_and_mul = kernels.silu_and_mul
        self.gate_up_lora: LoRALinearStack | None = None  # set by attach_lora
        self.down_lora: LoRALinearStack | None = None

    def forward(self, x: torch.Tensor, lora: LoRAMapping | None = None) -> torch.Tensor:
        # Over the projection's own output: no temporaries of [tokens, intermediate].
        # Row-parallel down_proj: the ranks' partial sums are all-reduced.
        if lora is None:
            return all_reduce(self.down_proj(self._silu_and_mul(self.gate_up_proj(x))), self.tp)
        gate_up = self.gate_up_proj(x)
        if self.gate_up_lora is not None:
            self.gate_up_lora.apply(gate_up, x, lora)
        h = self._silu_and_mul(gate_up)
        y = self.down_proj(h)
        if self.down_lora is not None:
            self.down_lora.apply(y, h, lora)
        return all_reduce(y, self.tp)


class DecoderLayer(nn.Module):
    def __init__(
        self, spec: DecoderSpec, rotary: RotaryEmbedding, kernels: Kernels, plan: ShardPlan
    ) -> None:
        super().__init__()
        self.self_attn = Attention(spec, rotary, kernels, plan)
        self.mlp = MLP(spec, kernels, plan)
        eps, norm, fused = spec.rms_norm_eps, kernels.rms_norm, kernels.fused_add_rms_norm
        self.input_layernorm = RMSNorm(spec.hidden_size, eps, norm, fused)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, eps, norm, fused)

    def forward(
        self,
        rope: RopeInputs,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        kv: KVCache,
        meta: AttentionMetadata,
        lora: LoRAMapping | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(rope, x, kv, meta, lora)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x, lora), residual


class LlamaForCausalLM(nn.Module):
    """Also serves Qwen2ForCausalLM and Qwen3ForCausalLM (see the module docstring), and their
    base models (``lm_head=False``) and sequence classifiers (``num_labels`` > 0: a ``score``
    head instead of ``lm_head``)."""

    # checkpoint name fragment -> (fused parameter fragment, shard index)
    _FUSED = {
        ".q_proj.": (".qkv_proj.", 0),
        ".k_proj.": (".qkv_proj.", 1),
        ".v_proj.": (".qkv_proj.", 2),
        ".gate_proj.": (".gate_up_proj.", 0),
        ".up_proj.": (".gate_up_proj.", 1),
    }

    def __init__(
        self,
        spec: DecoderSpec,
        max_positions: int,
        kernels: Kernels | None = None,
        lm_head: bool = True,
        num_labels: int = 0,
        tp: TPGroup = SINGLE,
    ) -> None:
        """``kernels``: the engine's choice (``select_kernels``); the torch references if None.
        ``lm_head``: build the language-model head; ``num_labels``: build a classifier head.
        ``tp``: the tensor-parallel group whose rank's shard this model holds."""
        super().__init__()
        kernels = kernels or Kernels(TorchAttention(), reference_norm_rope.rms_norm)
        self.spec = spec
        self.plan = spec.shard_plan(tp)
        self._fused_prologue = kernels.qk_norm_rope_kv is not None
        # Weights are uninitialised until load_weights (the loader builds this on the meta device):
        # an explicit empty weight skips nn.Embedding's normal_ init, whose first call on the meta
        # device imports torch._dynamo and sympy (~1.2 s, ~70 MB).
        self.embed_tokens = vocab_embedding(self.plan, spec.hidden_size)
        # One rotary table for all layers: per layer it cost num_layers x max_positions x
        # head_dim x 8 bytes (~1 GiB for Qwen3-0.6B at 40,960 positions).
        self.rotary_emb = RotaryEmbedding(spec.head_dim, max_positions, spec.rope)
        self.layers = nn.ModuleList(
            DecoderLayer(spec, self.rotary_emb, kernels, self.plan) for _ in range(spec.num_layers)
        )
        self.norm = RMSNorm(
            spec.hidden_size, spec.rms_norm_eps, kernels.rms_norm, kernels.fused_add_rms_norm
        )
        self.lm_head: nn.Linear | None = None
        if lm_head:
            self.lm_head = vocab_lm_head(self.plan, spec.hidden_size)
            if spec.tie_word_embeddings:
                self.lm_head.weight = self.embed_tokens.weight
        self.score: nn.Linear | None = None
        if num_labels:
            self.score = nn.Linear(spec.hidden_size, num_labels, bias=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
        lora: LoRAMapping | None = None,
    ) -> torch.Tensor:
        """Hidden states after the final norm, one row per scheduled token. ``lora``: which
        adapter slot each token uses (None: no token uses one)."""
        x = self.embed_tokens(input_ids)
        cos_sin = None if self._fused_prologue else self.rotary_emb.lookup(positions, x.dtype)
        rope = RopeInputs(positions, cos_sin)
        residual = None
        for layer, kv in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(rope, x, residual, kv, meta, lora)
        x, _ = self.norm(x, residual)
        return x

    def attach_lora(self, weights: LoRAWeights) -> None:
        """Give each adaptable linear its slots of the stacked LoRA weights (once, at start):
        sliced for this rank's shard (``LoRAWeights``' plan). Row-parallel o and down add the
        adapter's partial delta before their all-reduce (``Attention`` / ``MLP.forward``)."""
        plan = weights.plan or self.spec.shard_plan(SINGLE)  # None: the whole model's
        if plan != self.plan:
            raise ValueError(
                f"LoRA weights sliced for rank {plan.tp.rank} of {plan.tp.size}, the model is "
                f"rank {self.plan.tp.rank} of {self.plan.tp.size}"
            )
        for layer, stacks in zip(self.layers, weights.layers, strict=True):
            assert isinstance(layer, DecoderLayer)
            layer.self_attn.qkv_lora = stacks["qkv_proj"]
            layer.self_attn.o_lora = stacks["o_proj"]
            layer.mlp.gate_up_lora = stacks["gate_up_proj"]
            layer.mlp.down_lora = stacks["down_proj"]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        assert self.lm_head is not None, "this model has no language-model head"
        return self.lm_head(hidden)

    def classify(self, hidden: torch.Tensor) -> torch.Tensor:
        """The classifier head's logits, [rows, num_labels]."""
        assert self.score is not None, "this model has no classifier head"
        return self.score(hidden)

    def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> None:
        """Copy checkpoint tensors (Hugging Face names) into the fused parameters, casting each to
        the parameter's dtype on the copy. Every parameter must be provided: a missing tensor is
        an error, so none is left uninitialised (a tied lm_head is the embedding).

        A sharded model copies its rank's slice of each tensor; given ``TensorSlice``s
        (``loader.iter_safetensor_slices``) it reads only that slice from the file."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            key = self._load_one(params, name, tensor)
            del tensor  # hold one checkpoint tensor at a time
            if key is not None:
                loaded.add(key)
        missing = [n for n in self._expected_names() if n not in loaded]
        if missing:
            raise ValueError(f"checkpoint is missing tensors: {missing[:8]}")

    def _load_one(
        self, params: dict[str, nn.Parameter], name: str, tensor: CheckpointTensor
    ) -> str | None:
        """Copy one checkpoint tensor; its loaded key (``name#shard`` if fused), None if skipped."""
        name = name.removeprefix("model.")
        if "rotary_emb.inv_freq" in name:
            return None
        if name == "lm_head.weight" and (self.spec.tie_word_embeddings or self.lm_head is None):
            return None  # tied to the embedding, or not used (an embedding model)
        shard = None
        for frag, (fused, index) in self._FUSED.items():
            if frag in name:
                name, shard = name.replace(frag, fused), index
                break
        if name not in params:
            raise ValueError(f"unexpected checkpoint tensor {name!r}")
        param = params[name]
        label = name if shard is None else f"{name}[{shard}]"
        dst = param if shard is None else _shard_view(param, name, shard, self.plan)
        cut = self.plan.checkpoint_cut(name, shard)
        with torch.no_grad():
            if cut is None:
                _copy(dst, tensor if isinstance(tensor, torch.Tensor) else tensor[:], label)
            else:
                src = read_cut(tensor, cut, label)
                if src.shape[0] < dst.shape[0]:  # vocabulary padding: rows no token reaches
                    dst[src.shape[0] :].zero_()
                    dst = dst[: src.shape[0]]
                _copy(dst, src, label)
        return name if shard is None else f"{name}#{shard}"

    def _expected_names(self) -> list[str]:
        names = []
        for name, _ in self.named_parameters():
            if ".qkv_proj." in name:
                names += [f"{name}#{i}" for i in range(3)]
            elif ".gate_up_proj." in name:
                names += [f"{name}#{i}" for i in range(2)]
            else:
                names.append(name)
        return names


def _shard_view(param: torch.Tensor, name: str, shard: int, plan: ShardPlan) -> torch.Tensor:
    """Part ``shard`` of a fused parameter (this rank's sizes): q | k | v, or gate | up."""
    if ".qkv_proj." in name:
        q, kv = plan.num_heads * plan.head_dim, plan.num_kv_heads * plan.head_dim
        sizes = [q, kv, kv]
    else:
        sizes = [plan.intermediate_size, plan.intermediate_size]
    start = sum(sizes[:shard])
    return param.narrow(0, start, sizes[shard])


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(
            f"shape mismatch for {name}: model {tuple(dst.shape)}, checkpoint {tuple(src.shape)}"
        )
    dst.copy_(src)
