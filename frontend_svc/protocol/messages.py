"""Chat messages, OpenAI's tool fields (``tools``, ``tool_choice``) and the chat template's
options, as request models (the parts chat and /tokenize share).

A message reaches the chat template as the client wrote it (any role, extra keys kept: the
template decides what it makes of them), with its content flattened to text and its tool calls'
``arguments`` parsed from JSON text (templates write them back with ``tojson``, as vLLM does).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, PlainValidator, ValidationInfo, field_validator, model_validator

from frontend_svc.errors import invalid_parameter
from frontend_svc.protocol.base import RequestModel, given, problem
from frontend_svc.protocol.fields import FAIL_FAST, FALSE, TRUE, Bool, Says
from frontend_svc.protocol.tools import FUNCTION_NAME, FunctionTool, ToolChoice, ToolOptions

FunctionName = Annotated[
    str,
    Field(pattern=f"^{FUNCTION_NAME.pattern}$"),
    Says("must be 1 to 64 characters of a-z, A-Z, 0-9, '_' and '-'"),
]


class TextPart(RequestModel):
    """A part of a message's content: text only (this model takes no other input)."""

    type: Annotated[Literal["text"], Says("must be 'text': this model takes no input but text")]
    text: str


def call_arguments(v: Any) -> Any:
    """A call's ``arguments`` as the template gets them: JSON text parsed (null or "": {}), an
    object or list as it is; anything else a validation failure (chat and Responses items)."""
    if v is None or v == "":
        return {}
    if isinstance(v, str):
        try:
            return json.loads(v)
        except (ValueError, RecursionError) as e:
            raise problem(f"is not valid JSON: {e}") from e
    if not isinstance(v, (dict, list)):
        raise problem("must be a JSON text (or object)")
    return v


class CalledFunction(RequestModel):
    name: str
    # JSON text (parsed for the template), or already an object; null or "": {}
    arguments: Annotated[
        Any,
        PlainValidator(call_arguments, json_schema_input_type=str | dict[str, Any] | list[Any]),
    ] = Field(default_factory=dict)


class ToolCall(RequestModel):
    """A call an assistant message made (the conversation so far)."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class Message(RequestModel):
    """One chat message. Any role goes to the chat template (vLLM's rule)."""

    role: Annotated[str, Field(min_length=1)]
    content: str | Annotated[list[TextPart], FAIL_FAST] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: Annotated[list[ToolCall], FAIL_FAST] | None = None

    def template_message(self, raw: dict[str, Any]) -> dict[str, Any]:
        """The message as the template gets it: ``raw`` (the client's own object) with the
        content as one string and the calls' arguments parsed."""
        message = dict(raw)
        content = self.content
        message["content"] = (
            content if isinstance(content, str) else "\n".join(p.text for p in content or ())
        )
        if self.tool_calls is None:
            message.pop("tool_calls", None)
        else:
            message["tool_calls"] = [
                {**call, "function": {**call["function"], "arguments": parsed.function.arguments}}
                for call, parsed in zip(raw["tool_calls"], self.tool_calls, strict=True)
            ]
        return message


Messages = Annotated[list[Message], Field(min_length=1), FAIL_FAST]


class FunctionDefinition(RequestModel):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="A JSON Schema object.")
    strict: Bool | None = None


class Tool(RequestModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition

    def domain(self) -> FunctionTool:
        f = self.function
        return FunctionTool(f.name, f.description, f.parameters, f.strict)


class Tools(RequestModel):
    """Where ``tools`` is declared (chat and /tokenize): the list, its names unique."""

    tools: Annotated[list[Tool], FAIL_FAST] | None = Field(
        None, description="Functions the model may call (each name once)."
    )

    @field_validator("tools")
    @classmethod
    def _unique_names(cls, tools: list[Tool] | None) -> list[Tool] | None:
        seen: set[str] = set()
        for tool in tools or ():
            if tool.function.name in seen:
                raise problem(f"has two functions named '{tool.function.name}'")
            seen.add(tool.function.name)
        return tools

    def function_tools(self) -> tuple[FunctionTool, ...]:
        return tuple(t.domain() for t in self.tools or ())


class NamedFunction(RequestModel):
    name: FunctionName


class NamedToolChoice(RequestModel):
    """A choice that forces one function of ``tools``."""

    type: Literal["function"]
    function: NamedFunction


class ToolChoiceFields(Tools):
    """The tools of a chat request and how the model must use them."""

    schema_rules: ClassVar[tuple[dict[str, Any], ...]] = (
        {
            "if": given("tool_choice", {"not": {"enum": ["none", None]}}),
            "then": given("tools", {"type": "array"}),
        },
        {
            "if": given("tool_choice", {"const": "required"}),
            "then": given("tools", {"minItems": 1}),
        },
    )

    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="Default: 'auto' with tools, else 'none'."
    )
    parallel_tool_calls: Bool = True

    @model_validator(mode="after")
    def _tool_rules(self, info: ValidationInfo) -> ToolChoiceFields:
        self.tool_options((info.context or {}).get("auto_tools", False))
        return self

    def forces_calls(self) -> bool:
        """Whether the output must be tool calls (``required`` or a named function)."""
        return self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)

    def tool_options(self, auto_supported: bool) -> ToolOptions:
        """The tool fields as :class:`ToolOptions`. ``auto_supported``: the server reads calls
        the model chose to make (``--tool-call-parser``); without it, tools with choice
        "auto" (the default with tools) are a 400, as in vLLM."""
        tools = self.function_tools()
        raw, name = self.tool_choice, None
        choice: ToolChoice
        if raw is None:
            choice = "auto" if tools else "none"
        elif isinstance(raw, NamedToolChoice):
            choice, name = "function", raw.function.name
        else:
            choice = raw
        if choice != "none" and self.tools is None:
            raise invalid_parameter("'tool_choice' needs 'tools'.", "tool_choice")
        if choice == "required" and not tools:
            raise invalid_parameter(
                "'tool_choice' 'required' needs at least one tool in 'tools'.", "tool_choice"
            )
        if choice == "function" and all(t.name != name for t in tools):
            raise invalid_parameter(
                f"'tool_choice' names the function '{name}', which is not in 'tools'.",
                "tool_choice",
            )
        if choice == "auto" and not tools:
            choice = "none"  # "tools": [] with "auto": nothing to call
        if choice == "auto" and not auto_supported:
            raise invalid_parameter(
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to '
                "be set (the default when a request has tools); use 'none', 'required' or a "
                "named function.",
                "tool_choice",
            )
        return ToolOptions(tools, choice, name, self.parallel_tool_calls)


class ChatTemplateFields(Tools):
    """What the chat template gets besides the messages (chat and /tokenize)."""

    schema_rules: ClassVar[tuple[dict[str, Any], ...]] = (
        {
            "if": given("continue_final_message", TRUE),
            "then": given("add_generation_prompt", FALSE),
        },
    )

    add_generation_prompt: Bool = True
    continue_final_message: Bool = Field(
        False,
        description="The prompt ends inside the last message, which the reply continues "
        "(needs add_generation_prompt false).",
    )
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _template_rules(self) -> ChatTemplateFields:
        if self.add_generation_prompt and self.continue_final_message:
            raise invalid_parameter(
                "Cannot set both 'continue_final_message' and 'add_generation_prompt' to true "
                "(set 'add_generation_prompt' to false to continue the final message).",
                "continue_final_message",
            )
        return self
