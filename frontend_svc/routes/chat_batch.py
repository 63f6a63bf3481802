"""POST /v1/chat/completions/batch (vLLM's): several conversations in one request.

The body is chat's with ``messages`` a list of conversations (``protocol.models.ChatBatchBody``).
Each conversation runs as its own chat request, all at once: rendered, checked and generated as
/v1/chat/completions does it, its reply read by the same parsers. The answer is one
``chat.completion`` whose choice ``i`` is conversation ``i``'s (``index`` = its number), with the
usage of them all summed; ``prompt_logprobs`` and ``prompt_token_ids`` are null.

As in vLLM, one conversation that fails fails the whole request: a refused conversation is
answered before anything is generated (its error names it: ``messages[i]``), and an engine error
aborts the conversations still running. A client that leaves aborts them all.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from frontend_svc.errors import ApiError
from frontend_svc.generation.chat_run import ChatRun, chat_run, encode_chat
from frontend_svc.generation.run import ChoiceResult, generate, merge, random_id
from frontend_svc.protocol import ChatRequest, parse_chat_batch
from frontend_svc.routes.chat import ChatReply
from frontend_svc.routes.common import (
    gateway,
    parse_body,
    prompt_encoder,
    require_task,
    with_server_defaults,
)
from frontend_svc.routes.sse import ClientDisconnected, until_disconnected
from frontend_svc.text.output_processor import SequenceDelta
from frontend_svc.text.tokenizer import Tokenizer

PATH = "/v1/chat/completions/batch"


async def create_chat_completion_batch(request: Request) -> Response:
    state = gateway(request)
    tokenizer, info = state.require_engine()
    reqs = await parse_body(request, parse_chat_batch, info.max_logprobs, info.vocab_size)
    model = reqs[0].model
    lora = await state.resolve_model(model)  # the LoRA adapter it names, if any
    require_task(info, model, "generate", f"chat completions ({PATH})")
    options = with_server_defaults(state, reqs[0].options, stream=False)
    request_id = random_id("chatcmpl")
    served = lora or state.served_model_name or model
    encoder = prompt_encoder(request)
    runs: list[tuple[ChatRequest, ChatRun]] = []
    for i, req in enumerate(reqs):  # every conversation is checked before any is generated
        req = replace(req, options=options)
        try:
            encoded = await encode_chat(encoder, tokenizer, info, req)
            runs.append((req, chat_run(state, tokenizer, info, req, encoded)))
        except ApiError as e:
            raise _in_conversation(e, i) from None
    replies = [_reply(req, run, tokenizer, request_id, served) for req, run in runs]
    streams = [
        # vLLM's sub-request ids: the engine's are "<id>_<i>-0"
        generate(state, f"{request_id}_{i}", [run.prompt], run.sampling, run.kept_ids, lora or "")
        for i, (_, run) in enumerate(runs)
    ]
    try:
        results = await until_disconnected(request, _collect(streams))
    except ClientDisconnected:
        return Response(status_code=499)
    whole = [reply.response([r]) for reply, r in zip(replies, results, strict=True)]
    choices = [w["choices"][0] | {"index": i} for i, w in enumerate(whole)]
    body = whole[0] | {"choices": choices, "usage": summed_usage([w["usage"] for w in whole])}
    return JSONResponse(body | {"prompt_logprobs": None, "prompt_token_ids": None})


def _reply(
    req: ChatRequest, run: ChatRun, tokenizer: Tokenizer, request_id: str, model: str
) -> ChatReply:
    ids = list(run.prompt.token_ids)
    return ChatReply(
        req, tokenizer, request_id, model, run.parser, ids, run.reasoning, run.call_ids
    )


def _in_conversation(e: ApiError, i: int) -> ApiError:
    """``e`` with the conversation it is about named first."""
    message = f"Conversation {i} ('messages[{i}]'): {e.message}"
    return ApiError(e.status, message, type=e.type, param=e.param, code=e.code, headers=e.headers)


async def _numbered(
    i: int, deltas: AsyncIterator[SequenceDelta]
) -> AsyncIterator[tuple[int, SequenceDelta]]:
    async with contextlib.aclosing(deltas):  # type: ignore[type-var]
        async for d in deltas:
            yield i, d


async def _collect(streams: Sequence[AsyncIterator[SequenceDelta]]) -> list[ChoiceResult]:
    """Each conversation's whole choice, in order. The conversations run at once; the first
    error is raised and aborts those still running (``merge``), as cancelling this does."""
    results = [ChoiceResult(0, 0) for _ in streams]
    merged = merge([_numbered(i, s) for i, s in enumerate(streams)])
    async with contextlib.aclosing(merged):  # type: ignore[type-var]
        async for i, d in merged:
            results[i].add(d)
    return results


def summed_usage(usages: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The usage of several requests as one: every count summed; ``prompt_tokens_details`` and
    ``completion_tokens_details`` where any request has them."""
    out: dict[str, Any] = {
        key: sum(u[key] for u in usages)
        for key in ("prompt_tokens", "completion_tokens", "total_tokens")
    }
    for key, count in (
        ("prompt_tokens_details", "cached_tokens"),
        ("completion_tokens_details", "reasoning_tokens"),
    ):
        details = [u[key] for u in usages if u.get(key) is not None]
        if key in usages[0]:
            out[key] = {count: sum(d[count] for d in details)} if details else None
    return out
