"""Request bodies of the pooling routes as pydantic v2 models: /v1/embeddings, /pooling,
/classify, /score and /rerank, in the shapes OpenAI, vLLM, Jina and Cohere clients send.

They follow the generation routes' rules (``frontend_svc.protocol.base.RequestModel``): unknown
fields are ignored and a JSON null means "not given"; the ranges the server enforces are in the
models, so their JSON schemas document them. ``parse_*`` turn a JSON body into a model or raise
an OpenAI-style 400 naming the parameter. What needs the served model (context length,
vocabulary, Matryoshka dimensions, served tasks) is checked by the routes.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, TypeVar

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictInt,
    StrictStr,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from frontend_svc.errors import ApiError, invalid_parameter
from frontend_svc.protocol.base import RequestModel, api_error
from frontend_svc.protocol.fields import Bool

# Inputs (texts, or token-id prompts) in one request: OpenAI's limit for embeddings, applied
# to every pooling route (each side of a score request, the documents of a rerank request).
MAX_INPUTS = 2048
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


class ParamError(ValueError):
    """A validation failure that names its parameter (raised inside validators)."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


def _integer(v: Any) -> Any:
    """Integers, and floats with an integral value (what the generation routes accept too);
    not booleans, strings or 2.5."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError("must be an integer")
    if isinstance(v, float):
        if not v.is_integer():
            raise ValueError(f"must be an integer, got {v}")
        return int(v)
    return v


def _truncation(v: Any) -> Any:
    v = _integer(v)
    if v == 0 or v < -1:
        raise ParamError(
            "'truncate_prompt_tokens' must be -1 (the context length) or at least 1.",
            "truncate_prompt_tokens",
        )
    return v


# Integer fields (constraints before the validator, so the JSON schema states them).
Dimensions = Annotated[int, Field(ge=1), BeforeValidator(_integer)]
TopN = Annotated[int, Field(ge=0), BeforeValidator(_integer)]
Priority = Annotated[int, Field(ge=INT32_MIN, le=INT32_MAX), BeforeValidator(_integer)]
Truncation = Annotated[
    int,
    BeforeValidator(_truncation),
    WithJsonSchema({"anyOf": [{"type": "integer", "minimum": 1}, {"const": -1}]}),
]
TokenId = Annotated[StrictInt, Field(ge=0)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
Text = Annotated[StrictStr, Field(min_length=1)]
PoolingInput = (
    Text
    | Annotated[list[Text], Field(min_length=1, max_length=MAX_INPUTS)]
    | TokenIds
    | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_INPUTS)]
)
ScoreInput = Text | Annotated[list[Text], Field(min_length=1, max_length=MAX_INPUTS)]
PoolingTaskName = Literal["embed", "classify", "score"]

_INPUT_SHAPE = (
    "'{name}' must be a string, an array of strings, an array of token ids (integers >= 0) or "
    "an array of arrays of token ids."
)


def _check_sizes(value: Any, name: str, token_ids: bool) -> None:
    """Clear messages for the size limits, before the type is checked."""
    if isinstance(value, str) and not value:
        raise ParamError(f"'{name}' must not be an empty string.", name)
    if not isinstance(value, list):
        return
    if not value:
        raise ParamError(f"'{name}' must not be empty.", name)
    if token_ids and not isinstance(value[0], (str, list)):
        return  # one prompt's token ids: its length is checked against the context
    if len(value) > MAX_INPUTS:
        raise ParamError(
            f"'{name}' holds {len(value)} items; at most {MAX_INPUTS} are accepted in one request.",
            name,
        )
    for i, item in enumerate(value):
        if isinstance(item, (str, list)) and not item:
            raise ParamError(f"'{name}[{i}]' must not be empty.", name)


def _integral_ids(value: Any) -> Any:
    """Token ids written as integral floats (1.0) turned into ints; anything else unchanged."""

    def fix(v: Any) -> Any:
        if isinstance(v, float) and v.is_integer():
            return int(v)
        if isinstance(v, list):
            return [fix(x) for x in v]
        return v

    return fix(value) if isinstance(value, list) else value


def _validate_input(value: Any, handler: ValidatorFunctionWrapHandler, name: str) -> Any:
    _check_sizes(value, name, token_ids=True)
    try:
        return handler(value)  # the common case: the types checked in pydantic-core only
    except ValidationError:
        pass
    try:
        return handler(_integral_ids(value))
    except ValidationError:
        raise ParamError(_INPUT_SHAPE.format(name=name), name) from None


def _validate_texts(value: Any, handler: ValidatorFunctionWrapHandler, name: str) -> Any:
    _check_sizes(value, name, token_ids=False)
    try:
        return handler(value)
    except ValidationError:
        raise ParamError(f"'{name}' must be a string or an array of strings.", name) from None


class _Body(RequestModel):
    model_config = ConfigDict(frozen=True)


class _PoolingBody(_Body):
    """What every pooling request has."""

    model: StrictStr | None = Field(None, description="The served model's name.")
    user: StrictStr | None = Field(None, description="Ignored (OpenAI's end-user id).")
    truncate_prompt_tokens: Truncation | None = Field(
        None,
        description=(
            "Cut each prompt to its first N tokens (the special tokens the tokenizer adds at "
            "the end are kept); -1: the context length. Without it a prompt longer than the "
            "context is refused."
        ),
    )
    priority: Priority = Field(
        0, description="Scheduling priority under the engine's priority policy (lower first)."
    )


class _InputBody(_PoolingBody):
    input: PoolingInput = Field(
        description=(
            "A text, an array of texts, a prompt as token ids, or an array of token-id prompts "
            f"(at most {MAX_INPUTS} prompts)."
        ),
    )
    add_special_tokens: Bool = Field(
        True, description="Add the tokenizer's special tokens (BOS, ...) to text inputs."
    )

    @field_validator("input", mode="wrap")
    @classmethod
    def _input(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        return _validate_input(value, handler, "input")


class _ActivationFields(_Body):
    """vLLM's three spellings of "apply the classifier's softmax / sigmoid"."""

    use_activation: Bool | None = Field(
        None, description="Apply the activation (softmax, or sigmoid with one label). Default on."
    )
    activation: Bool | None = Field(None, description="Older name of use_activation.")
    softmax: Bool | None = Field(None, description="Older name of use_activation.")

    @property
    def resolved_activation(self) -> bool | None:
        """The first one given (vLLM's order: softmax, activation, use_activation)."""
        for v in (self.softmax, self.activation, self.use_activation):
            if v is not None:
                return v
        return None


