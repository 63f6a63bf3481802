"""Shared fixtures: tiny random-weight checkpoints built locally with transformers, and the
session's real engine process on the embedded default model (built once, in ``cache_dir``),
used by the integration, deployment and other-language tests alike."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from tests.integration.harness import Engine, kill_all

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def build_tiny_checkpoint(out_dir: Path, arch: str, **overrides: object) -> Path:
    """Save a random-weight model of ``arch`` (deterministic) and return its directory."""
    import torch
    import transformers

    base: dict[str, object] = dict(
        vocab_size=384,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,  # != hidden / heads: exercises the separate head_dim
        max_position_embeddings=1024,
        eos_token_id=3,
        bos_token_id=1,
        pad_token_id=0,
        initializer_range=0.08,
    )
    if arch == "LlamaForCausalLM":
        cfg_cls = transformers.LlamaConfig
    elif arch == "Qwen2ForCausalLM":
        cfg_cls = transformers.Qwen2Config
        base.pop("head_dim")  # Qwen2 derives head_dim from hidden / heads
    elif arch == "Qwen3ForCausalLM":
        cfg_cls = transformers.Qwen3Config
    else:
        raise ValueError(arch)
    base.update(overrides)
    config = cfg_cls(**base)
    torch.manual_seed(1234)
    model = getattr(transformers, arch)(config).eval()
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {
        "llama": build_tiny_checkpoint(root / "llama", "LlamaForCausalLM"),
        "llama3_tied": build_tiny_checkpoint(
            root / "llama3_tied",
            "LlamaForCausalLM",
            tie_word_embeddings=True,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
        "qwen2": build_tiny_checkpoint(root / "qwen2", "Qwen2ForCausalLM", hidden_size=96),
        "qwen3": build_tiny_checkpoint(root / "qwen3", "Qwen3ForCausalLM"),
    }


# -- real processes ----------------------------------------------------------------------------

SESSION_ENGINE_FLAGS = ("--max-num-seqs", "16", "--kv-cache-memory", "64MiB")


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """TANDEM_CACHE_DIR shared by this process and every child; the model is built once here."""
    path = tmp_path_factory.mktemp("tandem_cache")
    old = os.environ.get("TANDEM_CACHE_DIR")
    os.environ["TANDEM_CACHE_DIR"] = str(path)
    from engine_svc.default_model import ensure_default_model

    ensure_default_model()
    yield path
    if old is None:
        os.environ.pop("TANDEM_CACHE_DIR", None)
    else:
        os.environ["TANDEM_CACHE_DIR"] = old


@pytest.fixture(scope="session")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="session", autouse=True)
def _no_leftover_processes() -> Iterator[None]:
    yield
    kill_all()


@pytest.fixture(scope="session")
def engine(cache_dir: Path, log_dir: Path) -> Iterator[Engine]:
    e = Engine(cache_dir, log_dir, *SESSION_ENGINE_FLAGS)
    try:
        yield e.wait_ready()
    finally:
        e.stop()


@pytest.fixture()
def channel(engine: Engine) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(engine.address) as ch:
        yield ch
