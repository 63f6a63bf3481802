"""Shared fixtures: tiny random-weight checkpoints built locally with transformers, and the
session's real engine process on the embedded default model (built once, in ``cache_dir``),
used by the integration, deployment and other-language tests alike."""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from pathlib import Path

from protos.grpc_runtime import prefer_polling_io

# The services' grpcio I/O (protos/grpc_runtime.py) for the servers and clients the tests run in
# this process too; grpc reads it when first imported, which is just below.
if (_late := prefer_polling_io()) is not None:
    warnings.warn(_late, stacklevel=1)
import grpc  # noqa: E402
import pytest  # noqa: E402

from tests.integration.harness import Engine, kill_all  # noqa: E402

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


# -- pooling models: embeddings, classifiers, cross-encoders ---------------------------------

_POOLING_FAMILIES = {"Llama": "LlamaConfig", "Qwen2": "Qwen2Config", "Qwen3": "Qwen3Config"}


def _build_tiny_pooling(out_dir: Path, arch: str, **overrides: object) -> Path:
    """A random-weight ``arch`` (any family architecture: *ForCausalLM, *Model,
    *ForSequenceClassification) in the shape of ``build_tiny_checkpoint``'s models, with a
    byte-level BPE tokenizer (``engine_svc.default_model.build_tokenizer``) beside it, so text
    prompts work offline and a gateway can fetch it over GetTokenizer."""
    import torch
    import transformers

    from engine_svc.default_model import build_tokenizer

    family = next(f for f in _POOLING_FAMILIES if arch.startswith(f))
    base: dict[str, object] = dict(
        vocab_size=384,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        max_position_embeddings=1024,
        eos_token_id=2,
        bos_token_id=None,
        pad_token_id=0,
        initializer_range=0.08,
    )
    if family == "Qwen2":
        base.pop("head_dim")
    base.update(overrides)
    config = getattr(transformers, _POOLING_FAMILIES[family])(**base)
    torch.manual_seed(4321)
    model = getattr(transformers, arch)(config).eval()
    model.save_pretrained(out_dir, safe_serialization=True)
    size = build_tokenizer(out_dir, vocab_size=int(base["vocab_size"]))  # type: ignore[call-overload]
    assert size <= int(base["vocab_size"])  # type: ignore[call-overload]
    return out_dir


def build_tiny_embedding_checkpoint(
    out_dir: Path,
    arch: str = "Qwen3ForCausalLM",
    pooling: str | None = "lasttoken",
    matryoshka_dimensions: list[int] | None = None,
    is_matryoshka: bool = False,
    **overrides: object,
) -> Path:
    """A tiny embedding model (Qwen3-Embedding style): ``arch`` with a sentence-transformers
    layout when ``pooling`` is set (modules.json -> 1_Pooling/config.json with
    ``pooling_mode_{pooling}`` true: "lasttoken", "mean_tokens" or "cls_token"; 2_Normalize),
    and the Matryoshka keys in config.json when given."""
    import json

    _build_tiny_pooling(out_dir, arch, **overrides)
    if pooling is not None:
        modes = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens", "lasttoken")
        pool_cfg = {"word_embedding_dimension": 64} | {
            f"pooling_mode_{m}": m == pooling for m in modes
        }
        (out_dir / "1_Pooling").mkdir()
        (out_dir / "1_Pooling" / "config.json").write_text(json.dumps(pool_cfg))
        modules = [
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {
                "idx": 1,
                "name": "1",
                "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling",
            },
            {
                "idx": 2,
                "name": "2",
                "path": "2_Normalize",
                "type": "sentence_transformers.models.Normalize",
            },
        ]
        (out_dir / "modules.json").write_text(json.dumps(modules))
    if matryoshka_dimensions is not None or is_matryoshka:
        cfg_path = out_dir / "config.json"
        cfg = json.loads(cfg_path.read_text())
        if matryoshka_dimensions is not None:
            cfg["matryoshka_dimensions"] = matryoshka_dimensions
        if is_matryoshka:
            cfg["is_matryoshka"] = True
        cfg_path.write_text(json.dumps(cfg, indent=2))
    return out_dir


def build_tiny_classifier_checkpoint(
    out_dir: Path,
    arch: str = "Qwen3ForSequenceClassification",
    num_labels: int = 1,
    labels: list[str] | None = None,
    **overrides: object,
) -> Path:
    """A tiny sequence classifier (``score`` head, no bias); with one label a cross-encoder
    (tasks classify and score). ``labels`` become config.json's id2label."""
    if labels is not None:
        assert len(labels) == num_labels
        overrides["id2label"] = dict(enumerate(labels))
    return _build_tiny_pooling(out_dir, arch, num_labels=num_labels, **overrides)


@pytest.fixture(scope="session")
def tiny_pooling_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny pooling checkpoints, each with a tokenizer:

    embed            Qwen3ForCausalLM + sentence-transformers LAST pooling and Normalize,
                     is_matryoshka (any dimensions 1..64); serves generate and embed
    embed_base       Qwen2Model (a base model: no lm_head, weights without "model."); embed only
    classify_llama   LlamaForSequenceClassification, 3 labels (LABEL_0..2)
    classify_qwen2   Qwen2ForSequenceClassification, 3 labels (LABEL_0..2)
    classify_qwen3   Qwen3ForSequenceClassification, labels negative / neutral / positive
    cross_encoder    Qwen3ForSequenceClassification, 1 label: classify and score
    """
    root = tmp_path_factory.mktemp("pooling_models")
    return {
        "embed": build_tiny_embedding_checkpoint(root / "embed", is_matryoshka=True),
        "embed_base": build_tiny_embedding_checkpoint(
            root / "embed_base", "Qwen2Model", pooling=None, hidden_size=96
        ),
        "classify_llama": build_tiny_classifier_checkpoint(
            root / "classify_llama", "LlamaForSequenceClassification", num_labels=3
        ),
        "classify_qwen2": build_tiny_classifier_checkpoint(
            root / "classify_qwen2", "Qwen2ForSequenceClassification", num_labels=3
        ),
        "classify_qwen3": build_tiny_classifier_checkpoint(
            root / "classify_qwen3",
            "Qwen3ForSequenceClassification",
            num_labels=3,
            labels=["negative", "neutral", "positive"],
        ),
        "cross_encoder": build_tiny_classifier_checkpoint(root / "cross_encoder", num_labels=1),
    }
