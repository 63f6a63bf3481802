"""The embedded default model: built deterministically, offline, and served by text prompts."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from engine_svc.default_model import build_default_model


def _digest(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


def test_default_model_is_deterministic_and_generates_text(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    build_default_model(a)
    build_default_model(b)
    da, db = _digest(a), _digest(b)
    assert da["tokenizer.json"] == db["tokenizer.json"]
    assert da["model.safetensors"] == db["model.safetensors"]

    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    from engine_svc import LLM, SamplingParams

    llm = LLM()  # no model: builds the default into TANDEM_CACHE_DIR
    assert (tmp_path / "cache").is_dir()
    out = llm.generate("Hello, my name is", SamplingParams(max_tokens=8, temperature=0.0))[0]
    assert out.prompt == "Hello, my name is"
    assert out.prompt_token_ids == llm.get_tokenizer().encode("Hello, my name is")
    assert 1 <= len(out.outputs[0].token_ids) <= 8
    assert isinstance(out.outputs[0].text, str)
    chat = llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
