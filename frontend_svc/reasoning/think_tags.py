"""The ``<think>``…``</think>`` parsers, named as vLLM names them.

Both split as :mod:`frontend_svc.reasoning.base` describes (the start tag in the prompt or in the
output; no end tag: all reasoning). They differ in one thing: Qwen3's chat template turns thinking
off with ``chat_template_kwargs: {"enable_thinking": false}``, and then ``qwen3`` reads the whole
output as content, as vLLM's Qwen3 parser does. (Qwen3's own template also closes an empty think
block in the prompt then, which ends the reasoning for either parser.)

Not taken from vLLM's Qwen3 parser: its Qwen3.5 rule that ``<tool_call>`` followed by
``<function=`` ends the reasoning without ``</think>``. That call format is the ``qwen3_coder`` tool
parser's, which the gateway does not have; here such text stays reasoning until ``</think>``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from frontend_svc.reasoning.base import ReasoningParser


class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1 and its distills, QwQ: ``<think>`` in the prompt (newer templates) or in the
    output (older ones)."""

    name = "deepseek_r1"


class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3 (``<think>`` in the output) and Qwen3.5 (``<think>`` in the prompt); no reasoning
    when ``enable_thinking`` is false."""

    name = "qwen3"

    def thinking_enabled(self, template_kwargs: Mapping[str, Any]) -> bool:
        return template_kwargs.get("enable_thinking", True) is not False
