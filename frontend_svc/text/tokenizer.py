"""The gateway's tokenizer: Hugging Face ``tokenizers`` plus tokenizer_config.json, no transformers.

Built from the files the engine serves (GetTokenizer), in memory.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from functools import partial
from typing import Any

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders as hf_decoders

from frontend_svc.text.detokenizer import StreamStep
from protos.types import ModelInfo, TokenizerFiles


@dataclass(frozen=True)
class EncodedPrompt:
    """A prompt's token ids: all of them, or the first ones when it is longer than asked for."""

    ids: list[int]
    num_tokens: int  # the whole prompt's length

    @property
    def truncated(self) -> bool:
        return len(self.ids) < self.num_tokens


@dataclass(frozen=True)
class SpecialTokens:
    bos_token: str | None
    eos_token: str | None


class Tokenizer:
    """Encode text to token ids and decode them back; knows the chat template."""

    def __init__(
        self,
        tokenizer: HFTokenizer,
        special: SpecialTokens,
        chat_template: str | None,
        vocab_size: int | None = None,
    ) -> None:
        self._tok = tokenizer
        self.special = special
        self.chat_template = chat_template
        self.vocab_size = vocab_size or tokenizer.get_vocab_size(with_added_tokens=True)
        self._lock = threading.Lock()
        self._truncators: dict[int, HFTokenizer] = {}
        # The ids decode(skip_special_tokens=True) drops: added tokens marked special.
        self.special_token_ids: frozenset[int] = frozenset(
            i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special
        )

    @classmethod
    def from_files(cls, files: TokenizerFiles, info: ModelInfo | None = None) -> Tokenizer:
        """Load from an in-memory tokenizer directory (needs tokenizer.json)."""
        if "tokenizer.json" not in files.files:
            raise ValueError(
                "the engine's tokenizer has no tokenizer.json (only fast tokenizers are supported)"
            )
        tok = HFTokenizer.from_str(files.files["tokenizer.json"].decode("utf-8"))
        config: dict[str, Any] = {}
        if "tokenizer_config.json" in files.files:
            config = json.loads(files.files["tokenizer_config.json"])
        template = files.chat_template or _template_from(config, files)
        special = SpecialTokens(
            bos_token=_token_text(config.get("bos_token")),
            eos_token=_token_text(config.get("eos_token")),
        )
        if info is not None and special.bos_token is None and info.bos_token_id is not None:
            special = SpecialTokens(tok.id_to_token(info.bos_token_id), special.eos_token)
        if info is not None and special.eos_token is None and info.eos_token_ids:
            special = SpecialTokens(special.bos_token, tok.id_to_token(info.eos_token_ids[0]))
        return cls(tok, special, template, info.vocab_size if info is not None else None)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def encode_batch_releasing_gil(
        self, texts: list[str], add_special_tokens: bool = True, max_length: int | None = None
    ) -> list[EncodedPrompt]:
        """The ids ``encode`` gives, computed with the GIL released (``encode`` holds it for the
        whole call; the batch API does not), so a worker thread leaves the event loop free.
        ``encode_batch_fast`` also skips the character offsets (2x faster to make and to free).

        With ``max_length`` only the first ``max_length`` ids become Python objects (building,
        and later freeing, a list of millions of ints holds the GIL for tens of milliseconds);
        ``num_tokens`` still tells the whole length.
        """
        tok = self._tok if max_length is None else self._truncating(max_length)
        batch = getattr(tok, "encode_batch_fast", tok.encode_batch)
        added = tok.num_special_tokens_to_add(False) if add_special_tokens else 0
        out = []
        for e in batch(texts, add_special_tokens=add_special_tokens):
            rest = sum(len(o) - added for o in e.overflowing) if max_length is not None else 0
            ids = e.ids
            out.append(EncodedPrompt(ids, len(ids) + rest))
        return out

    def encode_pairs_releasing_gil(self, pairs: list[tuple[str, str]]) -> list[list[int]]:
        """Each pair's ids as the tokenizer's pair template joins the two texts, with special
        tokens (what ``tokenizer(text_1, text_2)`` gives in transformers): a cross-encoder's
        input. The batch API releases the GIL, as in ``encode_batch_releasing_gil``."""
        batch = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        return [list(e.ids) for e in batch(pairs, add_special_tokens=True)]

    def prepare_truncation(self, max_length: int) -> None:
        """Make the truncating copy for ``max_length`` now (the gateway does it when an engine
        connects): copying a large tokenizer holds the GIL for a while."""
        self._truncating(max_length)

    def _truncating(self, max_length: int) -> HFTokenizer:
        """A copy of the tokenizer that keeps the first ``max_length`` ids (plus the rest as
        overflow); one per length, made once."""
        with self._lock:
            tok = self._truncators.get(max_length)
            if tok is None:
                tok = HFTokenizer.from_str(self._tok.to_str())
                tok.enable_truncation(max_length)
                self._truncators[max_length] = tok
            return tok

    def decode(
        self, token_ids: list[int] | tuple[int, ...], skip_special_tokens: bool = True
    ) -> str:
        return str(self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def decode_stream(
        self, prefix_ids: list[int], skip_special_tokens: bool = True
    ) -> StreamStep | None:
        """A step function over ``tokenizers``' DecodeStream, seeded with ``prefix_ids``: give it
        the next ids, it returns the text they complete, or None while a character is still
        incomplete. vLLM's incremental decode done in Rust, one call per step (~0.5 us a token,
        where two Python-level ``decode`` calls cost ~1.5 us). None with a ``tokenizers`` too
        old for it (DecodeStream, or its seeded form, came in 0.21 / 0.22)."""
        # Absent before tokenizers 0.21: the detokenizer then decodes its window in Python.
        decode_stream = getattr(hf_decoders, "DecodeStream", None)
        if decode_stream is None:
            return None
        try:
            stream = decode_stream(ids=prefix_ids, skip_special_tokens=skip_special_tokens)
        except TypeError:  # no ``ids``: a release before the seeded form
            return None
        return partial(stream.step, self._tok)

    def decode_releasing_gil(
        self, token_ids: list[int] | tuple[int, ...], skip_special_tokens: bool = True
    ) -> str:
        """``decode`` through the batch API, which releases the GIL (``decode`` holds it: ~110
        ms for a million ids, measured, against 8 ms of held GIL this way)."""
        texts = self._tok.decode_batch([list(token_ids)], skip_special_tokens=skip_special_tokens)
        return str(texts[0])

    def token_text(self, token_id: int) -> str:
        """One token decoded on its own (what logprob entries show)."""
        return str(self._tok.decode([token_id], skip_special_tokens=False))

    def special_ids_of(self, texts: Iterable[str]) -> frozenset[int]:
        """The ids of those ``texts`` that are each one special token (what
        ``skip_special_tokens`` drops); texts that are not tokens, or not special, give none."""
        ids = (self._tok.token_to_id(text) for text in texts)
        return frozenset(i for i in ids if i is not None and i in self.special_token_ids)

    def token_strings(self, token_ids: list[int]) -> list[str]:
        """The vocabulary strings of the tokens (vLLM's ``token_strs``)."""
        return [self._tok.id_to_token(t) or "" for t in token_ids]


def _token_text(value: object) -> str | None:
    """tokenizer_config.json spells special tokens as a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _template_from(config: dict[str, Any], files: TokenizerFiles) -> str | None:
    if "chat_template.jinja" in files.files:
        return files.files["chat_template.jinja"].decode("utf-8")
    template = config.get("chat_template")
    if isinstance(template, str):
        return template
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        default = named.get("default")
        return default if isinstance(default, str) else None
    return None
