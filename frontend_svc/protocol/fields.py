"""Field types of the request bodies: each carries the rule the gateway enforces and the JSON
Schema that documents it, so /openapi.json says exactly what the server accepts.

Numbers are read as strictly as JSON has them: an integer field takes integers and integral
floats (``2.0``, as JSON Schema counts them), never booleans, strings or ``2.5``; a number field
takes any number, checked as the 32-bit float the engine receives (the engine contract's type).
A boolean field takes what vLLM's request models take (pydantic's lax mode): ``true``/``false``,
the numbers 1 and 0, and the strings in ``TRUE_WORDS`` / ``FALSE_WORDS`` in any case.
"""

from __future__ import annotations

import functools
import math
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any

import orjson
from pydantic import (
    BeforeValidator,
    Field,
    GetCoreSchemaHandler,
    GetJsonSchemaHandler,
    Strict,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    WithJsonSchema,
    WrapValidator,
)
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema, core_schema

from frontend_svc.protocol.base import problem

INT32_MAX, UINT32_MAX = 2**31 - 1, 2**32 - 1  # the engine contract's integer types


# Below this a float holds every integer exactly; from it on, a float read from JSON may be an
# integer literal too long for 64 bits that the parser rounded (-2**63 - 1 reads as -2**63).
_EXACT_FLOAT_INTS = 2**53


def _integral(v: Any) -> Any:
    if type(v) is float and v.is_integer():
        if abs(v) >= _EXACT_FLOAT_INTS:
            raise problem(
                f"must be an integer this server reads exactly: {v:g} is beyond 64 bits, or "
                "written as a float of 2^53 or more"
            )
        return int(v)
    return v


# A list stops at its first bad item: a 4 MiB body of bad items must not cost one error each.
FAIL_FAST = Field(fail_fast=True)
Int = Annotated[int, Strict(), BeforeValidator(_integral)]
Float = Annotated[float, Strict()]  # ints too: every JSON number


# Booleans as vLLM reads them (pydantic's lax mode): besides true and false, the numbers 1 and 0
# (1.0 and 0.0 too) and these strings, in any case; nothing else (not " true", "2" or 0.5).
TRUE_WORDS = ("1", "t", "true", "y", "yes", "on")
FALSE_WORDS = ("0", "f", "false", "n", "no", "off")


def _words(words: tuple[str, ...]) -> str:
    """A pattern matching exactly ``words`` in any case (JSON Schema's regexes take no flags)."""
    any_case = ("".join(f"[{c}{c.upper()}]" if c.isalpha() else c for c in w) for w in words)
    return f"^({'|'.join(any_case)})$"


def _text(words: tuple[str, ...]) -> dict[str, Any]:
    # "not" a newline: Python's regexes (jsonschema's) let "$" match before a last "\n"
    return {"type": "string", "pattern": _words(words), "not": {"pattern": r"\n"}}


# JSON Schema of a value read as true, as false (for the rules across fields), and of a boolean.
TRUE: dict[str, Any] = {
    "anyOf": [{"const": True}, {"type": "integer", "const": 1}, _text(TRUE_WORDS)]
}
FALSE: dict[str, Any] = {
    "anyOf": [{"const": False}, {"type": "integer", "const": 0}, _text(FALSE_WORDS)]
}
_BOOLEAN = {
    "anyOf": [
        {"type": "boolean"},
        {"type": "integer", "minimum": 0, "maximum": 1},
        _text(TRUE_WORDS + FALSE_WORDS),
    ]
}
# pydantic's own lax bool: no Python runs; its failures read "must be a boolean"
Bool = Annotated[bool, WithJsonSchema(_BOOLEAN)]


# The integers a JSON body can carry here: what orjson reads as an int (beyond, a float that
# may have been rounded: refused by ``_integral``). An unbounded side of ``InRange`` is this.
JSON_INT_MIN, JSON_INT_MAX = -(2**63), 2**64 - 1


