"""Completions logprobs: ``top_logprobs`` is keyed by text, and ids can share a text."""

from __future__ import annotations

import pytest

from frontend_svc.protocol.logprobs import CompletionLogprobs
from protos.types import TokenLogprob

pytestmark = pytest.mark.timeout(10)


class SpellingTokenizer:
    """A stub: ids 1 and 2 both read " the" (like a token and its byte-fallback spelling)."""

    TEXTS = {1: " the", 2: " the", 3: " a", 4: " an", 5: " a"}

    def token_text(self, token_id: int) -> str:
        return self.TEXTS[token_id]


def top_logprobs(entry: TokenLogprob, num_top: int) -> dict[str, float]:
    built = CompletionLogprobs(SpellingTokenizer(), num_top).build([entry.token_id], [entry])
    top = built["top_logprobs"][0]
    assert top is not None
    return dict(top)


def test_less_likely_alternative_with_the_same_text_does_not_overwrite() -> None:
    # " the" (id 1) is the most likely alternative; id 2 reads the same but is less likely.
    entry = TokenLogprob(3, -1.5, 3, top=((1, -0.2), (2, -1.0), (3, -1.5)))
    top = top_logprobs(entry, 3)
    assert top == {" the": -0.2, " a": -1.5}
    assert list(top) == [" a", " the"]  # the chosen token first, then the top (vLLM's order)


def test_chosen_token_does_not_overwrite_a_likelier_alternative_with_its_text() -> None:
    # The sampled id 2 reads " the" like the likelier id 1: the entry keeps id 1's logprob.
    entry = TokenLogprob(2, -1.0, 2, top=((1, -0.2), (2, -1.0)))
    assert top_logprobs(entry, 1) == {" the": -0.2}
    assert top_logprobs(entry, 2) == {" the": -0.2}


def test_chosen_token_outside_the_top_is_added_under_its_own_text() -> None:
    entry = TokenLogprob(4, -3.0, 5, top=((1, -0.2), (3, -0.9)))
    assert top_logprobs(entry, 2) == {" the": -0.2, " a": -0.9, " an": -3.0}
    assert list(top_logprobs(entry, 2)) == [" an", " the", " a"]  # chosen, then most likely


def test_chosen_token_keeps_its_logprob_over_a_less_likely_same_text_alternative() -> None:
    entry = TokenLogprob(5, -0.1, 1, top=((5, -0.1), (3, -0.7)))
    assert top_logprobs(entry, 2) == {" a": -0.1}
    built = CompletionLogprobs(SpellingTokenizer(), 2).build([5], [entry])
    assert built["token_logprobs"] == [-0.1] and built["tokens"] == [" a"]
