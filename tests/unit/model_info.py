"""A ``ModelInfo`` for CPU tests of the request checks: no model is loaded."""

from __future__ import annotations

from engine_svc.core.model_info import ModelInfo


def model_info(max_model_len: int = 2048, vocab_size: int = 1 << 20) -> ModelInfo:
    return ModelInfo.of(
        served_model_name="test",
        max_model_len=max_model_len,
        vocab_size=vocab_size,
        eos_token_ids=(2,),
        bos_token_id=None,
        block_size=4,
        num_kv_blocks=max_model_len // 4,
        max_logprobs=20,
        enable_prefix_caching=True,
        kv_cache_dtype="float32",
    )