@dataclass(frozen=True)
class InRange:
    """An integer in ``[lo, hi]`` (None: as far as a JSON integer goes that way)."""

    lo: int | None = None
    hi: int | None = None

    def __get_pydantic_core_schema__(
        self, source: Any, handler: GetCoreSchemaHandler
    ) -> CoreSchema:
        lo = JSON_INT_MIN if self.lo is None else self.lo
        hi = JSON_INT_MAX if self.hi is None else self.hi

        def check(v: int) -> int:
            if lo <= v <= hi:
                return v
            raise problem(f"must be in {_interval(self.lo, self.hi)}, got {_shown(v)}")

        return core_schema.no_info_after_validator_function(check, handler(source))

    def __get_pydantic_json_schema__(
        self, schema: CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        out = handler(schema)
        out["minimum"] = JSON_INT_MIN if self.lo is None else self.lo
        out["maximum"] = JSON_INT_MAX if self.hi is None else self.hi
        return out


@dataclass(frozen=True)
class Float32Range:
    """A number in ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``) as the engine receives it: rounded
    to a 32-bit float, which must also be finite. The JSON schema's bounds are the exact doubles
    the server accepts (the rounding moves them off the round numbers: see ``format: float``)."""

    lo: float
    hi: float | None = None
    lo_open: bool = False

    def accepts(self, v: float) -> bool:
        f = _float32(v)
        if not math.isfinite(f):
            return False
        return (f > self.lo if self.lo_open else f >= self.lo) and (self.hi is None or f <= self.hi)

    def __get_pydantic_core_schema__(
        self, source: Any, handler: GetCoreSchemaHandler
    ) -> CoreSchema:
        least, most = _accepted_doubles(self)

        def check(v: float) -> float:
            if least <= v <= most:  # exactly the doubles accepts() takes, without the packing
                return float(v)
            raise problem(self._refusal(v))

        return core_schema.no_info_after_validator_function(check, handler(source))

    def __get_pydantic_json_schema__(
        self, schema: CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        least, most = _accepted_doubles(self)
        return {**handler(schema), "format": "float", "minimum": least, "maximum": most}

    def _refusal(self, v: float) -> str:
        shown = _shown(v)
        nominal = math.isfinite(v) and (v > self.lo if self.lo_open else v >= self.lo)
        if nominal and (self.hi is None or v <= self.hi):  # only the rounding puts it out
            shown += f" ({_float32(v)} as the 32-bit float the engine receives)"
        return f"must be in {_interval(self.lo, self.hi, self.lo_open)}, got {shown}"


def _float32(v: float) -> float:
    """``v`` rounded to the nearest 32-bit float, as the engine receives it; +-inf on overflow."""
    try:
        return float(struct.unpack("f", struct.pack("f", float(v)))[0])
    except OverflowError:
        return math.inf if v > 0 else -math.inf


@functools.cache
def _accepted_doubles(r: Float32Range) -> tuple[float, float]:
    """The least and the greatest double ``r`` accepts (it accepts every double between them:
    rounding is monotonic), found by bisection over the doubles in order."""
    inside = _ordinal(r.hi if r.hi is not None else r.lo if not r.lo_open else r.lo + 1)
    assert r.accepts(_double(inside))
    bottom, top = _ordinal(-math.inf), _ordinal(math.inf)
    lo, hi = bottom, inside  # lo refused, hi accepted
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if r.accepts(_double(mid)) else (mid, hi)
    least = hi
    lo, hi = inside, top  # lo accepted, hi refused
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if r.accepts(_double(mid)) else (lo, mid)
    return _double(least), _double(lo)


def _ordinal(x: float) -> int:
    """The doubles numbered in order (-0.0 and 0.0 alike)."""
    bits: int = struct.unpack("<q", struct.pack("<d", x))[0]
    return bits if bits >= 0 else -(bits & (2**63 - 1))


def _double(n: int) -> float:
    bits = n if n >= 0 else (-n) | (1 << 63)
    return float(struct.unpack("<d", struct.pack("<Q", bits))[0])


def _interval(lo: float | None, hi: float | None, lo_open: bool = False) -> str:
    opening, closing = "(" if lo_open else "[", ")" if hi is None else "]"
    return f"{opening}{_num(lo, '-inf')}, {_num(hi, 'inf')}{closing}"


def _num(x: float | None, unbounded: str) -> str:
    if x is None:
        return unbounded
    return str(x) if isinstance(x, int) else f"{x:g}"


def _shown(v: object) -> str:
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


@dataclass(frozen=True)
class LogprobCount:
    """A number of logprobs: at most the server's ``max_logprobs`` (given in the validation
    context), or -1 for the whole vocabulary (vLLM's), read as the context's ``vocab_size`` and
    allowed only when ``max_logprobs`` reaches it (the engine's ``--max-logprobs -1``)."""

    def __get_pydantic_core_schema__(
        self, source: Any, handler: GetCoreSchemaHandler
    ) -> CoreSchema:
        def check(v: int, info: ValidationInfo) -> int:
            context = info.context or {}
            limit, vocab = context.get("max_logprobs"), context.get("vocab_size")
            if v == -1:
                if vocab is None or (limit is not None and limit < vocab):
                    raise problem(
                        "may be -1 (the whole vocabulary) only when the server is started with "
                        f"--max-logprobs -1; this server returns at most {limit}"
                    )
                return int(vocab)
            if limit is not None and v > limit:
                raise problem(
                    f"must be at most {limit} (this server's max_logprobs), got {_shown(v)}"
                )
            return v

        return core_schema.with_info_after_validator_function(check, handler(source))


@dataclass(frozen=True)
class Says:
    """Any failure of the value it annotates is worded ``phrase`` (checked in pydantic-core:
    no Python runs on success)."""

    phrase: str

    def __get_pydantic_core_schema__(
        self, source: Any, handler: GetCoreSchemaHandler
    ) -> CoreSchema:
        return core_schema.custom_error_schema(
            handler(source),
            "tandem",
            custom_error_message="{phrase}",
            custom_error_context={"phrase": self.phrase},
        )


# A string with something besides whitespace: Python's whitespace (str.strip) is Unicode's
# plus \x1c-\x1f, spelled out so JSON Schema validators agree.
NON_BLANK = r"[^\s\x1c-\x1f]"
NonBlank = Annotated[str, Field(pattern=NON_BLANK), Says("must be a non-empty string")]

# Token ids: integers in the contract's uint32 (the vocabulary is checked where it is known).
TokenId = Annotated[int, Strict(), Field(ge=0, le=UINT32_MAX)]


# Longer lists are checked in Python, a slice at a time (see ``_long_token_ids``).
_LONG = 1 << 16


def _long_token_ids(v: list[Any]) -> tuple[int, ...] | None:
    """A long list of well-formed ids, checked slice by slice in Python: pydantic-core would
    hold the GIL for the whole list (~35 ns an id: 70 ms for the 1.9M ids a 4 MB body holds),
    stalling the event loop while a worker thread parses; Python code lets it in every few ms.
    None when something is off (pydantic then says what, or takes integral floats)."""
    for i in range(0, len(v), _LONG):
        part = v[i : i + _LONG]
        if not all(type(t) is int for t in part) or min(part) < 0 or max(part) > UINT32_MAX:
            return None
    return tuple(v)


def _token_ids(v: Any, handler: Callable[[Any], Any]) -> Any:
    if type(v) is list and len(v) > _LONG and (ids := _long_token_ids(v)) is not None:
        return ids
    try:
        return handler(v)  # the common case, in pydantic-core alone
    except ValidationError:
        if not isinstance(v, list) or not any(type(t) is float for t in v):
            raise
    return handler([_integral(t) for t in v])  # integral floats (1.0) are ids too


TokenIds = Annotated[
    tuple[TokenId, ...],
    FAIL_FAST,
    WrapValidator(_token_ids),
    Says("must be a list of token ids (integers >= 0)"),
]


def token_ids(v: object) -> tuple[int, ...] | None:
    """``v`` as token ids, or None if it is not a list of them (for hand-checked unions)."""
    try:
        return _TOKEN_IDS(v)
    except ValidationError:
        return None


_TOKEN_IDS: Callable[[object], tuple[int, ...]] = TypeAdapter(TokenIds).validate_python


@dataclass(frozen=True)
class StringList:
    """A list of strings with a count and a length limit (stop strings, bad words): what a
    request may ask the gateway or the engine to match on every step. ``single``: a lone
    string counts as a list of one; ``non_blank``: no string may be all whitespace. The value
    is a tuple, empty strings dropped, duplicates with ``unique``."""

    max_items: int
    max_chars: int
    noun: str  # what the items are called in messages: "strings", "words"
    single: bool = False
    non_blank: bool = False
    unique: bool = False

    def __get_pydantic_core_schema__(
        self, source: Any, handler: GetCoreSchemaHandler
    ) -> CoreSchema:
        return core_schema.no_info_plain_validator_function(self._validate)

    def __get_pydantic_json_schema__(
        self, schema: CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        item: dict[str, Any] = {"type": "string", "maxLength": self.max_chars}
        if self.non_blank:
            item["pattern"] = NON_BLANK
        many = {"type": "array", "items": item, "maxItems": self.max_items}
        return {"anyOf": [item, many]} if self.single else many

    def _validate(self, v: Any) -> tuple[str, ...]:
        items = [v] if self.single and isinstance(v, str) else v
        ok = isinstance(items, list) and all(
            isinstance(s, str) and (not self.non_blank or s.strip()) for s in items
        )
        if not ok:
            kind = "non-blank strings" if self.non_blank else "strings"
            raise problem(f"must be {'a string or ' if self.single else ''}a list of {kind}")
        longest = max(map(len, items), default=0)
        if len(items) > self.max_items or longest > self.max_chars:
            raise problem(
                f"may hold at most {self.max_items} {self.noun} of at most {self.max_chars} "
                f"characters each; got {len(items)} {self.noun}, the longest {longest} characters"
            )
        kept = (s for s in items if s)
        return tuple(dict.fromkeys(kept)) if self.unique else tuple(kept)


class LogitBias:
    """OpenAI's map of token id (a string of digits: JSON keys are strings) to a bias in
    [-limit, limit], read as ``((token, bias), ...)``."""

    def __init__(self, limit: int) -> None:
        self.limit = limit

    def __get_pydantic_core_schema__(
        self, source: Any, handler: GetCoreSchemaHandler
    ) -> CoreSchema:
        return core_schema.no_info_plain_validator_function(self._validate)

    def __get_pydantic_json_schema__(
        self, schema: CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        return {
            "type": "object",
            # at most 10 digits (a uint32's); the vocabulary is checked where it is known
            "propertyNames": {"pattern": "^[0-9]{1,10}$"},
            "additionalProperties": {
                "type": "number",
                "minimum": -self.limit,
                "maximum": self.limit,
            },
        }

    def _validate(self, v: Any) -> tuple[tuple[int, float], ...]:
        if not isinstance(v, dict):
            raise problem("must be an object of token id -> bias")
        out = []
        for key, bias in v.items():
            if not (isinstance(key, str) and _DIGITS.fullmatch(key)):
                raise problem(f"keys must be token ids (integers >= 0), got {_shown(key)}")
            token = int(key)  # past the vocabulary: refused where it is known
            number = isinstance(bias, (int, float)) and not isinstance(bias, bool)
            if not number or not -self.limit <= bias <= self.limit:
                raise problem(
                    f"values must be numbers in [-{self.limit}, {self.limit}], "
                    f"got {_shown(bias)} for token {token}"
                )
            out.append((token, float(bias)))
        return tuple(out)


_DIGITS = re.compile(r"[0-9]{1,10}")


def json_schema_object(v: Any) -> dict[str, Any]:
    """A JSON Schema given as an object or as its JSON text (vLLM takes both), as an object."""
    if isinstance(v, str):
        try:
            v = orjson.loads(v)
        except orjson.JSONDecodeError as e:
            raise problem(f"is not valid JSON: {e}") from e
    if not isinstance(v, dict):
        raise problem("must be a JSON Schema object")
    return v
