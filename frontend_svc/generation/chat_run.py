"""A chat request made ready for the engine, once for every route that speaks chat underneath
(/v1/chat/completions, /v1/responses, /v1/messages): its template rendered and encoded, the
prompt checked against the context, the tool-call parser and the reasoning split its output
goes through, and the special tokens whose text those parsers read."""

from __future__ import annotations

from dataclasses import dataclass, replace

from frontend_svc.generation.token_constraints import PreparedPrompt, prepare_prompt
from frontend_svc.protocol.requests import ChatRequest, SamplingOptions
from frontend_svc.reasoning import RequestReasoning
from frontend_svc.server.state import GatewayState
from frontend_svc.text.prompt_encoder import PromptEncoder
from frontend_svc.text.tokenizer import EncodedPrompt, Tokenizer
from frontend_svc.tool_parsers import CallIds, ToolParser
from protos.types import ModelInfo


@dataclass(frozen=True)
class ChatRun:
    prompt: PreparedPrompt
    # The request's sampling as the engine gets it: a structured-output constraint of an output
    # that begins in reasoning waits for the reasoning's end tag (vLLM's rule).
    sampling: SamplingOptions
    parser: ToolParser | None  # what reads tool calls in the output; None: no tools to call
    reasoning: RequestReasoning | None  # None: the server has no reasoning parser
    # Special tokens whose text stays in the output even with skip_special_tokens: the parsers'
    # markers (Qwen's <tool_call>, <think>), which the tokenizer may hold as special tokens.
    kept_ids: frozenset[int]
    call_ids: CallIds  # how the output's tool calls are named (Kimi-K2: functions.NAME:INDEX)


async def encode_chat(
    encoder: PromptEncoder, tokenizer: Tokenizer, info: ModelInfo, req: ChatRequest
) -> EncodedPrompt:
    """The conversation through the chat template, encoded (off the event loop when big)."""
    return await encoder.encode_chat(
        tokenizer,
        req.messages,
        req.add_generation_prompt,
        req.template_kwargs,
        # A prompt to truncate is kept whole here: its last tokens are the ones kept.
        max_length=info.max_model_len if req.sampling.truncate_prompt_tokens is None else None,
        tools=req.tools.template_tools(),
        continue_final_message=req.continue_final_message,
    )


def chat_run(
    state: GatewayState,
    tokenizer: Tokenizer,
    info: ModelInfo,
    req: ChatRequest,
    encoded: EncodedPrompt,
    prompt_param: str = "messages",
) -> ChatRun:
    """``encoded`` checked against the context (errors name ``prompt_param`` and the request's
    max-tokens field), with the readers of its output."""
    engine = req.sampling.engine
    prompt = prepare_prompt(
        encoded.ids,
        engine.max_tokens,
        info.max_model_len,
        info.vocab_size,
        prompt_param,
        req.max_tokens_param,
        engine.min_tokens,
        num_tokens=encoded.num_tokens,
        truncate_prompt_tokens=req.sampling.truncate_prompt_tokens,
    )
    parser = req.tools.output_parser(state.tool_parser)
    reasoning = None
    sampling = req.sampling
    if state.reasoning_parser is not None:
        reasoning = state.reasoning_parser.for_request(
            tokenizer, prompt.token_ids, req.template_kwargs
        )
        constraint = engine.structured_output
        if reasoning.active and constraint is not None and reasoning.end_ids:
            # A constraint (response_format, tool_choice required or named) applies to the
            # answer: the engine starts it after the end tag, as vLLM does.
            constraint = replace(constraint, reasoning_end_token_ids=reasoning.end_ids)
            sampling = replace(sampling, engine=replace(engine, structured_output=constraint))
    markers = parser.markers if parser is not None else ()
    if reasoning is not None and reasoning.active:
        markers += reasoning.parser.markers
    kept = tokenizer.special_ids_of(markers) if markers else frozenset()
    call_ids = CallIds.of(info.model_type, req.messages)
    return ChatRun(prompt, sampling, parser, reasoning, kept, call_ids)
