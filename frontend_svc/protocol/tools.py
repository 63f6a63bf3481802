"""The OpenAI tool fields of a chat request, once validated: :class:`ToolOptions`.

The request models in ``frontend_svc.protocol`` (``messages.ToolChoiceFields``) check ``tools``,
``tool_choice`` and ``parallel_tool_calls`` (400s naming the parameter, as vLLM and OpenAI
reject them) and build these options. The options then say which JSON schema structured outputs
must enforce (``required`` and named choices, built as vLLM builds it) and which parser turns
the output into tool calls: the server's ``--tool-call-parser`` for ``auto``; for ``required``
and named choices the output is that JSON itself, not parser markup.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from typing import Any, Literal

from frontend_svc.errors import invalid_parameter
from frontend_svc.tool_parsers import NamedFunctionParser, RequiredCallsParser, ToolParser

FUNCTION_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule for function names
ToolChoice = Literal["none", "auto", "required", "function"]
_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
_DEFINITION_KEYS = ("$defs", "definitions")  # where "$ref": "#/$defs/..." points


@dataclass(frozen=True)
class FunctionTool:
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema object
    strict: bool | None = None

    def to_openai(self) -> dict[str, Any]:
        """The tool as the chat template receives it (the request's own shape)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        if self.parameters is not None:
            function["parameters"] = self.parameters
        if self.strict is not None:
            function["strict"] = self.strict
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolOptions:
    tools: tuple[FunctionTool, ...] = ()
    choice: ToolChoice = "none"
    function_name: str | None = None  # the function a named choice forces
    parallel_tool_calls: bool = True

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The chat template's ``tools`` variable (None without tools; given even with
        ``tool_choice: "none"``, as vLLM does)."""
        return [t.to_openai() for t in self.tools] or None

    def json_schema(self) -> dict[str, Any] | None:
        """The schema structured outputs must enforce, or None (``none`` and ``auto``)."""
        if self.choice == "function":
            return copy.deepcopy(self._tool(self.function_name).parameters or _EMPTY_PARAMETERS)
        if self.choice != "required":
            return None
        branches: list[dict[str, Any]] = []
        definitions: dict[str, dict[str, Any]] = {}
        for tool in self.tools:
            parameters = copy.deepcopy(tool.parameters or _EMPTY_PARAMETERS)
            for key in _DEFINITION_KEYS:
                for def_name, definition in (parameters.pop(key, None) or {}).items():
                    if definitions.setdefault(f"{key}/{def_name}", definition) != definition:
                        raise invalid_parameter(
                            f"Tools define '{key}/{def_name}' differently; with tool_choice "
                            "'required' their definitions are merged, so they must agree.",
                            "tools",
                        )
            branches.append(
                {
                    "properties": {
                        "name": {"type": "string", "enum": [tool.name]},
                        "parameters": parameters,
                    },
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                }
            )
        schema: dict[str, Any] = {
            "type": "array",
            "minItems": 1,
            "items": {"type": "object", "anyOf": branches},
        }
        if not self.parallel_tool_calls:
            schema["maxItems"] = 1
        for path, merged in definitions.items():
            key, _, def_name = path.partition("/")
            schema.setdefault(key, {})[def_name] = merged
        return schema

    def output_parser(self, auto_parser: ToolParser | None) -> ToolParser | None:
        """What turns this request's output into tool calls: None for ``none``."""
        if self.choice == "function":
            assert self.function_name is not None
            return NamedFunctionParser(self.function_name)
        if self.choice == "required":
            return RequiredCallsParser()
        if self.choice == "auto":
            return auto_parser
        return None

    def _tool(self, name: str | None) -> FunctionTool:
        return next(t for t in self.tools if t.name == name)
