"""Pooling parameters against the model's facts, and what a checkpoint serves (no torch: the
checkpoints here are config files plus safetensors headers)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from engine_svc.config import ModelConfig
from engine_svc.core.pooling_params import ModelTasks, PoolingParams, PoolingType
from engine_svc.models.tasks import (
    SUPPORTED_ARCHITECTURES,
    checkpoint_kind,
    model_tasks,
    sentence_transformers_pooling,
)
from protos.types import PoolingTask

EMBED = ModelTasks(("generate", "embed"), 64, PoolingType.LAST, is_matryoshka=True)
LISTED = ModelTasks(("embed",), 64, PoolingType.MEAN, True, (16, 32, 64))
PLAIN = ModelTasks(("generate", "embed"), 64, PoolingType.CLS)
RERANK = ModelTasks(("classify", "score"), labels=("LABEL_0",))


# ---------------------------------------------------------------------------------- params
def test_defaults_are_filled_in() -> None:
    p = EMBED.check(PoolingParams(PoolingTask.EMBED))
    assert (p.normalize, p.activation, p.dimensions, p.pooling_type) == (
        True,
        None,
        None,
        PoolingType.LAST,
    )
    assert not p.skips_prefix_cache
    assert PLAIN.check(PoolingParams("embed", normalize=False)).normalize is False
    assert PLAIN.check(PoolingParams("embed")).skips_prefix_cache  # CLS reads position 0
    c = RERANK.check(PoolingParams("score"))
    assert (c.activation, c.pooling_type, c.skips_prefix_cache) == (True, PoolingType.LAST, False)
    assert RERANK.check(PoolingParams("classify", activation=False)).activation is False


@pytest.mark.parametrize(
    ("tasks", "params", "message"),
    [
        (EMBED, PoolingParams(), "task must be set; this model serves: generate, embed"),
        (
            EMBED,
            PoolingParams("classify"),
            "task 'classify' is not served by this model; it serves: generate, embed",
        ),
        (RERANK, PoolingParams("embed"), "task .embed. is not served .*it serves: classify, score"),
        (EMBED, PoolingParams("embed", dimensions=0), r"dimensions must be in \[1, 64\], got 0"),
        (EMBED, PoolingParams("embed", dimensions=65), r"dimensions must be in \[1, 64\], got 65"),
        (
            PLAIN,
            PoolingParams("embed", dimensions=32),
            "dimensions is not supported: this model does not declare Matryoshka",
        ),
        (
            LISTED,
            PoolingParams("embed", dimensions=20),
            r"dimensions must be one of the model's Matryoshka dimensions \[16, 32, 64\], got 20",
        ),
        (EMBED, PoolingParams("embed", activation=True), "activation applies to classify and"),
        (RERANK, PoolingParams("score", normalize=True), "normalize applies to embed only"),
        (RERANK, PoolingParams("classify", dimensions=1), "dimensions applies to embed only"),
    ],
)
def test_bad_params_name_the_parameter(
    tasks: ModelTasks, params: PoolingParams, message: str
) -> None:
    with pytest.raises(ValueError, match=f"pooling_params.{message}"):
        tasks.check(params)


def test_listed_matryoshka_dimensions_are_accepted() -> None:
    assert LISTED.check(PoolingParams("embed", dimensions=32)).dimensions == 32
    assert EMBED.check(PoolingParams("embed", dimensions=7)).dimensions == 7  # any, unlisted


def test_params_reject_wrong_types_and_unknown_tasks() -> None:
    with pytest.raises(ValueError, match="pooling_params.task must be one of"):
        PoolingParams("rerank")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="pooling_params.dimensions must be an integer"):
        PoolingParams("embed", dimensions=True)
    with pytest.raises(ValueError, match="pooling_params.normalize must be a boolean"):
        PoolingParams("embed", normalize=1)  # type: ignore[arg-type]


def test_generation_needs_a_language_model_head() -> None:
    EMBED.check_generate()
    with pytest.raises(ValueError, match=r"does not generate text \(it serves: classify, score\)"):
        RERANK.check_generate()


def test_pooling_type_flag_is_validated() -> None:
    assert ModelConfig("m", pooling_type="MEAN").pooling_type == "MEAN"
    with pytest.raises(ValueError, match="pooling_type must be one of LAST, MEAN, CLS"):
        ModelConfig("m", pooling_type="MAX")


# ---------------------------------------------------------------------------------- checkpoints
def _checkpoint(
    path: Path, arch: str, tensors: dict[str, list[int]], **cfg: object
) -> tuple[Path, dict[str, object]]:
    """config.json plus a safetensors file holding only a header (shapes are all we read)."""
    path.mkdir(parents=True)
    config: dict[str, object] = {"architectures": [arch], "hidden_size": 64, **cfg}
    (path / "config.json").write_text(json.dumps(config))
    header = {n: {"dtype": "F32", "shape": s, "data_offsets": [0, 0]} for n, s in tensors.items()}
    raw = json.dumps(header).encode()
    (path / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw)
    return path, config


def _st_pooling(path: Path, mode: str) -> None:
    modules = [{"type": "sentence_transformers.models.Pooling", "path": "1_Pooling"}]
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(
        json.dumps({"pooling_mode_cls_token": False, f"pooling_mode_{mode}": True})
    )


def test_architectures_and_their_tasks(tmp_path: Path) -> None:
    assert len(SUPPORTED_ARCHITECTURES) == 9
    cases = {
        "Qwen3ForCausalLM": ({"model.embed_tokens.weight": [9, 64], "lm_head.weight": [9, 64]},
                             {}, ("generate", "embed")),
        "LlamaForCausalLM": ({"model.embed_tokens.weight": [9, 64]},
                             {"tie_word_embeddings": True}, ("generate", "embed")),
        # An embedding export: CausalLM name, no lm_head, untied -> embed only.
        "Qwen2ForCausalLM": ({"embed_tokens.weight": [9, 64]}, {}, ("embed",)),
        "Qwen2Model": ({"embed_tokens.weight": [9, 64]}, {}, ("embed",)),
        "LlamaForSequenceClassification": ({"score.weight": [3, 64]},
                                           {"id2label": {"0": "a", "1": "b", "2": "c"}},
                                           ("classify",)),
        "Qwen3ForSequenceClassification": ({"score.weight": [1, 64]}, {}, ("classify", "score")),
    }  # fmt: skip
    for arch, (tensors, cfg, tasks) in cases.items():
        path, config = _checkpoint(tmp_path / arch, arch, tensors, **cfg)
        kind = checkpoint_kind(path, config)
        info = model_tasks(kind, config, path)
        assert info.supported_tasks == tasks, arch
        assert kind.causal_lm_arch == f"{kind.family}ForCausalLM"
        if "embed" in tasks:
            assert (info.embedding_size, info.pooling_type) == (64, PoolingType.LAST)
            assert not info.labels
        else:
            assert (info.embedding_size, info.pooling_type) == (0, None)
    labels = model_tasks(*_kind(tmp_path / "LlamaForSequenceClassification")).labels
    assert labels == ("a", "b", "c")
    assert model_tasks(*_kind(tmp_path / "Qwen3ForSequenceClassification")).labels == ("LABEL_0",)


def _kind(path: Path) -> tuple:  # type: ignore[type-arg]
    config = json.loads((path / "config.json").read_text())
    return checkpoint_kind(path, config), config, path


def test_unsupported_architecture_and_missing_head(tmp_path: Path) -> None:
    path, config = _checkpoint(tmp_path / "bert", "BertModel", {})
    with pytest.raises(ValueError, match="unsupported model architecture"):
        checkpoint_kind(path, config)
    path, config = _checkpoint(tmp_path / "nohead", "Qwen2ForSequenceClassification", {})
    with pytest.raises(ValueError, match="has no score.weight"):
        checkpoint_kind(path, config)


def test_pooling_type_from_sentence_transformers_then_flag(tmp_path: Path) -> None:
    for mode, want in (("mean_tokens", "MEAN"), ("cls_token", "CLS"), ("lasttoken", "LAST")):
        path, config = _checkpoint(tmp_path / mode, "Qwen3Model", {})
        _st_pooling(path, mode)
        assert sentence_transformers_pooling(path) is PoolingType(want)
        kind = checkpoint_kind(path, config)
        assert model_tasks(kind, config, path).pooling_type is PoolingType(want)
        # An explicit flag overrides the checkpoint.
        assert model_tasks(kind, config, path, "CLS").pooling_type is PoolingType.CLS
    path, config = _checkpoint(tmp_path / "max", "Qwen3Model", {})
    _st_pooling(path, "max_tokens")
    with pytest.raises(ValueError, match="pooling_mode_max_tokens is not supported"):
        model_tasks(checkpoint_kind(path, config), config, path)
    assert model_tasks(checkpoint_kind(path, config), config, path, "MEAN").pooling_type is (
        PoolingType.MEAN
    )
    path, _ = _checkpoint(tmp_path / "none", "Qwen3Model", {})
    assert sentence_transformers_pooling(path) is None


def test_matryoshka_facts(tmp_path: Path) -> None:
    def tasks(name: str, **cfg: object) -> ModelTasks:
        path, config = _checkpoint(tmp_path / name, "Qwen3Model", {}, **cfg)
        return model_tasks(checkpoint_kind(path, config), config, path)

    listed = tasks("listed", matryoshka_dimensions=[32, 64])
    assert (listed.is_matryoshka, listed.matryoshka_dimensions) == (True, (32, 64))
    flagged = tasks("flagged", is_matryoshka=True)
    assert (flagged.is_matryoshka, flagged.matryoshka_dimensions) == (True, ())
    assert not tasks("plain").is_matryoshka
    with pytest.raises(ValueError, match="matryoshka_dimensions must be a list of integers"):
        tasks("bad", matryoshka_dimensions=[0, 128])
