"""JSON request bodies to the gateway's requests: validated by the models (a 400 naming the
parameter for anything wrong), then turned into the frozen dataclasses the routes use."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import orjson

from frontend_svc.protocol.base import validate
from frontend_svc.protocol.chat_batch import ChatBatchBody
from frontend_svc.protocol.messages import Message
from frontend_svc.protocol.models import (
    ChatBody,
    ChatFields,
    CompletionBody,
    DetokenizeBody,
    GenerationBody,
    TokenizeBody,
)
from frontend_svc.protocol.requests import (
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    ResponseOptions,
    SamplingOptions,
    TokenizeRequest,
)
from protos.types import EngineSamplingParams, StructuredOutput


def parse_completion(
    body: object, max_logprobs: int, vocab_size: int | None = None
) -> CompletionRequest:
    """``max_logprobs``: the engine's limit for ``logprobs`` and ``prompt_logprobs``; -1 asks
    for the whole vocabulary (``vocab_size``; None: refused)."""
    b = validate(CompletionBody, body, {"max_logprobs": max_logprobs, "vocab_size": vocab_size})
    # Shown as choices[].prompt_logprobs: the ones asked for, or with echo those of the echoed
    # prompt (vLLM's rule); echoed prompt tokens carry logprobs too (OpenAI).
    shown = prompt_logprobs = b.prompt_logprobs
    if b.echo and b.logprobs is not None:
        prompt_logprobs = max(prompt_logprobs or 0, b.logprobs)
        shown = b.logprobs if shown is None else shown
    sampling = _sampling(b, b.max_tokens, b.logprobs, prompt_logprobs)
    return CompletionRequest(
        model=b.model,
        prompts=b.prompt,
        echo=b.echo,
        sampling=sampling,
        stream=b.stream,
        add_special_tokens=b.add_special_tokens,
        options=_response_options(b),
        prompt_logprobs=shown,
    )


def parse_chat(
    body: object, max_logprobs: int, auto_tools: bool = False, vocab_size: int | None = None
) -> ChatRequest:
    """``auto_tools``: the server reads tool calls the model chose to make (tool_choice "auto");
    without it a request with tools must choose "none", "required" or a function. -1 logprobs
    ask for the whole vocabulary (``vocab_size``; None: refused)."""
    context = {"max_logprobs": max_logprobs, "auto_tools": auto_tools, "vocab_size": vocab_size}
    b = validate(ChatBody, body, context)
    raw: list[dict[str, Any]] = body["messages"]  # type: ignore[index]  # validated
    return _chat_request(b, b.messages, raw, auto_tools)


def parse_chat_batch(
    body: object, max_logprobs: int, vocab_size: int | None = None
) -> tuple[ChatRequest, ...]:
    """/v1/chat/completions/batch: one chat request per conversation, each with the body's
    other fields (as ``parse_chat`` reads them; the batch takes no tools)."""
    context = {"max_logprobs": max_logprobs, "vocab_size": vocab_size}
    b = validate(ChatBatchBody, body, context)
    raw: list[list[dict[str, Any]]] = body["messages"]  # type: ignore[index]  # validated
    return tuple(
        _chat_request(b, messages, conversation, auto_tools=False)
        for messages, conversation in zip(b.messages, raw, strict=True)
    )


def _chat_request(
    b: ChatFields, messages: list[Message], raw: list[dict[str, Any]], auto_tools: bool
) -> ChatRequest:
    """The request of one conversation: ``messages`` as validated, ``raw`` as sent."""
    max_tokens = b.max_tokens if b.max_completion_tokens is None else b.max_completion_tokens
    logprobs = (b.top_logprobs or 0) if b.logprobs else None
    sampling = _sampling(b, max_tokens, logprobs, b.prompt_logprobs)
    tools = b.tool_options(auto_tools)
    schema = tools.json_schema()
    if schema is not None:  # required or named: the output is the calls' JSON (vLLM's way)
        constraint = StructuredOutput("json_schema", orjson.dumps(schema).decode())
        engine = replace(sampling.engine, structured_output=constraint)
        sampling = replace(sampling, engine=engine, structured_output_param="tool_choice")
    return ChatRequest(
        model=b.model,
        messages=tuple(m.template_message(r) for m, r in zip(messages, raw, strict=True)),
        add_generation_prompt=b.add_generation_prompt,
        template_kwargs=b.chat_template_kwargs,
        sampling=sampling,
        logprobs=b.logprobs,
        stream=b.stream,
        max_tokens_param=b.max_tokens_param,
        tools=tools,
        options=_response_options(b),
        continue_final_message=b.continue_final_message,
        echo=b.echo,
    )


def parse_tokenize(body: object) -> TokenizeRequest:
    b = validate(TokenizeBody, body)
    messages = None
    if b.messages is not None:
        raw: list[dict[str, Any]] = body["messages"]  # type: ignore[index]  # validated
        messages = tuple(m.template_message(r) for m, r in zip(b.messages, raw, strict=True))
    add_special_tokens = b.add_special_tokens
    return TokenizeRequest(
        model=b.model,
        prompt=b.prompt,
        messages=messages,
        add_special_tokens=messages is None if add_special_tokens is None else add_special_tokens,
        add_generation_prompt=b.add_generation_prompt,
        continue_final_message=b.continue_final_message,
        template_kwargs=b.chat_template_kwargs,
        return_token_strs=b.return_token_strs,
        tools=[t.to_openai() for t in b.function_tools()] or None,
    )


def parse_detokenize(body: object) -> DetokenizeRequest:
    b = validate(DetokenizeBody, body)
    return DetokenizeRequest(model=b.model, tokens=b.tokens)


def _sampling(
    b: GenerationBody, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None
) -> SamplingOptions:
    structured = b.structured_output()
    engine = EngineSamplingParams(
        max_tokens=max_tokens,
        min_tokens=b.min_tokens,
        temperature=b.temperature,
        top_p=b.top_p,
        top_k=0 if b.top_k == -1 else b.top_k,
        min_p=b.min_p,
        seed=b.seed,
        stop_token_ids=b.stop_token_ids,
        ignore_eos=b.ignore_eos,
        presence_penalty=b.presence_penalty,
        frequency_penalty=b.frequency_penalty,
        repetition_penalty=b.repetition_penalty,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        structured_output=structured[0] if structured else None,
        logit_bias=b.logit_bias,
        allowed_token_ids=b.allowed_token_ids or (),
    )
    return SamplingOptions(
        engine=engine,
        n=b.n,
        stop=b.stop,
        include_stop_str_in_output=b.include_stop_str_in_output,
        skip_special_tokens=b.skip_special_tokens,
        structured_output_param=structured[1] if structured else None,
        bad_words=b.bad_words,
        truncate_prompt_tokens=b.truncate_prompt_tokens,
        use_beam_search=b.use_beam_search,
        length_penalty=b.length_penalty,
    )


def _response_options(b: GenerationBody) -> ResponseOptions:
    options = b.stream_options
    return ResponseOptions(
        include_usage=bool(options and options.include_usage),
        continuous_usage=bool(options and options.continuous_usage_stats),
        return_token_ids=b.return_token_ids,
        tokens_as_token_ids=b.return_tokens_as_token_ids,
    )
