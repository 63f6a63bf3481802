"""The incremental detokenizer: never broken UTF-8, same text as a one-shot decode."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, trainers

from frontend_svc.text.detokenizer import IncrementalDetokenizer
from frontend_svc.text.output_processor import OutputProcessor
from frontend_svc.text.tokenizer import SpecialTokens, Tokenizer
from protos.types import EngineOutput, TokenizerFiles

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


class CountingDecoder:
    """Wraps the tokenizer and counts how many ids each decode call is given."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._decode = tokenizer.decode  # bound now: tests may patch the tokenizer's own
        self.ids_decoded = 0
        self.longest = 0

    def decode(
        self, token_ids: list[int] | tuple[int, ...], skip_special_tokens: bool = True
    ) -> str:
        self.ids_decoded += len(token_ids)
        self.longest = max(self.longest, len(token_ids))
        return self._decode(token_ids, skip_special_tokens=skip_special_tokens)


def test_tokenizer_knows_its_special_ids(tokenizer: Tokenizer) -> None:
    assert tokenizer.special_token_ids == {0, 1, 2, 3}  # bos, eos, im_start, im_end


def _with_special_runs(tokenizer: Tokenizer) -> list[int]:
    """Text with long runs of special tokens, one of them inside a split multi-byte character."""
    hello = tokenizer.encode("Hello", add_special_tokens=False)
    coffee = tokenizer.encode("☕", add_special_tokens=False)  # three byte tokens
    world = tokenizer.encode(" world! Café", add_special_tokens=False)
    return [*hello, *[1] * 3000, coffee[0], *[3, 2] * 500, *coffee[1:], *world, *[1] * 2000]


@pytest.mark.parametrize("skip", [True, False])
def test_runs_of_special_tokens_keep_the_window_small(tokenizer: Tokenizer, skip: bool) -> None:
    ids = _with_special_runs(tokenizer)
    decoder = CountingDecoder(tokenizer)
    detok = IncrementalDetokenizer(decoder, [0, 2], skip, tokenizer.special_token_ids)
    deltas = [detok.push([t]) for t in ids]
    deltas.append(detok.flush())
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=skip)
    assert "".join(deltas) == detok.text
    assert detok.window_size <= 8
    assert decoder.longest <= 8  # no decode call sees more than a few ids...
    assert decoder.ids_decoded <= 8 * len(ids)  # ...so the total grows linearly


