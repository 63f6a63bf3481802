"""Sampling parameters: what a request asks of the sampler and of the stop checks.

Plain Python, validated once at construction; invalid values raise ``ValueError`` naming the
parameter, so both the offline API and the gRPC layer can turn them into clear errors.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

DEFAULT_MAX_LOGPROBS = 20
GREEDY_EPS = 1e-5  # a temperature below this is greedy
MAX_LOGIT_BIAS = 100.0  # |bias| allowed by logit_bias (OpenAI's range)
# Bad words are matched on the host every step for the rows that have them: bounded work.
MAX_BAD_WORDS = 256  # token sequences per request
MAX_BAD_WORD_TOKENS = 4096  # tokens per sequence
STRUCTURED_OUTPUT_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputParams:
    """A constraint on the generated text ("structured outputs"): exactly one field is set.

    ``json_schema`` is a JSON Schema (a dict, or its JSON text; kept as text), ``json_object``
    asks for any JSON object, ``regex`` for a text the expression matches, ``choice`` for one of
    the given strings, ``grammar`` for a text of an EBNF grammar whose start rule is ``root``.
    Only the shape is checked here; whether the schema, expression or grammar compiles is found
    out by the engine (``engine_svc.structured_output``).

    ``reasoning_end_token_ids`` (the ids of ``</think>``, for an output that begins in
    reasoning): the constraint applies only after their first occurrence in the output, as vLLM
    applies it with a reasoning parser. Empty: from the first output token. Not part of ``key``:
    the compiled grammar is the same.
    """

    json_schema: str | dict[str, Any] | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None
    reasoning_end_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        kinds = [k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) not in (None, False)]
        if len(kinds) != 1:
            got = ", ".join(kinds) or "none"
            raise ValueError(f"structured_output must set exactly one kind, got {got}")
        if self.json_schema is not None:
            value = self.json_schema
            try:
                text = value if isinstance(value, str) else json.dumps(value)
                schema = json.loads(text)
            except (TypeError, ValueError) as e:
                raise ValueError(f"structured_output.json_schema is not valid JSON: {e}") from e
            _check(
                isinstance(schema, dict),
                "structured_output.json_schema",
                "must be a JSON object",
                _short(value),
            )
            object.__setattr__(self, "json_schema", text)
        _check(
            isinstance(self.json_object, bool),
            "structured_output.json_object",
            "must be a boolean",
            self.json_object,
        )
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None:
                _check(
                    isinstance(value, str) and value.strip() != "",
                    f"structured_output.{name}",
                    "must be a non-empty string",
                    _short(value),
                )
        if self.choice is not None:
            choice = tuple(self.choice) if isinstance(self.choice, (list, tuple)) else None
            _check(
                bool(choice) and all(isinstance(c, str) for c in choice or ()),
                "structured_output.choice",
                "must be a non-empty list of strings",
                _short(self.choice),
            )
            object.__setattr__(self, "choice", choice)
        end = self.reasoning_end_token_ids
        _check(
            isinstance(end, (list, tuple)) and all(_is_int(t) and t >= 0 for t in end),
            "structured_output.reasoning_end_token_ids",
            "must be a list of token ids",
            _short(end),
        )
        object.__setattr__(self, "reasoning_end_token_ids", tuple(end))

    @property
    def kind(self) -> str:
        """The field that is set: json_schema, json_object, regex, choice or grammar."""
        return next(k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> tuple[str, str]:
        """(kind, spec as text): equal constraints have equal keys (the compile cache's key)."""
        kind = self.kind
        if kind == "choice":
            return kind, json.dumps(self.choice)
        if kind == "json_object":
            return kind, ""
        value = getattr(self, kind)
        assert isinstance(value, str)
        return kind, value


@dataclass
class SamplingParams:
    """Per-request sampling and stopping parameters (the vLLM shape, minus text-level fields).

    ``temperature == 0`` means greedy. ``top_k`` of 0 or -1 means all tokens. ``logprobs`` is the
    number of top alternatives returned beside the sampled token (None: no logprobs);
    ``prompt_logprobs`` likewise for every prompt token.

    Applied to the logits in vLLM's order, before penalties and temperature:
    ``allowed_token_ids`` (only these may be sampled), ``bad_words`` (a token that would complete
    one of the sequences is banned), ``logit_bias`` (token id -> value added to its logit, in
    [-100, 100]). ``bad_words`` are words as text: the offline ``LLM`` tokenizes them into
    ``bad_words_token_ids`` (each word with and without a leading space, as vLLM does); the engine
    itself only reads ``bad_words_token_ids``. Token ids are checked against the vocabulary when
    the request is added.
    """

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    max_logprobs: int = DEFAULT_MAX_LOGPROBS
    structured_output: StructuredOutputParams | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None

    def __post_init__(self) -> None:
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias is not None:
            _check(
                isinstance(self.logit_bias, dict),
                "logit_bias",
                "must be a dict of token id -> bias",
                _short(self.logit_bias),
            )
            self.logit_bias = dict(self.logit_bias) or None
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        if self.bad_words is not None:
            self.bad_words = list(self.bad_words) or None
        if self.bad_words_token_ids is not None:
            self.bad_words_token_ids = [list(w) for w in self.bad_words_token_ids] or None
        if self.top_k == -1:
            self.top_k = 0
        self.verify()

    def verify(self, max_n: int = 128) -> None:
        """Raise ``ValueError`` naming the first invalid parameter."""
        _check(
            _is_int(self.n) and 1 <= self.n <= max_n,
            "n",
            f"must be in [1, {max_n}]",
            self.n,
        )
        if self.max_tokens is not None:
            _check(
                _is_int(self.max_tokens) and self.max_tokens >= 1,
                "max_tokens",
                "must be at least 1",
                self.max_tokens,
            )
        _check(
            _is_int(self.min_tokens) and self.min_tokens >= 0,
            "min_tokens",
            "must be at least 0",
            self.min_tokens,
        )
        if self.max_tokens is not None:
            _check(
                self.min_tokens <= self.max_tokens,
                "min_tokens",
                f"must not exceed max_tokens={self.max_tokens}",
                self.min_tokens,
            )
        _check(
            _is_num(self.temperature) and self.temperature >= 0,
            "temperature",
            "must be non-negative",
            self.temperature,
        )
        _check(
            _is_num(self.top_p) and 0 < self.top_p <= 1, "top_p", "must be in (0, 1]", self.top_p
        )
        _check(
            _is_int(self.top_k) and self.top_k >= 0,
            "top_k",
            "must be 0, -1 (disabled) or positive",
            self.top_k,
        )
        _check(
            _is_num(self.min_p) and 0 <= self.min_p <= 1, "min_p", "must be in [0, 1]", self.min_p
        )
        if self.seed is not None:
            _check(
                _is_int(self.seed) and -(2**63) <= self.seed < 2**64,
                "seed",
                "must be a 64-bit integer",
                self.seed,
            )
        _check(
            all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            "must be non-negative token ids",
            self.stop_token_ids,
        )
        _check(
            _is_num(self.presence_penalty) and -2 <= self.presence_penalty <= 2,
            "presence_penalty",
            "must be in [-2, 2]",
            self.presence_penalty,
        )
        _check(
            _is_num(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2,
            "frequency_penalty",
            "must be in [-2, 2]",
            self.frequency_penalty,
        )
        _check(
            _is_num(self.repetition_penalty) and 0 < self.repetition_penalty <= 2,
            "repetition_penalty",
            "must be in (0, 2]",
            self.repetition_penalty,
        )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:  # max_logprobs -1: no limit but the vocabulary's
                most = self.max_logprobs if self.max_logprobs >= 0 else None
                _check(
                    _is_int(value) and 0 <= value and (most is None or value <= most),
                    name,
                    f"must be in [0, {most}] (the server's max_logprobs)",
                    value,
                )
        _check(
            self.structured_output is None
            or isinstance(self.structured_output, StructuredOutputParams),
            "structured_output",
            "must be a StructuredOutputParams",
            self.structured_output,
        )
        self._verify_token_constraints()

    def _verify_token_constraints(self) -> None:
        for token, bias in (self.logit_bias or {}).items():
            _check(
                _is_int(token) and token >= 0,
                "logit_bias",
                "keys must be token ids (integers >= 0)",
                _short(token),
            )
            _check(
                _is_num(bias) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS,
                "logit_bias",
                f"values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]",
                _short(bias),
            )
        if self.allowed_token_ids is not None:
            _check(
                len(self.allowed_token_ids) > 0,
                "allowed_token_ids",
                "must not be empty",
                self.allowed_token_ids,
            )
            _check(
                all(_is_int(t) and t >= 0 for t in self.allowed_token_ids),
                "allowed_token_ids",
                "must be token ids (integers >= 0)",
                _short(self.allowed_token_ids),
            )
        if self.bad_words is not None:
            _check(
                all(isinstance(w, str) and w.strip() for w in self.bad_words),
                "bad_words",
                "must be non-blank strings",
                _short(self.bad_words),
            )
        words = self.bad_words_token_ids or []
        _check(
            len(words) <= MAX_BAD_WORDS,
            "bad_words_token_ids",
            f"may hold at most {MAX_BAD_WORDS} token sequences",
            f"{len(words)} sequences",
        )
        _check(
            all(
                0 < len(w) <= MAX_BAD_WORD_TOKENS and all(_is_int(t) and t >= 0 for t in w)
                for w in words
            ),
            "bad_words_token_ids",
            f"must be sequences of 1 to {MAX_BAD_WORD_TOKENS} token ids (integers >= 0)",
            _short(words),
        )

    def check_vocab(self, vocab_size: int) -> None:
        """Raise ``ValueError`` naming logit_bias, allowed_token_ids or bad_words_token_ids when
        it holds a token id >= ``vocab_size``. (A stop token id outside the vocabulary is left
        alone: it is never sampled, so it never stops anything.)"""
        named = (
            ("logit_bias", list(self.logit_bias or ())),
            ("allowed_token_ids", self.allowed_token_ids or []),
            ("bad_words_token_ids", [t for w in self.bad_words_token_ids or [] for t in w]),
            (
                "structured_output.reasoning_end_token_ids",
                list(self.structured_output.reasoning_end_token_ids)
                if self.structured_output is not None
                else [],
            ),
        )
        for name, ids in named:
            bad = sorted({t for t in ids if t >= vocab_size})
            if bad:
                raise ValueError(
                    f"{name} contains token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}"
                )

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_num(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


def _short(value: object) -> object:
    text = repr(value)
    return value if len(text) <= 80 else text[:77] + "..."


def _check(ok: bool, name: str, rule: str, value: object) -> None:
    if not ok:
        raise ValueError(f"{name} {rule}, got {value!r}")
