"""The incremental detokenizer: never broken UTF-8, same text as a one-shot decode."""

from __future__ import annotations

from pathlib import Path

import pytest

from frontend_svc.detokenizer import IncrementalDetokenizer
from frontend_svc.engine_types import TokenizerFiles
from frontend_svc.tokenizer import Tokenizer

pytestmark = pytest.mark.timeout(30)


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir: Path) -> Tokenizer:
    files = {p.name: p.read_bytes() for p in tokenizer_dir.iterdir()}
    return Tokenizer.from_files(TokenizerFiles(files))


@pytest.mark.parametrize(
    "text", ["Café ☕ 日本語.", "☕☕", "Hello world! naïve résumé", "emoji 🙂 and 日本"]
)
def test_one_token_at_a_time_matches_full_decode(tokenizer: Tokenizer, text: str) -> None:
    prompt = tokenizer.encode("The answer is", add_special_tokens=True)
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt)
    deltas = [detok.push([t]) for t in ids]
    deltas.append(detok.flush())
    assert all("\ufffd" not in d for d in deltas), deltas
    assert "".join(deltas) == tokenizer.decode(ids)


def test_multibyte_character_split_across_tokens_is_held_back(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("☕", add_special_tokens=False)
    assert len(ids) == 3  # three byte tokens: the tokenizer never saw this character
    detok = IncrementalDetokenizer(tokenizer, [0])
    assert detok.push(ids[:1]) == ""
    assert detok.push(ids[1:2]) == ""
    assert detok.push(ids[2:]) == "☕"


def test_flush_emits_a_truly_incomplete_tail(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("a☕", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [0])
    emitted = detok.push(ids[:-1])
    assert "\ufffd" not in emitted
    assert detok.flush().endswith("\ufffd")


def test_special_tokens_are_skipped(tokenizer: Tokenizer) -> None:
    hello = tokenizer.encode("Hello", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [0])
    text = detok.push(hello) + detok.push([1]) + detok.flush()  # 1 is <|eos|>
    assert text == "Hello"
