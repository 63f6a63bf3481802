"""Tool calls from output that structured outputs constrained (``tool_choice`` required or named).

No markup here: for a named function the whole output is that call's arguments; for "required"
it is a JSON array ``[{"name": ..., "parameters": {...}}, ...]`` (the schema
``frontend_svc.protocol.tools`` builds), and each element is one call whose arguments are its
"parameters" text.
"""

from __future__ import annotations

from frontend_svc.tool_parsers.base import ToolCallStream, ToolParser
from frontend_svc.tool_parsers.json_scan import CallObjectScanner, skip_ws


class NamedFunctionParser(ToolParser):
    """``tool_choice: {"type": "function", "function": {"name": ...}}``: one call, the output is
    its arguments (verbatim, as vLLM sends them)."""

    name = "named_function"

    def __init__(self, function_name: str) -> None:
        self.function_name = function_name

    def stream(self, *, strict: bool = False) -> NamedFunctionStream:
        return NamedFunctionStream(self.function_name, strict=strict)


class NamedFunctionStream(ToolCallStream):
    def __init__(self, function_name: str, *, strict: bool = False) -> None:
        super().__init__(strict=strict)
        self._function_name = function_name

    def _consume(self, text: str, final: bool) -> None:
        if self._next_index == 0:
            self._announce(self._function_name)
        self._emit_arguments(text)


_START, _ITEM_FIRST, _ITEM, _OBJECT, _AFTER_ITEM, _TAIL, _CONTENT = range(7)


class RequiredCallsParser(ToolParser):
    """``tool_choice: "required"``: a JSON array of ``{"name", "parameters"}`` objects."""

    name = "required"

    def stream(self, *, strict: bool = False) -> RequiredCallsStream:
        return RequiredCallsStream(strict=strict)


class RequiredCallsStream(ToolCallStream):
    def __init__(self, *, strict: bool = False) -> None:
        super().__init__(strict=strict)
        self._open_unit()  # the whole array is the unit
        self._state = _START
        self._obj = CallObjectScanner(("parameters", "arguments"))

    def _consume(self, text: str, final: bool) -> None:
        pos, n = 0, len(text)
        while pos < n:
            state = self._state
            if state == _CONTENT:
                self._emit_content(text[pos:])
                break
            if state == _OBJECT:
                pos, failed = self._feed_call_object(self._obj, text, pos)
                if failed:
                    self._fail(text, pos)
                    break
                if self._obj.done:
                    self._state = _AFTER_ITEM
                continue
            j = skip_ws(text, pos)
            self._keep_raw(text[pos:j])
            pos = j
            if j == n:
                break
            c = text[j]
            if state == _START and c == "[":
                self._state = _ITEM_FIRST
            elif (state == _ITEM_FIRST or state == _ITEM) and c == "{":
                self._obj = CallObjectScanner(("parameters", "arguments"))
                self._state = _OBJECT
                continue  # the scanner reads the "{"
            elif (state == _ITEM_FIRST and c == "]") or (state == _AFTER_ITEM and c == "]"):
                self._state = _TAIL
            elif state == _AFTER_ITEM and c == ",":
                self._state = _ITEM
            else:
                self._fail(text, j)
                break
            self._keep_raw(c)
            pos = j + 1
        if final:
            if self._state == _TAIL:
                self._close_unit()
            elif self._state != _CONTENT:
                self._fail_unit()
                self._state = _CONTENT

    def _fail(self, text: str, pos: int) -> None:
        self._fail_unit()
        self._state = _CONTENT
        self._emit_content(text[pos:])
