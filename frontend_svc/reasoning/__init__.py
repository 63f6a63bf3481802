"""Reasoning parsers, chosen by name (``--reasoning-parser``), named as vLLM names them.

``get_reasoning_parser(name)`` once at startup gives a stateless parser; per request,
``parser.for_request(...)`` says whether the output begins in reasoning and gives the tags' token
ids; its ``split(text)`` reads a whole output, its ``stream()`` per choice is fed each text delta.
The content, never the reasoning, goes on to the tool-call parser.
"""

from __future__ import annotations

from collections.abc import Callable

from frontend_svc.reasoning.base import (
    ReasoningDelta,
    ReasoningParser,
    ReasoningStream,
    RequestReasoning,
    prompt_ends_reasoning,
)
from frontend_svc.reasoning.think_tags import DeepSeekR1ReasoningParser, Qwen3ReasoningParser

_PARSERS: dict[str, Callable[[], ReasoningParser]] = {
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "qwen3": Qwen3ReasoningParser,
}
REASONING_PARSER_NAMES = tuple(_PARSERS)


def get_reasoning_parser(name: str) -> ReasoningParser:
    """The parser called ``name``; ValueError naming the valid ones otherwise."""
    factory = _PARSERS.get(name)
    if factory is None:
        raise ValueError(
            f"Unknown reasoning parser {name!r}; valid names: {', '.join(REASONING_PARSER_NAMES)}."
        )
    return factory()


__all__ = [
    "REASONING_PARSER_NAMES",
    "ReasoningDelta",
    "ReasoningParser",
    "ReasoningStream",
    "RequestReasoning",
    "get_reasoning_parser",
    "prompt_ends_reasoning",
]
