"""The request bodies of /v1/completions, /v1/chat/completions, /tokenize and /detokenize.

Every field the gateway takes, with its range and rules; what spans fields is checked by the
models' validators (and stated in their JSON schema where JSON Schema can say it). What needs
the served model (vocabulary, context length) is checked later, in
``generation.token_constraints``. ``/openapi.json`` is generated from these models.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

from pydantic import (
    AfterValidator,
    ConfigDict,
    Field,
    PlainValidator,
    WithJsonSchema,
    model_validator,
)
from pydantic.json_schema import SkipJsonSchema

from frontend_svc.errors import invalid_parameter
from frontend_svc.protocol.base import NOT_NULL, RequestModel, given, problem
from frontend_svc.protocol.fields import (
    INT32_MAX,
    TRUE,
    UINT32_MAX,
    Bool,
    Float,
    Float32Range,
    InRange,
    Int,
    LogitBias,
    LogprobCount,
    Says,
    StringList,
    TokenId,
    TokenIds,
    token_ids,
)
from frontend_svc.protocol.messages import ChatTemplateFields, Messages, ToolChoiceFields
from frontend_svc.protocol.requests import Prompt
from frontend_svc.protocol.structured import StructuredOutputFields

MAX_N = 128
# Choices of one completions call (prompts x n): each is an engine request and a detokenizer
# here, and an engine queues at most --max-waiting (1024 by default) anyway.
MAX_CHOICES = 1024
# Stop strings are matched against every new piece of text of every sequence, at a cost that grows
# with count x length (~1 us per stop string per token); OpenAI itself allows 4.
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_LOGIT_BIAS = 100  # OpenAI's range for a logit_bias value: [-100, 100]
# Each bad word becomes up to two token sequences the engine matches on every step (at most 256
# sequences per request on the contract).
MAX_BAD_WORDS = 128
MAX_BAD_WORD_CHARS = 256
StopStrings = Annotated[
    tuple[str, ...], StringList(MAX_STOP_STRINGS, MAX_STOP_STRING_CHARS, "strings", single=True)
]
BadWords = Annotated[
    tuple[str, ...],
    StringList(MAX_BAD_WORDS, MAX_BAD_WORD_CHARS, "words", non_blank=True, unique=True),
]
# -1: the whole vocabulary, where the server's --max-logprobs allows it (vLLM's).
Logprobs = Annotated[Int, InRange(-1), LogprobCount()]
Penalty = Annotated[Float, Float32Range(-2.0, 2.0)]
MaxTokens = Annotated[Int, InRange(1)]


def _not_zero(v: int) -> int:
    if v == 0:
        raise problem("must be -1 (as many as fit) or at least 1, got 0")
    return v


def _some_ids(ids: tuple[int, ...]) -> tuple[int, ...]:
    if not ids:
        raise problem("must not be empty (leave it out to allow every token)")
    return ids


def _nothing(v: Any) -> Any:
    if v not in ({}, [], ""):
        raise problem("is not supported")
    return v


def _prompts(v: Any) -> tuple[Prompt, ...]:
    if isinstance(v, str):
        return (v,)
    if isinstance(v, list) and v:
        if isinstance(v[0], (str, list)) and len(v) > MAX_CHOICES:
            raise problem(f"may hold at most {MAX_CHOICES} prompts, got {len(v)}")
        if all(isinstance(p, str) for p in v):
            return tuple(v)
        if not isinstance(v[0], list):  # one prompt of token ids
            ids = token_ids(v)
            if ids is not None:
                return (ids,)
        else:  # token-id prompts, up to the first that is not one
            prompts = []
            for p in v:
                ids = token_ids(p) if isinstance(p, list) and p else None
                if ids is None:
                    break
                prompts.append(ids)
            else:
                return tuple(prompts)
    raise problem(
        "must be a string, a list of strings, a list of token ids or a list of token-id lists, "
        "and not empty"
    )


def _non_empty(item: Any, most: int | None = None) -> Any:
    return Annotated[list[item], Field(min_length=1, max_length=most)]


_PROMPT_FORMS = (
    str
    | _non_empty(str, MAX_CHOICES)
    | _non_empty(TokenId)
    | _non_empty(_non_empty(TokenId), MAX_CHOICES)
)


class StreamOptions(RequestModel):
    """``stream_options`` (with ``stream`` only): the final usage chunk, usage on every chunk."""

    model_config = ConfigDict(extra="allow")  # any key counts as asking (vLLM's rule)
    null_is_absent: ClassVar[bool] = False

    include_usage: Bool | None = None
    continuous_usage_stats: Bool | None = Field(
        None, description="Usage on every chunk too (counted per choice), with include_usage."
    )

    def given(self) -> bool:
        return bool(self.model_fields_set or self.model_extra)


class GenerationBody(StructuredOutputFields):
    """The fields /v1/completions and /v1/chat/completions share: sampling, stopping,
    token constraints, streaming."""

    schema_rules: ClassVar[tuple[dict[str, Any], ...]] = (
        {
            "if": given("stream_options", {"type": "object", "minProperties": 1}),
            "then": given("stream", TRUE),
        },
    )

    model: str
    n: Annotated[Int, InRange(1, MAX_N)] = 1
    best_of: Annotated[Int, InRange(1, 1), Says("other than 1 is not supported")] | None = None
    min_tokens: Annotated[Int, InRange(0, UINT32_MAX)] = 0
    temperature: Annotated[Float, Float32Range(0.0)] | None = None
    top_p: Annotated[Float, Float32Range(0.0, 1.0, lo_open=True)] | None = None
    top_k: Annotated[Int, InRange(-1, INT32_MAX)] = Field(0, description="-1 or 0: no limit.")
    min_p: Annotated[Float, Float32Range(0.0, 1.0)] = 0.0
    seed: Annotated[Int, InRange(-(2**63), 2**63 - 1 - MAX_N)] | None = None
    stop: StopStrings = ()
    stop_token_ids: TokenIds = ()
    ignore_eos: Bool = False
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: Annotated[Float, Float32Range(0.0, 2.0, lo_open=True)] | None = None
    prompt_logprobs: Logprobs | None = Field(
        None,
        description="vLLM's: the logprobs of every prompt token with this many alternatives "
        "(choices[].prompt_logprobs in completions, a top-level prompt_logprobs in chat).",
    )
    include_stop_str_in_output: Bool = False
    skip_special_tokens: Bool = True
    # Token-level constraints (vLLM's), applied before penalties and temperature; token ids must
    # be in the model's vocabulary.
    logit_bias: Annotated[tuple[tuple[int, float], ...], LogitBias(MAX_LOGIT_BIAS)] = Field(
        (), json_schema_extra={"default": {}}
    )
    allowed_token_ids: (
        Annotated[TokenIds, AfterValidator(_some_ids), Field(json_schema_extra={"minItems": 1})]
        | None
    ) = None
    bad_words: BadWords = ()
    truncate_prompt_tokens: (
        Annotated[
            Int,
            InRange(-1),
            AfterValidator(_not_zero),
            Field(json_schema_extra={"not": {"const": 0}}),
        ]
        | None
    ) = Field(None, description="Keep the last k prompt tokens; -1: as many as fit.")
    functions: Annotated[
        Any,
        PlainValidator(_nothing),
        WithJsonSchema(
            {
                "anyOf": [
                    {"type": "array", "maxItems": 0},
                    {"type": "object", "maxProperties": 0},
                    {"const": ""},
                ]
            }
        ),
    ] = Field(None, description="Not supported (use tools).")
    stream: Bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: Bool = Field(
        False, description="vLLM's: the prompt's and the output's token ids."
    )
    return_tokens_as_token_ids: Bool | None = Field(
        None,
        description="vLLM's: logprob tokens written 'token_id:N' (default: the server's "
        "--return-tokens-as-token-ids).",
    )
    # vLLM's beam search (generation.beam_search): n beams instead of n samples. Left out of
    # /openapi.json: its rules against other fields (no stream, logprobs or constraint; n at most
    # half the server's max_logprobs) are the route's, which JSON Schema here cannot state.
    use_beam_search: SkipJsonSchema[Bool] = False
    length_penalty: SkipJsonSchema[Float] = 1.0

    @model_validator(mode="after")
    def _generation_rules(self) -> GenerationBody:
        if self.stream_options is not None and self.stream_options.given() and not self.stream:
            raise invalid_parameter(
                "'stream_options' is only allowed when 'stream' is true.", "stream_options"
            )
        self.structured_output()  # at most one
        return self

    def min_tokens_fit(self, max_tokens: int | None, max_tokens_param: str) -> None:
        if max_tokens is not None and self.min_tokens > max_tokens:
            raise invalid_parameter(
                f"'min_tokens' ({self.min_tokens}) must not exceed '{max_tokens_param}' "
                f"({max_tokens}).",
                "min_tokens",
            )


class CompletionBody(GenerationBody):
    """POST /v1/completions."""

    schema_rules: ClassVar[tuple[dict[str, Any], ...]] = (
        *GenerationBody.schema_rules,
        {"if": given("max_tokens", {"const": 0}), "then": given("echo", TRUE)},
    )

    prompt: Annotated[
        tuple[Prompt, ...], PlainValidator(_prompts, json_schema_input_type=_PROMPT_FORMS)
    ]
    suffix: (
        Annotated[
            str,
            Field(max_length=0),
            Says(
                "is not supported: this server has no fill-in-the-middle prompt format for the "
                "served model"
            ),
        ]
        | None
    ) = None
    echo: Bool = False
    max_tokens: Annotated[Int, InRange(0)] = Field(
        16, description="0 only with echo: the prompt is scored, nothing generated."
    )
    logprobs: Logprobs | None = None
    add_special_tokens: Bool = True

    @model_validator(mode="after")
    def _completion_rules(self) -> CompletionBody:
        if self.max_tokens == 0 and not self.echo:
            raise invalid_parameter(
                "'max_tokens' must be at least 1; 0 is only allowed with 'echo' (to score the "
                "prompt without generating).",
                "max_tokens",
            )
        self.min_tokens_fit(self.max_tokens, "max_tokens")
        if len(self.prompt) * self.n > MAX_CHOICES:
            raise invalid_parameter(
                f"A request may ask for at most {MAX_CHOICES} choices (prompts x n); this one "
                f"asks for {len(self.prompt)} x {self.n}.",
                "prompt",
            )
        return self


class ChatFields(GenerationBody, ChatTemplateFields, ToolChoiceFields):
    """What a chat body holds besides its messages (one conversation's, or a batch's)."""

    schema_rules: ClassVar[tuple[dict[str, Any], ...]] = (
        *GenerationBody.schema_rules,
        *ChatTemplateFields.schema_rules,
        *ToolChoiceFields.schema_rules,
        {"if": given("top_logprobs", NOT_NULL), "then": given("logprobs", TRUE)},
    )

    max_tokens: MaxTokens | None = Field(None, description="Default: the rest of the context.")
    max_completion_tokens: MaxTokens | None = Field(None, description="Wins over max_tokens.")
    logprobs: Bool = False
    top_logprobs: Logprobs | None = None
    echo: Bool = Field(
        False,
        description="The reply starts with the last message's content when its role is the "
        "reply's.",
    )

    @property
    def max_tokens_param(self) -> str:
        """Which name the client used, for error messages."""
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    @model_validator(mode="after")
    def _chat_rules(self) -> ChatFields:
        requested = self.max_completion_tokens
        self.min_tokens_fit(
            self.max_tokens if requested is None else requested, self.max_tokens_param
        )
        if self.top_logprobs is not None and not self.logprobs:
            raise invalid_parameter(
                "'top_logprobs' requires 'logprobs' to be true.", "top_logprobs"
            )
        if self.forces_calls():  # the output is the calls' JSON: no other constraint
            structured = self.structured_output()
            if structured is not None:
                raise invalid_parameter(
                    "You can only either use constraints for structured outputs or tools, not "
                    "both.",
                    structured[1],
                )
        return self


class ChatBody(ChatFields):
    """POST /v1/chat/completions."""

    messages: Messages


class TokenizeBody(ChatTemplateFields):
    """POST /tokenize: a prompt, or messages rendered by the chat template (vLLM's shape)."""

    schema_rules: ClassVar[tuple[dict[str, Any], ...]] = (
        *ChatTemplateFields.schema_rules,
        {"oneOf": [given("prompt", NOT_NULL), given("messages", NOT_NULL)]},
    )

    model: str | None = None
    prompt: str | None = None
    messages: Messages | None = None
    add_special_tokens: Bool | None = Field(
        None, description="Default: true for a prompt, false for messages (the template's)."
    )
    return_token_strs: Bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeBody:
        if (self.prompt is None) == (self.messages is None):
            raise invalid_parameter("Give exactly one of 'prompt' and 'messages'.", "prompt")
        return self


class DetokenizeBody(RequestModel):
    """POST /detokenize."""

    model: str | None = None
    tokens: TokenIds
