"""POST /v1/chat/completions.

With a tool-call parser for the request (``tool_choice`` auto with the server's
``--tool-call-parser``, or required / a named function, whose output is the calls' JSON), each
choice's text goes through it: whole (``message.tool_calls``) or fed delta by delta (``tool_calls``
pieces in the chunks: index, id, type and name first, then argument pieces). A choice that made
calls and stopped on its own finishes with ``"tool_calls"``; one cut off keeps ``"length"``.

With a ``--reasoning-parser``, each choice's text is first split into reasoning and content
(``frontend_svc.reasoning``): ``message.reasoning`` and, for clients written before vLLM renamed
it, ``reasoning_content`` with the same text (both null without reasoning); streamed, the same two
keys carry the reasoning pieces and ``content`` the rest. Only the content goes on to the tool-call
parser, so nothing inside the reasoning becomes a call. ``usage.completion_tokens_details.
reasoning_tokens`` counts the reasoning's tokens.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from frontend_svc.generation.beam_search import beam_search, check_beam_search
from frontend_svc.generation.chat_run import chat_run, encode_chat
from frontend_svc.generation.run import (
    ChoiceResult,
    UsageCounter,
    collect,
    generate,
    random_id,
)
from frontend_svc.protocol import ChatRequest, parse_chat
from frontend_svc.protocol.logprobs import (
    TOKEN_ID_TEXTS,
    TokenTexts,
    chat_logprobs,
    prompt_logprobs,
)
from frontend_svc.reasoning import ReasoningStream, RequestReasoning
from frontend_svc.routes.common import (
    PlainTextEvents,
    gateway,
    parse_body,
    prompt_encoder,
    require_task,
    running_usage,
    stream_sse,
    with_server_defaults,
)
from frontend_svc.routes.sse import ClientDisconnected, until_disconnected
from frontend_svc.text.output_processor import SequenceDelta
from frontend_svc.text.tokenizer import Tokenizer
from frontend_svc.tool_parsers import RANDOM_IDS, CallIds, ToolCallStream, ToolParser

_S = TypeVar("_S")


async def create_chat_completion(request: Request) -> Response:
    state = gateway(request)
    tokenizer, info = state.require_engine()
    auto = state.tool_parser is not None
    req = await parse_body(request, parse_chat, info.max_logprobs, auto, info.vocab_size)
    lora = await state.resolve_model(req.model)  # the LoRA adapter it names, if any
    require_task(info, req.model, "generate", "chat completions (/v1/chat/completions)")
    req = replace(req, options=with_server_defaults(state, req.options, req.stream))
    encoded = await encode_chat(prompt_encoder(request), tokenizer, info, req)
    run = chat_run(state, tokenizer, info, req, encoded)
    prepared, kept = run.prompt, run.kept_ids
    ctx = ChatReply(
        req,
        tokenizer,
        random_id("chatcmpl"),
        lora or state.served_model_name or req.model,
        run.parser,
        list(prepared.token_ids),
        run.reasoning,
        run.call_ids,
    )
    if req.sampling.use_beam_search:
        logprobs = req.logprobs or req.sampling.engine.prompt_logprobs is not None
        check_beam_search(req.sampling, req.stream, logprobs)
        search = beam_search(
            state.engines.generate,
            tokenizer,
            info.eos_token_ids,
            info.max_logprobs,
            ctx.id,
            [prepared],
            req.sampling,
            lora or "",
        )
        try:
            return JSONResponse(ctx.response(await until_disconnected(request, search)))
        except ClientDisconnected:
            return Response(status_code=499)
    deltas = generate(state, ctx.id, [prepared], run.sampling, kept, lora_name=lora or "")
    if req.stream:
        usage_chunk = ctx.usage_chunk if req.options.include_usage else None
        return await stream_sse(request, deltas, ctx.chunks, usage_chunk, ctx.text_event)
    try:
        results = await until_disconnected(request, collect(deltas, req.sampling.n))
    except ClientDisconnected:
        return Response(status_code=499)
    return JSONResponse(ctx.response(results))


class ChatReply:
    """The reply to one chat request: whole (:meth:`response`) or as the chunks of a stream
    (:meth:`chunks` per delta, :meth:`usage_chunk` last)."""

    def __init__(
        self,
        req: ChatRequest,
        tokenizer: Tokenizer,
        request_id: str,
        model: str,
        parser: ToolParser | None,
        prompt_ids: list[int],
        reasoning: RequestReasoning | None = None,
        call_ids: CallIds = RANDOM_IDS,
    ) -> None:
        """``reasoning``: the server's reasoning parser as this request uses it (None: the
        server has none, and answers carry no reasoning fields); ``call_ids``: how its tool
        calls are named."""
        self.req = req
        self.tok = tokenizer
        self.prompt_ids = prompt_ids
        self.role = req.response_role
        self._texts: TokenTexts = TOKEN_ID_TEXTS if req.options.tokens_as_token_ids else tokenizer
        self._num_tokens: dict[int, int] = {}  # output tokens so far, per choice (streaming)
        self.id = request_id
        self.model = model
        self.created = int(time.time())
        self.parser = parser
        self.call_ids = call_ids
        self._streams: dict[int, ToolCallStream] = {}  # per choice index, while it streams
        self.reasoning = reasoning
        self._splitting = reasoning is not None and reasoning.active
        self._reasoning_streams: dict[int, ReasoningStream] = {}  # per choice, while it streams
        # Streaming with a usage chunk: each choice's ids until it ends, then its reasoning's.
        self._counting = self._splitting and req.options.include_usage
        self._output_ids: dict[int, list[int]] = {}
        self._reasoning_tokens: dict[int, int] = {}
        # A plain stream (no tools, reasoning, logprobs, token ids or running usage) varies only
        # in the content between a choice's first and last chunk: those events come from
        # TextEvents.
        o = req.options
        plain = (
            parser is None
            and not self._splitting
            and not (req.logprobs or o.return_token_ids or o.continuous_usage)
        )
        self.text_event = PlainTextEvents(plain, self.chunks).event

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _logprobs(self, entries: Any) -> dict[str, Any] | None:
        if not self.req.logprobs:
            return None
        return chat_logprobs(self._texts, list(entries), self.req.sampling.engine.logprobs or 0)

    def _echoed(self) -> str:
        """With ``echo``: the last message's content, when its role is the reply's (vLLM)."""
        last = self.req.messages[-1]
        return str(last["content"]) if self.req.echo and last["role"] == self.role else ""

    def _prompt_fields(self, prompt_entries: Any) -> dict[str, Any]:
        """The response's top-level prompt fields, each only when asked for."""
        fields: dict[str, Any] = {}
        if self.req.sampling.engine.prompt_logprobs is not None:
            num_top = self.req.sampling.engine.prompt_logprobs
            fields["prompt_logprobs"] = prompt_logprobs(self.tok, prompt_entries, num_top)
        if self.req.options.return_token_ids:
            fields["prompt_token_ids"] = self.prompt_ids
        return fields

    def _chunk(self, choice: dict[str, Any], d: SequenceDelta) -> dict[str, Any]:
        chunk = self._head("chat.completion.chunk")
        chunk["choices"] = [choice]
        if self.req.options.continuous_usage:
            chunk["usage"] = running_usage(d.num_prompt_tokens, self._num_tokens[d.index])
        elif self.req.options.include_usage:
            chunk["usage"] = None
        return chunk

    def chunks(self, d: SequenceDelta) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if d.first:
            self._num_tokens[d.index] = 0
            role = {"index": d.index, "delta": {"role": self.role, "content": ""}}
            role |= {"logprobs": None, "finish_reason": None}
            # The first chunk of a choice carries the prompt's fields (vLLM: prompt_token_ids).
            out.append(self._chunk(role, d) | self._prompt_fields(d.prompt_logprobs))
            echoed = self._echoed()
            if echoed:
                echo = {"index": d.index, "delta": {"content": echoed}}
                out.append(self._chunk(echo | {"logprobs": None, "finish_reason": None}, d))
        self._num_tokens[d.index] += len(d.token_ids)
        if self._counting:
            self._count_reasoning(d)
        delta, called = self._delta(d)
        return_ids = self.req.options.return_token_ids
        if (
            delta
            or d.finish_reason is not None
            or (self.req.logprobs and d.logprobs)
            or (return_ids and d.token_ids)
        ):
            choice = {
                "index": d.index,
                "delta": delta,
                "logprobs": self._logprobs(d.logprobs),
                "finish_reason": _finish_reason(d.finish_reason, called),
                "stop_reason": d.stop_reason,
            }
            if return_ids:
                choice["token_ids"] = list(d.token_ids)
            out.append(self._chunk(choice, d))
        return out

    def _count_reasoning(self, d: SequenceDelta) -> None:
        """Keep a streaming choice's token ids until it ends, then count its reasoning's."""
        assert self.reasoning is not None
        ids = self._output_ids.setdefault(d.index, [])
        ids.extend(d.token_ids)
        if d.finish_reason is not None:
            num = self.reasoning.count_tokens(self._output_ids.pop(d.index))
            self._reasoning_tokens[d.index] = num

    def _split(self, d: SequenceDelta, final: bool) -> tuple[str, str]:
        """The delta's reasoning piece and content piece (all content when not splitting)."""
        if not self._splitting:
            return "", d.text
        assert self.reasoning is not None
        stream = _per_choice(self._reasoning_streams, d.index, final, self.reasoning.stream)
        out = stream.feed(d.text, final=final)
        return out.reasoning, out.content

    def _delta(self, d: SequenceDelta) -> tuple[dict[str, Any], bool]:
        """The chunk's delta (reasoning, content and tool-call pieces) and whether the choice
        made calls."""
        final = d.finish_reason is not None
        reasoning, text = self._split(d, final)
        delta: dict[str, Any] = {}
        if reasoning:
            delta["reasoning"] = delta["reasoning_content"] = reasoning
        if self.parser is None:
            if text:
                delta["content"] = text
            return delta, False
        parser, ids = self.parser, self.call_ids
        stream = _per_choice(self._streams, d.index, final, lambda: parser.open(ids))
        out = stream.feed(text, final=final)
        if out.content:
            delta["content"] = out.content
        parallel = self.req.tools.parallel_tool_calls
        calls = [c.to_openai() for c in out.tool_calls if parallel or c.index == 0]
        if calls:
            delta["tool_calls"] = calls
        return delta, stream.num_calls > 0

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        chunk = self._head("chat.completion.chunk")
        chunk["choices"] = []
        chunk["usage"] = self._with_reasoning_tokens(usage, sum(self._reasoning_tokens.values()))
        return chunk

    def _with_reasoning_tokens(self, usage: dict[str, Any], num: int) -> dict[str, Any]:
        """With a reasoning parser: the usage with ``completion_tokens_details.reasoning_tokens``
        (OpenAI's place for them; 0 for a request whose output had no reasoning)."""
        if self.reasoning is not None:
            usage["completion_tokens_details"] = {"reasoning_tokens": num}
        return usage

    def response(self, results: list[ChoiceResult]) -> dict[str, Any]:
        usage = UsageCounter(details=self.req.options.prompt_tokens_details)
        num_reasoning = 0
        choices = []
        for r in results:
            usage.prompt_tokens[0] = r.num_prompt_tokens
            usage.cached_tokens[0] = max(usage.cached_tokens.get(0, 0), r.num_cached_tokens)
            usage.completion_tokens += len(r.token_ids)
            if self.reasoning is not None:
                num_reasoning += self.reasoning.count_tokens(r.token_ids)
            message = self._message(r.text)
            choice = {
                "index": r.index,
                "message": message,
                "logprobs": self._logprobs(r.logprobs),
                "finish_reason": _finish_reason(r.finish_reason, "tool_calls" in message),
                "stop_reason": r.stop_reason,
            }
            # vLLM sends the key always, null when not asked for (as the prompt fields below).
            choice["token_ids"] = r.token_ids if self.req.options.return_token_ids else None
            choices.append(choice)
        return {
            **self._head("chat.completion"),
            "choices": choices,
            "usage": self._with_reasoning_tokens(usage.as_dict(), num_reasoning),
            "prompt_logprobs": None,
            "prompt_token_ids": None,
            **self._prompt_fields(results[0].prompt_logprobs if results else ()),
        }

    def _message(self, text: str) -> dict[str, Any]:
        """The message of a whole choice: its content (after the echoed last message, with
        ``echo``), its reasoning with a reasoning parser, and its tool calls if any (then content
        is None when there was nothing besides them, or only the echo)."""
        reasoning, content = self.reasoning.split(text) if self.reasoning else (None, text)
        message: dict[str, Any] = {"role": self.role, "content": content}
        if self.reasoning is not None:
            message["reasoning"] = message["reasoning_content"] = reasoning
        if self.parser is not None and content is not None:
            extracted = self.parser.extract(content, self.call_ids)
            # parallel_tool_calls false: at most one call (enforced by the schema for "required").
            calls = extracted.calls if self.req.tools.parallel_tool_calls else extracted.calls[:1]
            if self.req.tools.choice in ("required", "function"):
                # The output was constrained to be the calls: content "" and the calls made, []
                # when max_tokens cut the output off before one was whole (vLLM's answer).
                message["content"] = ""
                message["tool_calls"] = [c.to_openai() for c in calls]
            elif calls:
                message["content"] = extracted.content
                message["tool_calls"] = [c.to_openai() for c in calls]
        echoed = self._echoed()
        if echoed:
            message["content"] = echoed + (message["content"] or "")
        return message


def _per_choice(streams: dict[int, _S], index: int, final: bool, make: Callable[[], _S]) -> _S:
    """Choice ``index``'s stream (made at its first delta; forgotten at its last)."""
    stream = streams.pop(index) if final else streams.get(index)
    if stream is None:
        stream = make()
        if not final:
            streams[index] = stream
    return stream


def _finish_reason(reason: str | None, called: bool) -> str | None:
    """The reason to report: "tool_calls" for a choice that made calls and stopped by itself
    (EOS, a stop token or string); "length" and the rest as they are."""
    return "tool_calls" if called and reason == "stop" else reason
