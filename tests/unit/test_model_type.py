"""GetModelInfo's model_type: the checkpoint's config.json ``model_type`` (its text config's
for a multimodal checkpoint, as vLLM's hf_text_config), "" when the checkpoint has none."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine_svc.rpc.servicer import _model_type


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({"model_type": "kimi_k2"}, "kimi_k2"),
        ({"model_type": "kimi_k25", "text_config": {"model_type": "kimi_k2"}}, "kimi_k2"),
        ({"architectures": ["X"]}, ""),
        ([1, 2], ""),
        (None, ""),  # no config.json at all
    ],
)
def test_model_type_comes_from_config_json(tmp_path: Path, config: object, expected: str) -> None:
    if config is not None:
        (tmp_path / "config.json").write_text(json.dumps(config))
    assert _model_type(tmp_path) == expected
