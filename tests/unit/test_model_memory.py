"""Memory the model keeps besides its weights: one rotary cos/sin table per model, not per layer."""

from __future__ import annotations

import torch

from engine_svc.models.llama import DecoderSpec, LlamaForCausalLM

# Qwen3-0.6B's shape (28 layers, head_dim 128, 40,960 positions), built on the meta device.
QWEN3_0_6B = {
    "architectures": ["Qwen3ForCausalLM"],
    "vocab_size": 151936,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 40960,
    "tie_word_embeddings": True,
}


def test_one_rotary_table_for_all_layers() -> None:
    spec = DecoderSpec.from_hf_config(QWEN3_0_6B, "Qwen3ForCausalLM")
    with torch.device("meta"):
        model = LlamaForCausalLM(spec, spec.max_position_embeddings)
    tables = [b for n, b in model.named_buffers(remove_duplicate=False) if n.endswith(".cos")]
    assert len(tables) == spec.num_layers + 1  # the model and every layer reach a table ...
    assert len({id(t) for t in tables}) == 1  # ... and it is the same one
    buffer_bytes = sum(b.nbytes for b in model.buffers())  # distinct buffers only
    one_table = 2 * spec.max_position_embeddings * spec.head_dim * 4  # cos + sin, float32
    assert buffer_bytes == one_table  # 42 MB; one table per layer was 28x that (1.2 GB)
