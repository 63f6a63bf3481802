"""The Python types that cross the engine boundary: what the gateway sends (a request, its
sampling or pooling parameters as sent, ``None`` where the engine's default applies), what the
engine answers (each step's outputs, finish reasons, error codes, load figures) and what its
unary calls report (model info, LoRA adapters, the tokenizer).

One definition each, imported by both services: the gateway works on these; the engine maps
its own domain objects to and from them at its gRPC edge; :mod:`protos.convert` turns them into
the contract's messages and back. Imports neither torch nor either service.
"""

from __future__ import annotations

import enum
from array import array
from dataclasses import dataclass, field


class FinishReason(enum.Enum):
    """Why a sequence ended; the value (and ``str()``) is the OpenAI spelling."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"

    def __str__(self) -> str:
        return self.value


class EngineErrorCode(enum.Enum):
    """Why the engine refused or failed one request (mirrors the proto's ErrorCode), or one of
    its adapter / utility calls (the last three: gRPC statuses only those calls get)."""

    INVALID_ARGUMENT = "invalid_argument"
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    RESOURCE_EXHAUSTED = "resource_exhausted"
    DUPLICATE_REQUEST_ID = "duplicate_request_id"
    UNAVAILABLE = "unavailable"
    INTERNAL = "internal"
    NOT_FOUND = "not_found"  # a request's or a call's LoRA adapter is not loaded
    ALREADY_EXISTS = "already_exists"  # AddLora: the name is in use
    FAILED_PRECONDITION = "failed_precondition"  # the engine's state or setup rules the call out
    UNIMPLEMENTED = "unimplemented"  # the engine has no such rpc (an older engine)


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on the generated text that the engine enforces while sampling (the
    contract's StructuredOutput). ``kind`` is json_schema, json_object, regex, choice or grammar;
    ``spec`` is the schema as JSON text, the regex or the EBNF grammar ("" for json_object and
    choice); ``choices`` are the strings of a choice."""

    kind: str
    spec: str = ""
    choices: tuple[str, ...] = ()
    # The token ids that end the model's reasoning ("</think>"'s): set, the constraint applies
    # only after their first occurrence in the output. Empty: from the first output token.
    reasoning_end_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class EngineSamplingParams:
    """The engine's sampling parameters (n and text-level stops are handled by the gateway).

    ``None`` means "unset": the engine applies its default. ``logit_bias`` is (token id, bias)
    pairs; ``allowed_token_ids`` None or empty means no restriction; ``bad_words`` are the token
    sequences the gateway made of the client's words.
    """

    max_tokens: int | None = None
    min_tokens: int = 0
    temperature: float | None = None
    top_p: float | None = None
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured_output: StructuredOutput | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] = ()
    bad_words: tuple[tuple[int, ...], ...] = ()


class PoolingTask(enum.Enum):
    """What a pooling request computes (the contract's PoolingTask); the value (and ``str()``)
    is vLLM's task name, as in ModelInfo.supported_tasks."""

    EMBED = "embed"
    CLASSIFY = "classify"
    SCORE = "score"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class EnginePoolingParams:
    """A pooling request's parameters (the contract's PoolingParams); ``None``: the engine's
    default (normalize and activation: on; dimensions: all)."""

    task: PoolingTask | None  # None: unset (the engine refuses it, naming the tasks served)
    dimensions: int | None = None  # embed only (Matryoshka)
    normalize: bool | None = None  # embed only
    activation: bool | None = None  # classify / score only


@dataclass(frozen=True)
class EngineRequest:
    """One sequence to generate, or with ``pooling_params`` one prompt to pool (its
    ``sampling_params`` are then ignored)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling_params: EngineSamplingParams
    priority: int = 0
    arrival_time: float = 0.0  # Unix seconds; 0: the engine stamps it
    pooling_params: EnginePoolingParams | None = None
    lora_name: str = ""  # the LoRA adapter to run with ("": the base model)


@dataclass(frozen=True)
class TokenLogprob:
    """Logprob of one token plus the top alternatives (token id, logprob), most likely first."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()


@dataclass(slots=True)
class EngineOutput:
    """What one engine step produced for one request.

    Read-only by convention, not frozen: one is built per request per engine step, and a frozen
    dataclass's ``__init__`` (``object.__setattr__`` per field) costs 1.2 us where this one
    costs 0.15 us."""

    request_id: str
    new_token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()
    prompt_logprobs: tuple[TokenLogprob, ...] = ()  # first output only; from the 2nd prompt token
    finish_reason: FinishReason | None = None
    stop_reason: int | None = None
    num_cached_tokens: int = 0
    num_prompt_tokens: int = 0
    # Engine-measured phase times in seconds (contract: RequestOutput.queued_time_s ...): the
    # first two with the first token and the last output, decode only with the last.
    queued_time_s: float | None = None
    prefill_time_s: float | None = None
    decode_time_s: float | None = None
    # A pooling request's result, in its one (final) output: the embedding, one value per
    # label, or the score, as float32 values. None for generation.
    pooled: array[float] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True, slots=True)
class LoadFigures:
    """Engine-wide load, as every engine message carries it; the prefix-cache, preemption and
    speculative-decoding figures are cumulative totals."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    # The LoRA adapters (names) that running / waiting requests use.
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()
    # Of num_waiting, those stepped over for now (a grammar compiling, no LoRA slot): vLLM's
    # "deferred" waiting requests; the others wait for capacity.
    num_waiting_deferred: int = 0
    # Speculative decoding totals: requests verified, tokens proposed, tokens accepted, and
    # accepted tokens by position in the proposal.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()


@dataclass(frozen=True)
class ModelInfo:
    """Static facts about the served model (GetModelInfo)."""

    served_model_name: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    block_size: int
    num_kv_blocks: int
    kv_capacity_tokens: int
    max_logprobs: int
    model_source: str = ""
    engine_version: str = ""
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = ""
    # What the model serves, in vLLM's task names ("generate", "embed", "classify", "score").
    supported_tasks: tuple[str, ...] = ("generate",)
    embedding_size: int = 0  # 0 unless "embed" is served
    pooling_type: str = ""  # LAST, MEAN or CLS when "embed" is served
    is_matryoshka: bool = False  # dimensions accepted
    matryoshka_dimensions: tuple[int, ...] = ()  # the ones accepted; empty: any up to the size
    labels: tuple[str, ...] = ()  # the classifier's labels, in output order
    max_loras: int = 0  # LoRA adapters on the device at once; 0: the engine serves none
    max_lora_rank: int = 0  # the largest adapter rank it accepts
    model_type: str = ""  # the checkpoint's config.json model_type ("": unknown)
    tensor_parallel_size: int = 1  # ranks the model is sharded over


@dataclass(frozen=True)
class LoraAdapter:
    """One LoRA adapter loaded on an engine (the contract's LoraInfo)."""

    name: str
    path: str  # the PEFT directory on the engine's file system
    rank: int = 0
    pinned: bool = False  # never moved off the device
    on_device: bool = False  # its weights are on the device now (else in host memory)


@dataclass(frozen=True)
class TokenizerFiles:
    """The tokenizer directory as served by GetTokenizer: file name -> bytes, plus the template."""

    files: dict[str, bytes] = field(default_factory=dict)
    chat_template: str | None = None
