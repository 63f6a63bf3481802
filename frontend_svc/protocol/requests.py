"""The gateway's own view of a request, as the routes and ``generation`` use it: frozen
dataclasses made of the validated request models (``frontend_svc.protocol.parse``).

Resolving ``max_tokens`` needs the prompt length, so it happens later (see ``generation``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from frontend_svc.protocol.tools import ToolOptions
from protos.types import EngineSamplingParams, StructuredOutput

Prompt = str | tuple[int, ...]  # text, or token ids


@dataclass(frozen=True)
class SamplingOptions:
    """Sampling as the client asked for it (n and stop strings are the gateway's job)."""

    n: int = 1
    max_tokens: int | None = None  # None: the rest of the context
    min_tokens: int = 0
    temperature: float | None = None
    top_p: float | None = None
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    logprobs: int | None = None  # alternatives per output token; None: no logprobs
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured_output: StructuredOutput | None = None
    structured_output_param: str | None = None  # the field it came from, for errors
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100])
    allowed_token_ids: tuple[int, ...] = ()  # empty: any token
    bad_words: tuple[str, ...] = ()  # as the client wrote them
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()  # made of bad_words by the gateway
    truncate_prompt_tokens: int | None = None  # keep the last k prompt tokens; -1: all that fit

    def engine_params(self, max_tokens: int, index: int) -> EngineSamplingParams:
        """Parameters of the ``index``-th of the n engine requests (seeds differ per index)."""
        return EngineSamplingParams(
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            seed=None if self.seed is None else self.seed + index,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logprobs=self.logprobs,
            prompt_logprobs=self.prompt_logprobs,
            structured_output=self.structured_output,
            logit_bias=self.logit_bias,
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words_token_ids,
        )


@dataclass(frozen=True)
class ResponseOptions:
    """What a response carries besides the text, as vLLM has it.

    ``include_usage``/``continuous_usage``: the final usage chunk / usage on every chunk of a
    stream (``stream_options``; the server's ``--enable-force-include-usage`` turns the first
    on); ``return_token_ids``: the prompt's and the output's token ids;
    ``tokens_as_token_ids``: logprob tokens written ``token_id:N`` (None: the server's
    ``--return-tokens-as-token-ids``)."""

    include_usage: bool = False
    continuous_usage: bool = False
    return_token_ids: bool = False
    tokens_as_token_ids: bool | None = None

    def with_server_defaults(
        self, stream: bool, force_usage: bool, as_ids: bool
    ) -> ResponseOptions:
        """The options with the server's flags applied: ``force_usage`` adds the usage chunk to
        every stream; ``as_ids`` is the default of ``tokens_as_token_ids``. Continuous usage
        needs the usage chunk (vLLM's rule)."""
        include = self.include_usage or (stream and force_usage)
        as_ids = as_ids if self.tokens_as_token_ids is None else self.tokens_as_token_ids
        return replace(
            self,
            include_usage=include,
            continuous_usage=include and self.continuous_usage,
            tokens_as_token_ids=as_ids,
        )


@dataclass(frozen=True)
class CompletionRequest:
    model: str
    prompts: tuple[Prompt, ...]
    echo: bool
    sampling: SamplingOptions
    stream: bool
    add_special_tokens: bool = True
    options: ResponseOptions = field(default_factory=ResponseOptions)
    prompt_logprobs: int | None = None  # alternatives shown per prompt token; None: none shown

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0: the prompt comes back (with its logprobs), nothing else."""
        return self.echo and self.sampling.max_tokens == 0


@dataclass(frozen=True)
class ChatRequest:
    model: str
    messages: tuple[dict[str, Any], ...]  # content flattened to strings
    add_generation_prompt: bool
    template_kwargs: dict[str, Any]
    sampling: SamplingOptions
    logprobs: bool
    stream: bool
    max_tokens_param: str  # which name the client used, for error messages
    tools: ToolOptions = field(default_factory=ToolOptions)
    options: ResponseOptions = field(default_factory=ResponseOptions)
    continue_final_message: bool = False  # the last message is continued, not answered
    echo: bool = False  # the last message's content starts the reply when its role is the reply's

    @property
    def response_role(self) -> str:
        """The reply's role: the assistant's after a generation prompt, else the last message's
        (a continued message keeps its role), as vLLM has it."""
        return "assistant" if self.add_generation_prompt else str(self.messages[-1]["role"])


@dataclass(frozen=True)
class TokenizeRequest:
    model: str | None
    prompt: str | None
    messages: tuple[dict[str, Any], ...] | None
    add_special_tokens: bool
    add_generation_prompt: bool
    template_kwargs: dict[str, Any]
    return_token_strs: bool
    tools: list[dict[str, Any]] | None = None  # the chat template's ``tools``
    continue_final_message: bool = False


@dataclass(frozen=True)
class DetokenizeRequest:
    model: str | None
    tokens: tuple[int, ...]
