"""Fixtures the structured-output tests share (a module defining its own fixture of the same
name uses its own): the default model's tokenizer on disk and a grammar manager over it."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.grammar_helpers import EOS, VOCAB


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engine_svc.default_model import build_tokenizer

    d = tmp_path_factory.mktemp("so_tokenizer")
    build_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def manager(tokenizer_dir: Path):  # noqa: ANN201 - a StructuredOutputManager (needs xgrammar)
    from engine_svc.structured_output import StructuredOutputManager

    return StructuredOutputManager(tokenizer_dir, VOCAB, (EOS,))
