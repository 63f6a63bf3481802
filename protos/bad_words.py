"""vLLM's rule for turning a request's ``bad_words`` into banned token sequences, once for every
place that tokenizes a request: the gateway (HTTP) and the engine's offline ``LLM``.

Each word, leading spaces stripped, as the tokenizer encodes it; plus its encoding after a space
when that starts with another token and has the same length (a word inside a text usually
follows a space). Repeats are dropped, keeping the first.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


class EmptyBadWord(ValueError):
    """A bad word that tokenizes to no token (it would ban nothing)."""

    def __init__(self, word: str) -> None:
        super().__init__(f"bad word {word!r} tokenizes to no token")
        self.word = word


def bad_words_token_ids(
    encode: Callable[[str], Sequence[int]], words: Sequence[str]
) -> list[tuple[int, ...]]:
    """The banned sequences for ``words``; ``encode`` tokenizes without special tokens."""
    out: list[tuple[int, ...]] = []
    for word in words:
        plain = tuple(encode(word.lstrip()))
        if not plain:
            raise EmptyBadWord(word)
        out.append(plain)
        spaced = tuple(encode(" " + word.lstrip()))
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return list(dict.fromkeys(out))
