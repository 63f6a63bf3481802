"""The engine's refusal of a structured-output constraint, as a 400 naming the request field.

The request fields that ask for a constraint (``response_format``, ``structured_outputs``,
``guided_*``) are validated by the request models in ``frontend_svc.protocol``
(``protocol.structured``), which check only its shape. Whether it compiles is the engine's to
say, against the served tokenizer: its refusal is an INVALID_ARGUMENT whose message reads
``structured_output.<kind>: why``, and :func:`name_constraint_errors` turns it into a 400 naming
the field the client used.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import TypeVar

from frontend_svc.engine.errors import EngineRequestError
from frontend_svc.errors import invalid_parameter
from protos.types import EngineErrorCode

T = TypeVar("T")

# The contract's constraint kinds, as a 400 names them.
_WHAT = {
    "json_schema": "JSON schema",
    "json_object": "JSON object constraint",
    "regex": "regular expression",
    "choice": "choice list",
    "grammar": "grammar",
}
# The engine's message for a constraint that does not compile: "structured_output.<kind>: why".
_ENGINE_PREFIX = "structured_output"


async def name_constraint_errors(deltas: AsyncIterator[T], param: str) -> AsyncIterator[T]:
    """``deltas``, with the engine's refusal of the constraint turned into a 400 naming
    ``param`` (the field the client set)."""
    try:
        async with contextlib.aclosing(deltas):  # type: ignore[type-var]
            async for item in deltas:
                yield item
    except EngineRequestError as e:
        if e.code is not EngineErrorCode.INVALID_ARGUMENT or not e.message.startswith(
            _ENGINE_PREFIX
        ):
            raise
        head, _, detail = e.message.partition(": ")
        kind = head.partition(".")[2]
        what = _WHAT.get(kind, "structured output constraint")
        raise invalid_parameter(
            f"The {what} in '{param}' cannot be compiled: {detail or e.message}", param
        ) from e
