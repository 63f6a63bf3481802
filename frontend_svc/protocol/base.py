"""The base of every request-body model, and pydantic's errors turned into OpenAI-style 400s.

Two rules hold for every body (as the hand-written gateway had them, and as OpenAI clients
expect): unknown fields are ignored, and a JSON ``null`` means "not given" (the field's
default). The JSON schema says both: no ``additionalProperties``, and every optional property
also takes ``null``.

A validation failure becomes one 400 whose ``param`` is the top-level field and whose message
names the exact place (``'messages[1].tool_calls[0].function.name' is required.``). Validators
raise :func:`problem` for a message of their own; a rule that spans fields raises the
:class:`~frontend_svc.errors.ApiError` itself (pydantic lets it through unchanged).
"""

from __future__ import annotations

import re
from typing import Any, ClassVar, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator
from pydantic_core import PydanticCustomError

from frontend_svc.errors import ApiError, invalid_parameter

M = TypeVar("M", bound=BaseModel)
PROBLEM = "tandem"  # the error type of problem(); its message is the phrase after the place


def problem(phrase: str) -> PydanticCustomError:
    """A validation failure worded by the validator: ``phrase`` follows the place it happened,
    as in ``'stop' <phrase>.``"""
    return PydanticCustomError(PROBLEM, "{phrase}", {"phrase": phrase})


NOT_NULL: dict[str, Any] = {"not": {"type": "null"}}


def given(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    """JSON Schema of a rule: ``name`` is given (not null) and matches ``schema``."""
    return {"required": [name], "properties": {name: schema}}


def _schema_extra(schema: dict[str, Any], model: type[BaseModel]) -> None:
    """``null`` is "not given": every property that is not required also takes it. Then the
    model's ``schema_rules`` (what its validators check across fields, where JSON Schema can
    say it)."""
    required = set(schema.get("required", ()))
    for name, prop in schema.get("properties", {}).items():
        if name in required or _allows_null(prop):
            continue
        outer = {k: prop.pop(k) for k in ("title", "description", "default") if k in prop}
        schema["properties"][name] = {"anyOf": [prop, {"type": "null"}], **outer}
    rules = getattr(model, "schema_rules", ())
    if rules:
        schema["allOf"] = [*schema.get("allOf", ()), *rules]


def _allows_null(prop: dict[str, Any]) -> bool:
    kind = prop.get("type")
    return (
        kind == "null"
        or (isinstance(kind, list) and "null" in kind)
        or any(_allows_null(p) for p in prop.get("anyOf", ()))
    )


class RequestModel(BaseModel):
    """A request body (or part of one): extra fields ignored, ``null`` read as absent."""

    model_config = ConfigDict(extra="ignore", json_schema_extra=_schema_extra)
    # What the validators check across fields, where JSON Schema can say it (if/then, ...):
    # each one an entry of the schema's allOf. A subclass adds to its base's.
    schema_rules: ClassVar[tuple[dict[str, Any], ...]] = ()
    null_is_absent: ClassVar[bool] = True  # False: a null reaches the field (which takes None)

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data: Any) -> Any:
        if cls.null_is_absent and type(data) is dict and None in data.values():
            return {k: v for k, v in data.items() if v is not None}
        return data


def validate(model: type[M], body: object, context: dict[str, Any] | None = None) -> M:
    """``body`` as a ``model``, or a 400 naming the first thing wrong with it."""
    try:
        return model.model_validate(body, context=context)
    except ValidationError as e:
        raise api_error(e) from None


def api_error(e: ValidationError) -> ApiError:
    """The first failure of a validation as an OpenAI-style 400 (no pydantic wording or URL)."""
    errors = e.errors(include_url=False)
    first = errors[0]
    loc = first["loc"]
    if not loc:
        if first["type"] in ("model_type", "dict_type", "model_attributes_type"):
            return invalid_parameter("The request body must be a JSON object.", None)
        return invalid_parameter(_phrase(first).capitalize() + ".", None)
    # Where a union failed, pydantic reports each of its members under a label of the member
    # (not a field name); the member that got furthest is the one the client meant.
    label = next((i for i, part in enumerate(loc) if _is_label(part)), None)
    if label is not None:
        group = [
            err
            for err in errors
            if err["loc"][:label] == loc[:label]
            and len(err["loc"]) > label
            and _is_label(err["loc"][label])
        ]
        deepest = max(len(err["loc"]) for err in group)
        if deepest > label + 1:
            first = next(err for err in group if len(err["loc"]) == deepest)
        else:  # the value is none of the member types: "must be a string or a list"
            kinds = [_phrase(err).removeprefix("must be ") for err in group]
            kinds = list(dict.fromkeys(k for kind in kinds for k in _OR.split(kind)))
            listed = ", ".join(kinds[:-1]) + " or " + kinds[-1] if len(kinds) > 1 else kinds[0]
            return _error(loc[:label], "must be " + listed)
    return _error(first["loc"], _phrase(first))


def _error(loc: tuple[int | str, ...], phrase: str) -> ApiError:
    parts = [p for p in loc if not _is_label(p)]
    where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in parts).lstrip(".")
    param = parts[0] if parts and isinstance(parts[0], str) else None
    end = "" if phrase.endswith(".") else "."
    return invalid_parameter(f"'{where}' {phrase}{end}", param)


def _is_label(part: int | str) -> bool:
    """Whether a location part names a union member: pydantic labels them by type (``str``,
    ``list[TextPart]``, ``literal['none','auto']``, a model's class name), never as a field."""
    return isinstance(part, str) and (
        part[:1].isupper() or not part.isidentifier() or part in _TYPES
    )


_OR = re.compile(r", | or ")  # between the values of pydantic's "'a', 'b' or 'c'"
_TYPES = frozenset({"str", "int", "float", "bool", "none", "dict", "list", "tuple"})
_TYPE_PHRASES = {
    "missing": "is required",
    "model_type": "must be an object",
    "model_attributes_type": "must be an object",
    "dict_type": "must be an object",
    "string_type": "must be a string",
    "bool_type": "must be a boolean",
    "bool_parsing": "must be a boolean",
    "int_type": "must be an integer",
    "int_from_float": "must be an integer",
    "int_parsing": "must be an integer",
    "float_type": "must be a number",
    "float_parsing": "must be a number",
    "list_type": "must be a list",
    "tuple_type": "must be a list",
    "none_required": "must be null",
}


def _phrase(error: Any) -> str:
    kind, ctx = error["type"], error.get("ctx") or {}
    if kind == PROBLEM:
        return str(ctx["phrase"])
    if kind in _TYPE_PHRASES:
        return _TYPE_PHRASES[kind]
    if kind == "literal_error":
        return f"must be {ctx['expected']}"
    if kind == "string_too_short":
        n = ctx["min_length"]
        return "must be a non-empty string" if n == 1 else f"must be at least {n} characters long"
    if kind == "string_too_long":
        return f"must be at most {ctx['max_length']} characters long"
    if kind == "too_short":
        n = ctx["min_length"]
        return "must not be empty" if n == 1 else f"must hold at least {n} items"
    if kind == "too_long":
        return f"must hold at most {ctx['max_length']} items, got {ctx.get('actual_length')}"
    if kind == "string_pattern_mismatch":
        return f"must match the pattern {ctx['pattern']}"
    if kind in ("value_error", "assertion_error"):
        return str(ctx.get("error", error["msg"]))
    return f"is invalid: {error['msg']}"
