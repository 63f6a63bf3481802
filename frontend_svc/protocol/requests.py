"""The gateway's own view of a request, as the routes and ``generation`` use it: frozen
dataclasses made of the validated request models (``frontend_svc.protocol.parse``).

Resolving ``max_tokens`` needs the prompt length, so it happens later (see ``generation``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from frontend_svc.protocol.tools import ToolOptions
from protos.types import EngineSamplingParams

Prompt = str | tuple[int, ...]  # text, or token ids


@dataclass(frozen=True)
class SamplingOptions:
    """Sampling as the client asked for it: what the engine applies, as the contract sends it
    (``engine``; its ``max_tokens`` None means the rest of the context, resolved per prompt,
    and its ``seed`` is the first sequence's), and what the gateway does itself (n, text stops,
    detokenizing, the bad words as written, prompt truncation)."""

    engine: EngineSamplingParams = EngineSamplingParams()
    n: int = 1
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured_output_param: str | None = None  # the field the constraint came from, for errors
    bad_words: tuple[str, ...] = ()  # as the client wrote them (engine.bad_words: as token ids)
    truncate_prompt_tokens: int | None = None  # keep the last k prompt tokens; -1: all that fit
    use_beam_search: bool = False  # n beams instead of n samples (generation.beam_search)
    length_penalty: float = 1.0  # beam search: score = cumulative logprob / length ** this

    def engine_params(self, max_tokens: int, index: int) -> EngineSamplingParams:
        """Parameters of the ``index``-th of the n engine requests (seeds differ per index)."""
        seed = self.engine.seed
        return replace(
            self.engine, max_tokens=max_tokens, seed=None if seed is None else seed + index
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
    prompt_tokens_details: bool = False  # the server's --enable-prompt-tokens-details

    def with_server_defaults(
        self, stream: bool, force_usage: bool, as_ids: bool, prompt_tokens_details: bool = False
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
            prompt_tokens_details=prompt_tokens_details,
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
        return self.echo and self.sampling.engine.max_tokens == 0


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
