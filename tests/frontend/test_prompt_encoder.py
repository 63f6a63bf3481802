"""PromptEncoder: big prompts go to the worker threads, small ones stay inline, same ids."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from frontend_svc.text import prompt_encoder
from frontend_svc.text.prompt_encoder import OFFLOAD_MIN_CHARS, PromptEncoder
from frontend_svc.text.tokenizer import EncodedPrompt, Tokenizer
from protos.types import TokenizerFiles
from tests.frontend.fake_engine import SCRIPT

pytestmark = pytest.mark.timeout(30)


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir: Path) -> Tokenizer:
    files = {p.name: p.read_bytes() for p in tokenizer_dir.iterdir()}
    return Tokenizer.from_files(TokenizerFiles(files=files))


@pytest.fixture()
def worker_threads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Names of the threads that ran the GIL-releasing encode."""
    names: list[str] = []
    encode = prompt_encoder.encode_releasing_gil

    def recording(
        tok: Tokenizer, texts: list[str], add: bool, max_length: int | None = None
    ) -> list[EncodedPrompt]:
        names.append(threading.current_thread().name)
        return encode(tok, texts, add, max_length)

    monkeypatch.setattr(prompt_encoder, "encode_releasing_gil", recording)
    return names


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_the_gil_releasing_encode_gives_the_same_ids(
    tokenizer: Tokenizer, add_special_tokens: bool
) -> None:
    texts = [SCRIPT, "<|im_start|>user\nHi<|im_end|>", " ", "☕" * 50]
    expected = [tokenizer.encode(t, add_special_tokens) for t in texts]
    got = prompt_encoder.encode_releasing_gil(tokenizer, texts, add_special_tokens)
    assert [p.ids for p in got] == expected
    assert [p.num_tokens for p in got] == [len(ids) for ids in expected]


def test_small_prompts_stay_inline_big_ones_go_to_the_pool(
    tokenizer: Tokenizer, worker_threads: list[str]
) -> None:
    encoder = PromptEncoder(threads=2)
    small, big = "Hello world", SCRIPT * (2 * OFFLOAD_MIN_CHARS // len(SCRIPT))
    try:
        ids = [p.ids for p in asyncio.run(encoder.encode(tokenizer, [small], True))]
        assert ids == [tokenizer.encode(small)] and worker_threads == []
        ids = [p.ids for p in asyncio.run(encoder.encode(tokenizer, [small, big], True))]
        assert ids == [tokenizer.encode(small), tokenizer.encode(big)]
        assert len(worker_threads) == 1 and worker_threads[0].startswith("tokenize")
    finally:
        encoder.close()


def test_big_chats_are_rendered_and_encoded_in_the_pool(
    tokenizer: Tokenizer, worker_threads: list[str]
) -> None:
    encoder = PromptEncoder(threads=1)
    try:
        for content in ("Hi", "x" * OFFLOAD_MIN_CHARS):
            messages = [{"role": "user", "content": content}]
            prompt = asyncio.run(encoder.encode_chat(tokenizer, messages, True, {}))
            text = prompt_encoder.render_chat_prompt(tokenizer, messages, True, {})
            assert prompt.ids == tokenizer.encode(text, add_special_tokens=False)
        assert len(worker_threads) == 1
    finally:
        encoder.close()


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_a_prompt_over_max_length_is_cut_but_counted_exactly(
    tokenizer: Tokenizer, add_special_tokens: bool
) -> None:
    """Only the first max_length ids become Python ints (a huge prompt would otherwise hold the
    GIL to build and free millions of them); the count stays exact, special tokens included."""
    text = SCRIPT * 200
    full = tokenizer.encode(text, add_special_tokens)
    short = "Hello world"
    got = tokenizer.encode_batch_releasing_gil([text, short], add_special_tokens, max_length=100)
    assert got[0].ids == full[:100] and got[0].num_tokens == len(full) and got[0].truncated
    assert got[1].ids == tokenizer.encode(short, add_special_tokens) and not got[1].truncated