class EmbeddingRequest(_InputBody):
    """POST /v1/embeddings (OpenAI's shape, plus vLLM's extra fields)."""

    encoding_format: Literal["float", "base64"] = Field(
        "float",
        description="'base64': each embedding as base64 of its little-endian float32 values.",
    )
    dimensions: Dimensions | None = Field(
        None,
        description=(
            "Keep the first N values (Matryoshka models only; at most the embedding size, and "
            "one of the model's trained dimensions when it lists them)."
        ),
    )
    normalize: Bool | None = Field(None, description="L2-normalize (default on).")
    use_activation: Bool | None = Field(
        None, description="Newer vLLM's name of normalize for embeddings."
    )

    @property
    def resolved_normalize(self) -> bool | None:
        return self.normalize if self.normalize is not None else self.use_activation


class PoolingRequest(EmbeddingRequest, _ActivationFields):
    """POST /pooling (vLLM's): the raw pooled output of the task (an embedding, the label
    values, or the score); use_activation means normalize for 'embed'."""

    task: PoolingTaskName | None = Field(
        None,
        description="The pooling task; default 'embed' when the model serves it, else 'classify'.",
    )


class ClassificationRequest(_InputBody, _ActivationFields):
    """POST /classify (vLLM's)."""


_SCORE_PAIRS: tuple[tuple[str, str], ...] = (
    ("text_1", "text_2"),
    ("queries", "documents"),
    ("queries", "items"),
    ("data_1", "data_2"),
)


