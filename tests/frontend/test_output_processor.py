"""The per-sequence output processor: min_tokens arms stop strings, stop tokens leave no text."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import openai
import pytest
from tokenizers import Tokenizer as HFTokenizer

from frontend_svc.text.output_processor import OutputProcessor, SequenceDelta
from frontend_svc.text.tokenizer import Tokenizer
from protos.types import EngineOutput, FinishReason, TokenizerFiles, TokenLogprob
from tests.frontend.fake_engine import MODEL_NAME

pytestmark = pytest.mark.timeout(30)

SENTENCE = "Hello world! The quick brown fox jumps over the lazy dog."
# Tokens: Hel|lo| world|!| The| qu|ick| b|row|n| f|ox| jum|ps| o|ver| the| l|az|y| do|g|.


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir: Path) -> Tokenizer:
    files = {p.name: p.read_bytes() for p in tokenizer_dir.iterdir()}
    return Tokenizer.from_files(TokenizerFiles(files))


def run(
    tokenizer: Tokenizer,
    ids: Sequence[int],
    stop: Sequence[str] = (),
    min_tokens: int = 0,
    finish: FinishReason = FinishReason.LENGTH,
    include_stop_str_in_output: bool = False,
    skip_special_tokens: bool = True,
) -> list[SequenceDelta]:
    """One token per engine output, the last one finished with ``finish``; stops reading at the
    first delta that finishes (what generation does)."""
    processor = OutputProcessor(
        tokenizer,
        tokenizer.encode("Say:"),
        stop,
        include_stop_str_in_output,
        skip_special_tokens,
        index=0,
        prompt_index=0,
        min_tokens=min_tokens,
    )
    deltas = []
    for i, t in enumerate(ids):
        last = i == len(ids) - 1
        out = EngineOutput(
            "r",
            (t,),
            logprobs=(TokenLogprob(t, -0.5, 1),),
            finish_reason=finish if last else None,
            stop_reason=t if last and finish is FinishReason.STOP else None,
        )
        deltas.append(processor.process(out))
        if deltas[-1].finish_reason is not None:
            break
    return deltas


def text_of(deltas: list[SequenceDelta]) -> str:
    return "".join(d.text for d in deltas)


# -- min_tokens (vLLM tests/detokenizer/test_min_tokens.py, PR #22014) -------------------------


@pytest.mark.parametrize(
    ("min_tokens", "stop", "want", "want_stop"),
    [
        (0, [], SENTENCE, None),
        (0, ["e"], "H", "e"),
        # "e" in "Hel" and " The" (tokens 1 and 5) does not count; the one in "ver" does.
        (5, ["e"], "Hello world! The quick brown fox jumps ov", "e"),
    ],
)
def test_stop_strings_count_only_after_min_tokens(
    tokenizer: Tokenizer, min_tokens: int, stop: list[str], want: str, want_stop: str | None
) -> None:
    deltas = run(tokenizer, tokenizer.encode(SENTENCE, False), stop, min_tokens)
    assert text_of(deltas) == want
    assert deltas[-1].stop_reason == want_stop
    assert deltas[-1].finish_reason == ("stop" if want_stop else "length")


def test_stop_string_completed_by_the_first_armed_token_is_found(tokenizer: Tokenizer) -> None:
    # "!" is token 4 (the last within min_tokens), " The" token 5: the stop spans the boundary.
    deltas = run(tokenizer, tokenizer.encode(SENTENCE, False), ["! The"], min_tokens=4)
    assert (text_of(deltas), deltas[-1].stop_reason) == ("Hello world", "! The")
    assert len(deltas) == 5
    # The held-back "!" was never emitted, so nothing emitted had to be taken back.
    assert [d.text for d in deltas] == ["Hel", "lo", " world", "", ""]


def test_stop_string_wholly_before_min_tokens_never_fires(tokenizer: Tokenizer) -> None:
    # "wor" is complete within the first 4 tokens, inside text held back for "world! Zzz"; the
    # armed tokens after it must not report it.
    ids = tokenizer.encode(SENTENCE, False)[:8]
    deltas = run(tokenizer, ids, ["wor", "world! Zzz"], min_tokens=4)
    assert text_of(deltas) == "Hello world! The quick b"
    assert (deltas[-1].finish_reason, deltas[-1].stop_reason) == ("length", None)


def test_min_tokens_covering_the_whole_output_emits_everything(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("The answer is", False)
    deltas = run(tokenizer, ids, ["answer", "is"], min_tokens=len(ids))
    assert (text_of(deltas), deltas[-1].finish_reason) == ("The answer is", "length")


def test_min_tokens_boundary_inside_one_engine_output(tokenizer: Tokenizer) -> None:
    """Several tokens in one output (a batch): the boundary falls between them, as in vLLM."""
    ids = tuple(tokenizer.encode(SENTENCE, False))
    processor = OutputProcessor(
        tokenizer, [0], ["e"], False, True, index=0, prompt_index=0, min_tokens=5
    )
    first = processor.process(EngineOutput("r", ids[:3]))
    second = processor.process(EngineOutput("r", ids[3:]))
    assert first.text + second.text == "Hello world! The quick brown fox jumps ov"
    assert second.stop_reason == "e"


# -- the token the engine stopped on --------------------------------------------------------


def test_stop_token_text_is_dropped_but_its_id_and_logprob_stay(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("Hello world! The", False)  # " The" plays a stop_token_ids entry
    deltas = run(tokenizer, ids, finish=FinishReason.STOP)
    assert text_of(deltas) == "Hello world!"
    assert deltas[-1].token_ids == (ids[-1],)
    assert [lp.token_id for lp in deltas[-1].logprobs] == [ids[-1]]
    assert (deltas[-1].finish_reason, deltas[-1].stop_reason) == ("stop", ids[-1])


def test_stop_token_text_kept_with_include_stop_str_in_output(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("Hello world! The", False)
    deltas = run(tokenizer, ids, finish=FinishReason.STOP, include_stop_str_in_output=True)
    assert text_of(deltas) == "Hello world! The"


def test_eos_text_is_dropped_even_without_skipping_special_tokens(tokenizer: Tokenizer) -> None:
    ids = [*tokenizer.encode("Hello", False), 1]  # 1 is <|eos|>
    deltas = run(tokenizer, ids, finish=FinishReason.STOP, skip_special_tokens=False)
    assert text_of(deltas) == "Hello"
    kept = run(tokenizer, ids, skip_special_tokens=False)  # finished by length: it stays
    assert text_of(kept) == "Hello<|eos|>"


def test_length_finish_keeps_the_last_token_text(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("Hello world! The", False)
    assert text_of(run(tokenizer, ids)) == "Hello world! The"


# -- end to end through the gateway and the scripted engine ---------------------------------


def test_min_tokens_and_stop_string_through_the_gateway(client: openai.OpenAI) -> None:
    r = client.completions.create(
        model=MODEL_NAME,
        prompt="Hi",
        max_tokens=30,
        seed=0,
        stop=["e"],
        extra_body={"min_tokens": 5},
    )
    c = r.choices[0]
    assert (c.text, c.finish_reason) == ("Hello world! The quick brown fox jumps ov", "stop")
    assert (c.model_extra or {})["stop_reason"] == "e"


def test_stop_token_text_is_dropped_through_the_gateway(
    client: openai.OpenAI, hf_tokenizer: HFTokenizer
) -> None:
    the = hf_tokenizer.encode("Hello world! The", add_special_tokens=False).ids[-1]
    r = client.completions.create(
        model=MODEL_NAME,
        prompt="Hi",
        max_tokens=30,
        seed=0,
        logprobs=0,
        extra_body={"stop_token_ids": [the]},
    )
    c = r.choices[0]
    assert (c.text, c.finish_reason) == ("Hello world!", "stop")
    assert (c.model_extra or {})["stop_reason"] == the
    assert c.logprobs is not None and c.logprobs.tokens is not None
    assert c.logprobs.tokens[-1] == " The"  # the stop token keeps its logprob entry
    assert r.usage is not None and r.usage.completion_tokens == 5