def test_output_processor_skips_special_ids_in_the_window(
    tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    decoder = CountingDecoder(tokenizer)
    monkeypatch.setattr(tokenizer, "decode", decoder.decode)
    processor = OutputProcessor(tokenizer, [0], [], False, True, index=0, prompt_index=0)
    ids = _with_special_runs(tokenizer)
    text = ""
    for t in ids:
        text += processor.process(EngineOutput("r", (t,), finish_reason=None)).text
        assert processor._detok.window_size <= 8  # special ids never enter it
    assert text == "Hello☕ world! Café"
    assert decoder.longest <= 8  # and the tail left for a flush is as small


def test_kept_special_ids_keep_their_text(tokenizer: Tokenizer) -> None:
    """A tool-call parser's markers stay when they are special tokens; other specials go."""
    hello = tokenizer.encode("Hello", add_special_tokens=False)
    world = tokenizer.encode(" world!", add_special_tokens=False)
    ids = [*hello, 2, *world, 3, 1]  # <|im_start|> kept; <|im_end|>, <|eos|> dropped
    detok = IncrementalDetokenizer(tokenizer, [0], True, tokenizer.special_token_ids, {2})
    text = "".join(detok.push([t]) for t in ids) + detok.flush()
    assert text == "Hello<|im_start|> world!"
    assert tokenizer.special_ids_of(["<|im_start|>", "Hello", "no such token"]) == {2}


# -- the DecodeStream path (a Hugging Face fast tokenizer) against the Python window ----------


class WindowOnly:
    """The tokenizer without ``decode_stream``: the detokenizer decodes its window in Python."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.decode = tokenizer.decode


def _sentencepiece_style() -> Tokenizer:
    """A Llama-2-style tokenizer: "▁" for spaces, byte fallback (<0xNN> tokens for characters
    the vocabulary lacks), a decoder that strips the first leading space."""
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"])
    trained = HFTokenizer(models.BPE(unk_token="<unk>"))
    trained.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    trained.train_from_iterator(["Hello world! The quick brown fox, naïve café. " * 8], trainer)
    model = json.loads(trained.to_str())["model"]
    vocab = dict(model["vocab"])
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tok = HFTokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    tok.normalizer = trained.normalizer
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tok.add_special_tokens(["<s>", "</s>"])
    return Tokenizer(tok, SpecialTokens("<s>", "</s>"), None)


def _random_runs(tokenizer: Tokenizer, seed: int) -> list[list[int]]:
    """Token ids of mixed text (multi-byte characters, specials), cut into random pushes."""
    rng = random.Random(seed)
    words = ["Hello", " world", "!", " naïve", " café", " ☕", "日本", " 🙂", " the", "\n", "  x"]
    ids: list[int] = []
    for _ in range(60):
        ids += tokenizer.encode(rng.choice(words), add_special_tokens=False)
        if rng.random() < 0.1:
            ids.append(rng.choice(sorted(tokenizer.special_token_ids)))
    runs, i = [], 0
    while i < len(ids):
        n = rng.choice([1, 1, 1, 2, 3, 5])
        runs.append(ids[i : i + n])
        i += n
    return runs


@pytest.mark.parametrize("kind", ["byte-level", "sentencepiece"])
@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("seed", range(6))
def test_decode_stream_gives_the_window_text(
    tokenizer: Tokenizer, kind: str, skip: bool, seed: int
) -> None:
    tok = tokenizer if kind == "byte-level" else _sentencepiece_style()
    runs = _random_runs(tok, seed)
    prompt = tok.encode("The answer is", add_special_tokens=True)
    special = tok.special_token_ids
    fast = IncrementalDetokenizer(tok, prompt, skip, special)
    slow = IncrementalDetokenizer(WindowOnly(tok), prompt, skip, special)
    assert fast._stream is not None and slow._stream is None
    for run in runs:
        assert fast.push(run) == slow.push(run)
    assert fast.flush() == slow.flush()
    # The text after the prompt's last tokens (a sentencepiece decoder strips the leading space
    # of a text's first word, not of the output's).
    context = prompt[-5:]
    whole = [t for run in runs for t in run]
    before = tok.decode(context, skip_special_tokens=skip)
    assert fast.text == tok.decode(context + whole, skip_special_tokens=skip)[len(before) :]
    assert fast._stream is not None  # no fallback was needed


def test_decode_stream_leaves_the_incomplete_tail_to_flush(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("a☕", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [0])
    assert detok.push(ids[:1]) == "a"
    assert detok.push(ids[1:-1]) == ""  # two of the character's three bytes
    assert detok.flush() == tokenizer.decode(ids[1:-1])  # as replacement characters
    assert "\ufffd" in detok.text


def test_a_refused_stream_step_falls_back_to_the_window(tokenizer: Tokenizer) -> None:
    class Refusing(WindowOnly):
        def decode_stream(self, prefix: list[int], skip: bool) -> object:
            def step(ids: object) -> str | None:
                raise RuntimeError("Invalid prefix encountered")

            return step

    ids = tokenizer.encode("Café ☕ 日本語.", add_special_tokens=False)
    detok = IncrementalDetokenizer(Refusing(tokenizer), [0])
    text = "".join(detok.push([t]) for t in ids) + detok.flush()
    assert text == tokenizer.decode(ids)
    assert detok._stream is None


@pytest.mark.parametrize("prompt_text", ["Fix: \ufffd", "ends inside ☕"])
def test_a_prompt_ending_in_a_replacement_character_stays_out_of_the_output(
    tokenizer: Tokenizer, prompt_text: str
) -> None:
    """DecodeStream would take such a prompt tail as not yet emitted and put it in the first
    delta: the literal U+FFFD, or a prompt cut inside a character (token ids)."""
    prompt = tokenizer.encode(prompt_text, add_special_tokens=False)
    if prompt_text.endswith("☕"):
        prompt = prompt[:-1]  # the last of the character's three byte tokens is missing
    output = tokenizer.encode(" ok", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt)
    text = "".join(detok.push([t]) for t in output) + detok.flush()
    assert text == " ok"


@pytest.mark.parametrize("release", ["without DecodeStream", "without its seeded form"])
def test_an_older_tokenizers_release_decodes_the_window_in_python(
    tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch, release: str
) -> None:
    """``tokenizers>=0.20`` is allowed: DecodeStream came in 0.21, ``DecodeStream(ids=...)``
    later. Without them the detokenizer keeps to its Python window, same text."""
    from tokenizers import decoders

    class Unseeded:  # the 0.21 signature: no ids
        def __init__(self, skip_special_tokens: bool = False) -> None:
            pass

    if release == "without DecodeStream":
        monkeypatch.delattr(decoders, "DecodeStream")
    else:
        monkeypatch.setattr(decoders, "DecodeStream", Unseeded)
    assert tokenizer.decode_stream([0], True) is None
    ids = tokenizer.encode("Café ☕ 日本語.", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [0])
    assert detok._stream is None
    assert "".join(detok.push([t]) for t in ids) + detok.flush() == tokenizer.decode(ids)