class ScoreRequest(_PoolingBody, _ActivationFields):
    """POST /score and /v1/score (vLLM's): relevance of text pairs, 1:1, 1:N or N:N, under any
    of vLLM's names for the two sides (text_1 / text_2, queries / documents, queries / items,
    data_1 / data_2)."""

    schema_rules: ClassVar[tuple[dict[str, Any], ...]] = (
        {"anyOf": [{"required": [a, b]} for a, b in _SCORE_PAIRS]},
    )

    text_1: ScoreInput | None = Field(None, description="The first text(s): 1 or N.")
    text_2: ScoreInput | None = Field(None, description="The second text(s): N, 1 when 1:1.")
    queries: ScoreInput | None = Field(None, description="Another name of text_1.")
    documents: ScoreInput | None = Field(None, description="Another name of text_2.")
    items: ScoreInput | None = Field(None, description="Another name of text_2.")
    data_1: ScoreInput | None = Field(None, description="Another name of text_1.")
    data_2: ScoreInput | None = Field(None, description="Another name of text_2.")

    @field_validator(
        "text_1", "text_2", "queries", "documents", "items", "data_1", "data_2", mode="wrap"
    )
    @classmethod
    def _texts(cls, value: Any, handler: ValidatorFunctionWrapHandler, info: ValidationInfo) -> Any:
        name = info.field_name or "text_1"
        return value if value is None else _validate_texts(value, handler, name)

    @model_validator(mode="after")
    def _one_pair(self) -> ScoreRequest:
        given = [(a, b) for a, b in _SCORE_PAIRS if getattr(self, a) is not None]
        given = [(a, b) for a, b in given if getattr(self, b) is not None]
        if not given:
            raise ParamError(
                "Give the texts to score as 'text_1' and 'text_2' (or 'queries' and "
                "'documents', 'queries' and 'items', 'data_1' and 'data_2').",
                "text_1",
            )
        left, right = self.sides
        if len(left) > 1 and len(left) != len(right):
            raise ParamError(
                f"Input lengths must be either 1:1, 1:N or N:N; got {len(left)}:{len(right)}.",
                given[0][1],
            )
        return self

    @property
    def side_names(self) -> tuple[str, str]:
        for a, b in _SCORE_PAIRS:
            if getattr(self, a) is not None and getattr(self, b) is not None:
                return a, b
        raise AssertionError("validated")

    @property
    def sides(self) -> tuple[list[str], list[str]]:
        """The two sides as lists (a single text is a list of one)."""
        a, b = self.side_names
        left, right = getattr(self, a), getattr(self, b)
        return (
            [left] if isinstance(left, str) else list(left),
            [right] if isinstance(right, str) else list(right),
        )


class RerankDocument(_Body):
    """A document given as an object (Cohere's v1 shape)."""

    text: Text


class RerankRequest(_PoolingBody, _ActivationFields):
    """POST /rerank, /v1/rerank and /v2/rerank (Jina's and Cohere's shape, as vLLM serves it)."""

    query: Text = Field(description="The query the documents are ranked against.")
    documents: Annotated[
        list[Text | RerankDocument], Field(min_length=1, max_length=MAX_INPUTS)
    ] = Field(description=f"The documents: strings or {{'text': ...}} (at most {MAX_INPUTS}).")
    top_n: TopN | None = Field(
        None, description="Return only the N most relevant (0 or unset: all)."
    )
    return_documents: Bool = Field(True, description="Include each document's text in its result.")

    @field_validator("query", mode="wrap")
    @classmethod
    def _query(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        if isinstance(value, str) and not value:
            raise ParamError("'query' must not be an empty string.", "query")
        try:
            return handler(value)
        except ValidationError:
            raise ParamError("'query' must be a string.", "query") from None

    @field_validator("documents", mode="wrap")
    @classmethod
    def _documents(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        if isinstance(value, list):
            value = [d["text"] if isinstance(d, dict) and "text" in d else d for d in value]
        _check_sizes(value, "documents", token_ids=False)
        try:
            return handler(value)
        except ValidationError:
            raise ParamError(
                "'documents' must be an array of strings (or of objects with a 'text' string).",
                "documents",
            ) from None

    @property
    def texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]


M = TypeVar("M", bound=BaseModel)


def _parse(model: type[M], body: Any) -> M:
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise validation_error(e) from None


def validation_error(e: ValidationError) -> ApiError:
    """The first error of a pydantic validation as an OpenAI-style 400 naming its parameter:
    the validators' own sentences here, the rest worded as for the generation routes."""
    exc = (e.errors(include_url=False)[0].get("ctx") or {}).get("error")
    if isinstance(exc, ParamError):
        return invalid_parameter(str(exc), exc.param)
    return api_error(e)


def parse_embedding(body: Any) -> EmbeddingRequest:
    return _parse(EmbeddingRequest, body)


def parse_pooling(body: Any) -> PoolingRequest:
    return _parse(PoolingRequest, body)


def parse_classification(body: Any) -> ClassificationRequest:
    return _parse(ClassificationRequest, body)


def parse_score(body: Any) -> ScoreRequest:
    return _parse(ScoreRequest, body)


def parse_rerank(body: Any) -> RerankRequest:
    return _parse(RerankRequest, body)
