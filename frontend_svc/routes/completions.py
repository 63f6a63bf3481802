"""POST /v1/completions."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from frontend_svc.generation.beam_search import beam_search, check_beam_search
from frontend_svc.generation.run import (
    ChoiceResult,
    UsageCounter,
    collect,
    generate,
    random_id,
)
from frontend_svc.generation.token_constraints import prepare_prompt
from frontend_svc.protocol import CompletionRequest, parse_completion
from frontend_svc.protocol.logprobs import (
    TOKEN_ID_TEXTS,
    CompletionLogprobs,
    TokenTexts,
    prompt_logprobs,
)
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
from frontend_svc.text.tokenizer import EncodedPrompt, Tokenizer
from protos.types import TokenLogprob

_UNASKED = {"prompt_logprobs": None, "prompt_token_ids": None, "token_ids": None}


async def create_completion(request: Request) -> Response:
    state = gateway(request)
    tokenizer, info = state.require_engine()
    req = await parse_body(request, parse_completion, info.max_logprobs, info.vocab_size)
    lora = await state.resolve_model(req.model)  # the LoRA adapter it names, if any
    require_task(info, req.model, "generate", "completions (/v1/completions)")
    req = replace(req, options=with_server_defaults(state, req.options, req.stream))
    sampling = req.sampling
    truncate = sampling.truncate_prompt_tokens
    texts = [p for p in req.prompts if isinstance(p, str)]
    encoded = iter(
        await prompt_encoder(request).encode(
            tokenizer,
            texts,
            req.add_special_tokens,
            # A prompt to truncate is kept whole here: its last tokens are the ones kept.
            max_length=info.max_model_len if truncate is None else None,
        )
    )
    prompts = [
        EncodedPrompt(list(p), len(p)) if isinstance(p, tuple) else next(encoded)
        for p in req.prompts
    ]
    # A truncated text prompt keeps the special tokens the tokenizer put first (BOS).
    specials = tokenizer.encode("", True) if truncate is not None and req.add_special_tokens else []
    kept = [
        len(specials) if isinstance(src, str) and p.ids[: len(specials)] == specials else 0
        for src, p in zip(req.prompts, prompts, strict=True)
    ]
    prepared = [
        prepare_prompt(
            p.ids,
            1 if req.echo_only else sampling.engine.max_tokens,  # echo only: one token, dropped
            info.max_model_len,
            info.vocab_size,
            "prompt",
            "max_tokens",
            sampling.engine.min_tokens,
            num_tokens=p.num_tokens,
            truncate_prompt_tokens=truncate,
            keep_prefix=keep,
        )
        for p, keep in zip(prompts, kept, strict=True)
    ]
    prompt_ids = [list(p.token_ids) for p in prepared]  # whole, or as truncated
    echo_texts = [
        src
        if isinstance(src, str) and len(ids) == p.num_tokens  # the text as sent
        else tokenizer.decode(ids[keep:], skip_special_tokens=False)
        for src, p, ids, keep in zip(req.prompts, prompts, prompt_ids, kept, strict=True)
    ]
    ctx = _Context(
        req,
        tokenizer,
        prompt_ids,
        echo_texts,
        random_id("cmpl"),
        lora or state.served_model_name or req.model,
    )
    if sampling.use_beam_search:
        logprobs = sampling.engine.logprobs is not None or req.prompt_logprobs is not None
        check_beam_search(sampling, req.stream, logprobs)
        search = beam_search(
            state.engines.generate,
            tokenizer,
            info.eos_token_ids,
            info.max_logprobs,
            ctx.id,
            prepared,
            sampling,
            lora or "",
        )
        try:
            return JSONResponse(ctx.response(await until_disconnected(request, search)))
        except ClientDisconnected:
            return Response(status_code=499)
    deltas = generate(state, ctx.id, prepared, sampling, lora_name=lora or "")
    if req.echo_only:
        deltas = _without_output(deltas)
    if req.stream:
        usage_chunk = ctx.usage_chunk if req.options.include_usage else None
        return await stream_sse(request, deltas, ctx.chunks, usage_chunk, ctx.text_event)
    try:
        results = await until_disconnected(request, collect(deltas, len(prepared) * sampling.n))
    except ClientDisconnected:
        return Response(status_code=499)
    return JSONResponse(ctx.response(results))


async def _without_output(deltas: AsyncIterator[SequenceDelta]) -> AsyncIterator[SequenceDelta]:
    """echo with max_tokens 0: the one token the engine generated is dropped (its text, id and
    logprob); the choice ends with ``length``, as nothing more may be generated."""
    async with contextlib.aclosing(deltas):  # type: ignore[type-var]
        async for d in deltas:
            yield replace(
                d,
                text="",
                token_ids=(),
                logprobs=(),
                finish_reason="length" if d.finish_reason is not None else None,
                stop_reason=None,
            )


class _Context:
    """Per-call state for building completion responses and chunks."""

    def __init__(
        self,
        req: CompletionRequest,
        tokenizer: Tokenizer,
        prompt_ids: list[list[int]],
        echo_texts: list[str],
        request_id: str,
        model: str,
    ) -> None:
        self.req = req
        self.tok = tokenizer
        self.prompt_ids = prompt_ids
        self.echo_texts = echo_texts
        self.id = request_id
        self.model = model
        self.created = int(time.time())
        self._logprobs: dict[int, CompletionLogprobs] = {}
        self._texts: TokenTexts = TOKEN_ID_TEXTS if req.options.tokens_as_token_ids else tokenizer
        self._num_tokens: dict[int, int] = {}  # output tokens so far, per choice (streaming)
        # A plain stream (no logprobs, token ids or running usage) varies only in the text
        # between a choice's first and last chunk: those events come from TextEvents.
        o = req.options
        plain = req.sampling.engine.logprobs is None and not (
            o.return_token_ids or o.continuous_usage
        )
        self.text_event = PlainTextEvents(plain, self.chunks).event

    def _head(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
        }

    def _logprobs_for(
        self,
        index: int,
        prompt_index: int,
        first: bool,
        token_ids: list[int],
        logprobs: list[TokenLogprob],
        prompt_logprobs: tuple[TokenLogprob, ...],
    ) -> dict[str, Any] | None:
        num_top = self.req.sampling.engine.logprobs
        if num_top is None:
            return None
        builder = self._logprobs.setdefault(index, CompletionLogprobs(self._texts, num_top))
        ids: list[int] = []
        entries: list[TokenLogprob | None] = []
        if self.req.echo and first:
            prompt = self.prompt_ids[prompt_index]
            ids += prompt
            entries += [None, *prompt_logprobs][: len(prompt)]
            entries += [None] * (len(prompt) - len(entries))
        ids += token_ids
        entries += [*logprobs][: len(token_ids)]
        entries += [None] * (len(ids) - len(entries))
        return builder.build(ids, entries)

    def _echo(self, prompt_index: int) -> str:
        """The echoed prompt text; none when the token ids are returned (vLLM leaves the prompt
        undecoded then: ``prompt_token_ids`` holds it)."""
        if not self.req.echo or self.req.options.return_token_ids:
            return ""
        return self.echo_texts[prompt_index]

    def _extras(
        self,
        first: bool,
        prompt_index: int,
        token_ids: list[int] | tuple[int, ...],
        entries: tuple[TokenLogprob, ...],
    ) -> dict[str, Any]:
        """The choice's vLLM fields: prompt logprobs and prompt token ids (the first chunk of a
        choice carries them) and the output token ids, each only when asked for."""
        extras: dict[str, Any] = {}
        if self.req.prompt_logprobs is not None and first:
            extras["prompt_logprobs"] = prompt_logprobs(self.tok, entries, self.req.prompt_logprobs)
        if self.req.options.return_token_ids:
            extras["prompt_token_ids"] = self.prompt_ids[prompt_index] if first else None
            extras["token_ids"] = list(token_ids)
        return extras

    def chunks(self, d: SequenceDelta) -> list[dict[str, Any]]:
        text = (self._echo(d.prompt_index) if d.first else "") + d.text
        logprobs = self._logprobs_for(
            d.index, d.prompt_index, d.first, list(d.token_ids), list(d.logprobs), d.prompt_logprobs
        )
        num_tokens = self._num_tokens[d.index] = self._num_tokens.get(d.index, 0) + len(d.token_ids)
        extras = self._extras(d.first, d.prompt_index, d.token_ids, d.prompt_logprobs)
        worth_sending = text or d.finish_reason is not None or (logprobs and logprobs["tokens"])
        if not worth_sending and not (extras and (d.first or d.token_ids)):
            return []
        chunk = self._head()
        chunk["choices"] = [
            {
                "index": d.index,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": d.finish_reason,
                "stop_reason": d.stop_reason,
                **extras,
            }
        ]
        if self.req.options.continuous_usage:
            chunk["usage"] = running_usage(d.num_prompt_tokens, num_tokens)
        elif self.req.options.include_usage:
            chunk["usage"] = None
        return [chunk]

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        chunk = self._head()
        chunk["choices"] = []
        chunk["usage"] = usage
        return chunk

    def response(self, results: list[ChoiceResult]) -> dict[str, Any]:
        usage = UsageCounter(details=self.req.options.prompt_tokens_details)
        choices = []
        for r in results:
            usage.prompt_tokens[r.prompt_index] = r.num_prompt_tokens
            usage.cached_tokens[r.prompt_index] = max(
                usage.cached_tokens.get(r.prompt_index, 0), r.num_cached_tokens
            )
            usage.completion_tokens += len(r.token_ids)
            choices.append(
                {
                    "index": r.index,
                    "text": self._echo(r.prompt_index) + r.text,
                    "logprobs": self._logprobs_for(
                        r.index, r.prompt_index, True, r.token_ids, r.logprobs, r.prompt_logprobs
                    ),
                    "finish_reason": r.finish_reason,
                    "stop_reason": r.stop_reason,
                    # vLLM sends these keys always, null when not asked for (the openai client
                    # reads them as attributes).
                    **_UNASKED,
                    **self._extras(True, r.prompt_index, r.token_ids, r.prompt_logprobs),
                }
            )
        return {**self._head(), "choices": choices, "usage": usage.as_dict()}
