"""Tool-call parsers, chosen by name (``--tool-call-parser``), named as vLLM names them.

``get_tool_parser(name)`` once at startup gives a stateless parser; ``parser.extract(text)`` reads
a whole output (``ExtractedToolCalls``); when streaming, ``parser.stream()`` per choice is fed each
text delta (``feed(delta)``, the last one with ``final=True``) and answers a ``StreamDelta``.
"""

from __future__ import annotations

from collections.abc import Callable

from frontend_svc.tool_parsers.base import (
    RANDOM_IDS,
    CallIds,
    ExtractedToolCalls,
    StreamDelta,
    ToolCall,
    ToolCallDelta,
    ToolCallStream,
    ToolParser,
    collect_tool_calls,
    make_tool_call_id,
)
from frontend_svc.tool_parsers.constrained import NamedFunctionParser, RequiredCallsParser
from frontend_svc.tool_parsers.hermes import HermesToolParser
from frontend_svc.tool_parsers.llama3_json import Llama3JsonToolParser
from frontend_svc.tool_parsers.pythonic import PythonicToolParser

_PARSERS: dict[str, Callable[[], ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "llama4_json": Llama3JsonToolParser,  # vLLM's alias: the same format
    "pythonic": PythonicToolParser,
    "llama4_pythonic": PythonicToolParser,  # pythonic between <|python_start|>/<|python_end|>
}
TOOL_PARSER_NAMES = tuple(_PARSERS)


def get_tool_parser(name: str) -> ToolParser:
    """The parser called ``name``; ValueError naming the valid ones otherwise."""
    factory = _PARSERS.get(name)
    if factory is None:
        raise ValueError(
            f"Unknown tool-call parser {name!r}; valid names: {', '.join(TOOL_PARSER_NAMES)}."
        )
    return factory()


__all__ = [
    "RANDOM_IDS",
    "TOOL_PARSER_NAMES",
    "CallIds",
    "ExtractedToolCalls",
    "NamedFunctionParser",
    "RequiredCallsParser",
    "StreamDelta",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallStream",
    "ToolParser",
    "collect_tool_calls",
    "get_tool_parser",
    "make_tool_call_id",
]
