"""POST /v1/chat/completions."""

from __future__ import annotations

import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from frontend_svc.generation import (
    ChoiceResult,
    UsageCounter,
    collect,
    generate,
    prepare_prompt,
    random_id,
)
from frontend_svc.logprobs_format import chat_logprobs
from frontend_svc.output_processor import SequenceDelta
from frontend_svc.protocol import ChatRequest, parse_chat
from frontend_svc.routes.common import gateway, parse_body, prompt_encoder, stream_sse
from frontend_svc.sse import ClientDisconnected, until_disconnected
from frontend_svc.tokenizer import Tokenizer


async def create_chat_completion(request: Request) -> Response:
    state = gateway(request)
    tokenizer, info = state.require_engine()
    req = await parse_body(request, parse_chat, info.max_logprobs)
    state.check_model(req.model)
    prompt = await prompt_encoder(request).encode_chat(
        tokenizer,
        req.messages,
        req.add_generation_prompt,
        req.template_kwargs,
        max_length=info.max_model_len,
    )
    prepared = prepare_prompt(
        prompt.ids,
        req.sampling.max_tokens,
        info.max_model_len,
        info.vocab_size,
        "messages",
        req.max_tokens_param,
        req.sampling.min_tokens,
        num_tokens=prompt.num_tokens,
    )
    ctx = _Context(req, tokenizer, random_id("chatcmpl"), state.served_model_name or req.model)
    deltas = generate(state, ctx.id, [prepared], req.sampling)
    if req.stream:
        return await stream_sse(
            request, deltas, ctx.chunks, ctx.usage_chunk if req.include_usage else None
        )
    try:
        results = await until_disconnected(request, collect(deltas, req.sampling.n))
    except ClientDisconnected:
        return Response(status_code=499)
    return JSONResponse(ctx.response(results))


class _Context:
    def __init__(self, req: ChatRequest, tokenizer: Tokenizer, request_id: str, model: str) -> None:
        self.req = req
        self.tok = tokenizer
        self.id = request_id
        self.model = model
        self.created = int(time.time())

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _logprobs(self, entries: Any) -> dict[str, Any] | None:
        if not self.req.logprobs:
            return None
        return chat_logprobs(self.tok, list(entries), self.req.sampling.logprobs or 0)

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        chunk = self._head("chat.completion.chunk")
        chunk["choices"] = [choice]
        if self.req.include_usage:
            chunk["usage"] = None
        return chunk

    def chunks(self, d: SequenceDelta) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if d.first:
            out.append(
                self._chunk(
                    {
                        "index": d.index,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                )
            )
        if d.text or d.finish_reason is not None or (self.req.logprobs and d.logprobs):
            out.append(
                self._chunk(
                    {
                        "index": d.index,
                        "delta": {"content": d.text} if d.text else {},
                        "logprobs": self._logprobs(d.logprobs),
                        "finish_reason": d.finish_reason,
                        "stop_reason": d.stop_reason,
                    }
                )
            )
        return out

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        chunk = self._head("chat.completion.chunk")
        chunk["choices"] = []
        chunk["usage"] = usage
        return chunk

    def response(self, results: list[ChoiceResult]) -> dict[str, Any]:
        usage = UsageCounter()
        choices = []
        for r in results:
            usage.prompt_tokens[0] = r.num_prompt_tokens
            usage.cached_tokens[0] = max(usage.cached_tokens.get(0, 0), r.num_cached_tokens)
            usage.completion_tokens += len(r.token_ids)
            choices.append(
                {
                    "index": r.index,
                    "message": {"role": "assistant", "content": r.text},
                    "logprobs": self._logprobs(r.logprobs),
                    "finish_reason": r.finish_reason,
                    "stop_reason": r.stop_reason,
                }
            )
        return {**self._head("chat.completion"), "choices": choices, "usage": usage.as_dict()}
