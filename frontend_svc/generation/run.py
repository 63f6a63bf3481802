"""Runs the engine requests behind one API call: n sequences per prompt, merged into one stream;
or one pooling request per input, collected in order.

Each sequence is one engine request. Their deltas are merged in arrival order; closing the merged
stream cancels every sequence, which closes its engine generator and so aborts it on the engine
(and counts it in ``vllm:request_success{finished_reason="abort"}``, as vLLM counts a request
whose client left).
A call with one sequence streams it directly, with no merge task or queue. Pooling inputs run
concurrently, a bounded number at a time (``pool``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator, Collection, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from frontend_svc.engine.errors import EngineRequestError, EngineUnavailableError
from frontend_svc.engine.pool import EnginePool
from frontend_svc.generation.structured_errors import name_constraint_errors
from frontend_svc.generation.token_constraints import PreparedPrompt, resolve_token_constraints
from frontend_svc.protocol import SamplingOptions
from frontend_svc.server.metrics import Metrics, SequenceTimer
from frontend_svc.server.state import GatewayState
from frontend_svc.text.output_processor import OutputProcessor, SequenceDelta
from protos.types import (
    EngineErrorCode,
    EngineOutput,
    EnginePoolingParams,
    EngineRequest,
    EngineSamplingParams,
    TokenLogprob,
)

T = TypeVar("T")


class _RandomBytes:
    """``os.urandom`` read 4 KiB at a time: a request id costs one getrandom call per 256 ids,
    not one each (~10 us apiece on a VM). Refilled in a forked child, which must not repeat
    its parent's ids."""

    def __init__(self) -> None:
        self._buffer, self._at, self._pid = b"", 0, -1

    def take(self, n: int) -> bytes:
        if self._at + n > len(self._buffer) or self._pid != os.getpid():
            self._buffer, self._at, self._pid = os.urandom(4096), 0, os.getpid()
        start, self._at = self._at, self._at + n
        return self._buffer[start : self._at]


_random_bytes = _RandomBytes()


def random_id(prefix: str) -> str:
    """``<prefix>-`` and 32 random hex digits (vLLM's ids are a uuid4's hex: 122 random bits)."""
    return f"{prefix}-{_random_bytes.take(16).hex()}"


def generate(
    state: GatewayState,
    request_id: str,
    prompts: Sequence[PreparedPrompt],
    options: SamplingOptions,
    kept_special_ids: Collection[int] = (),
    lora_name: str = "",
) -> AsyncIterator[SequenceDelta]:
    """Start ``options.n`` sequences per prompt; choice index = prompt index * n + i.

    ``kept_special_ids``: special tokens whose text stays in the output even with
    ``skip_special_tokens`` (what a tool-call parser needs to read)."""
    tokenizer, info = state.require_engine()
    options = resolve_token_constraints(options, tokenizer, info.vocab_size)
    streams: list[AsyncIterator[SequenceDelta]] = []
    for p_idx, prompt in enumerate(prompts):
        for i in range(options.n):
            index = p_idx * options.n + i
            engine_request = EngineRequest(
                request_id=f"{request_id}-{index}",
                prompt_token_ids=prompt.token_ids,
                sampling_params=options.engine_params(prompt.max_tokens, i),
                arrival_time=time.time(),
                lora_name=lora_name,
            )
            processor = OutputProcessor(
                tokenizer,
                prompt.token_ids,
                options.stop,
                options.include_stop_str_in_output,
                options.skip_special_tokens,
                index=index,
                prompt_index=p_idx,
                min_tokens=options.engine.min_tokens,
                kept_special_ids=kept_special_ids,
            )
            timer = state.metrics.sequence(
                len(prompt.token_ids), options.n, engine_request.sampling_params.max_tokens
            )
            streams.append(_run_sequence(state.engines, engine_request, processor, timer))
    # One sequence (n=1, one prompt: nearly every call) is its own stream: no merge task.
    deltas = streams[0] if len(streams) == 1 else merge(streams)
    if options.structured_output_param is not None:
        deltas = name_constraint_errors(deltas, options.structured_output_param)
    return deltas


async def _run_sequence(
    engines: EnginePool, request: EngineRequest, processor: OutputProcessor, timer: SequenceTimer
) -> AsyncIterator[SequenceDelta]:
    try:
        async with contextlib.aclosing(engines.generate(request)) as outputs:
            async for out in outputs:
                delta = processor.process(out)
                timer.observe(out, delta.finish_reason)
                yield delta
                if delta.finish_reason is not None:
                    return  # a stop string ends it early: leaving aborts the engine request
    except (GeneratorExit, asyncio.CancelledError):
        timer.aborted()  # closed before its end (the client left): the engine request aborted
        raise


# At most this many engine requests of one pooling call run at once: a call with 2048 inputs
# must not fill the engine's waiting queue (1024 by default) and be refused as "queue full".
POOLING_MAX_IN_FLIGHT = 256
_NO_SAMPLING = EngineSamplingParams()


async def pool(
    state: GatewayState,
    request_id: str,
    prompts: Sequence[Sequence[int]],
    params: EnginePoolingParams,
    priority: int = 0,
    lora_name: str = "",
) -> list[EngineOutput]:
    """Pool every prompt (one engine request each, ids ``{request_id}-{i}``) and return their
    final outputs in prompt order, each with its ``pooled`` result.

    At most ``POOLING_MAX_IN_FLIGHT`` run at once. The first failure is raised and aborts every
    request still running; so does cancelling the call (a client that went away).
    """
    engines, metrics, arrival = state.engines, state.metrics, time.time()

    def request(i: int) -> EngineRequest:
        ids = tuple(prompts[i])
        return EngineRequest(
            f"{request_id}-{i}", ids, _NO_SAMPLING, priority, arrival, params, lora_name
        )

    if len(prompts) == 1:  # nearly every call: no task
        return [await _pool_one(engines, metrics, request(0))]
    results: list[EngineOutput | None] = [None] * len(prompts)
    pending = iter(range(len(prompts)))

    async def worker() -> None:
        for i in pending:  # shared: each index is taken once
            results[i] = await _pool_one(engines, metrics, request(i))

    n = min(len(prompts), POOLING_MAX_IN_FLIGHT)
    workers = [asyncio.ensure_future(worker()) for _ in range(n)]
    try:
        await asyncio.gather(*workers)
    finally:
        for w in workers:  # after a failure or a cancellation: closing them aborts the rest
            w.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
    return [r for r in results if r is not None]


async def _pool_one(engines: EnginePool, metrics: Metrics, request: EngineRequest) -> EngineOutput:
    timer = metrics.sequence(len(request.prompt_token_ids))
    final: EngineOutput | None = None
    try:
        async with contextlib.aclosing(engines.generate(request)) as outputs:
            async for out in outputs:  # one output: the final one (an abort: raised by the client)
                final = out
    except asyncio.CancelledError:
        timer.aborted()  # the call was cancelled (its client left): the engine request aborted
        raise
    if final is None or final.finish_reason is None:
        raise EngineUnavailableError("the engine ended the pooling request without a result")
    if final.pooled is None:
        raise EngineRequestError(EngineErrorCode.INTERNAL, "The engine returned no pooled result.")
    timer.observe(final, final.finish_reason.value)
    return final


_DONE = object()


async def merge(streams: Sequence[AsyncIterator[T]]) -> AsyncIterator[T]:
    """Interleave several async iterators; the first error cancels the rest and is raised."""
    queue: asyncio.Queue[object] = asyncio.Queue()

    async def pump(stream: AsyncIterator[T]) -> None:
        try:
            async with contextlib.aclosing(stream):  # type: ignore[type-var]
                async for item in stream:
                    queue.put_nowait(item)
        except Exception as e:
            queue.put_nowait(_Failure(e))
        finally:
            queue.put_nowait(_DONE)

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is _DONE:
                remaining -= 1
            elif isinstance(item, _Failure):
                raise item.error
            else:
                yield item  # type: ignore[misc]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@dataclass
class _Failure:
    error: Exception


@dataclass
class ChoiceResult:
    """A whole choice, accumulated from its deltas (non-streaming responses)."""

    index: int
    prompt_index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0

    def add(self, d: SequenceDelta) -> None:
        self.text += d.text
        self.token_ids.extend(d.token_ids)
        self.logprobs.extend(d.logprobs)
        if d.first:
            self.prompt_logprobs = d.prompt_logprobs
        self.finish_reason = d.finish_reason or self.finish_reason
        self.stop_reason = d.stop_reason if d.finish_reason else self.stop_reason
        self.num_prompt_tokens = d.num_prompt_tokens
        self.num_cached_tokens = max(self.num_cached_tokens, d.num_cached_tokens)


async def collect(deltas: AsyncIterator[SequenceDelta], num_choices: int) -> list[ChoiceResult]:
    """Drain the merged stream into one result per choice, ordered by index."""
    results: dict[int, ChoiceResult] = {}
    async with contextlib.aclosing(deltas):  # type: ignore[type-var]
        async for d in deltas:
            results.setdefault(d.index, ChoiceResult(d.index, d.prompt_index)).add(d)
    return [results.get(i, ChoiceResult(i, 0)) for i in range(num_choices)]


@dataclass
class UsageCounter:
    """Token usage of one API call: prompts counted once, completions per choice."""

    prompt_tokens: dict[int, int] = field(default_factory=dict)  # per prompt index
    cached_tokens: dict[int, int] = field(default_factory=dict)
    completion_tokens: int = 0
    # prompt_tokens_details (--enable-prompt-tokens-details); otherwise null, as vLLM
    details: bool = False

    def add(self, d: SequenceDelta) -> None:
        self.prompt_tokens[d.prompt_index] = d.num_prompt_tokens
        previous = self.cached_tokens.get(d.prompt_index, 0)
        self.cached_tokens[d.prompt_index] = max(previous, d.num_cached_tokens)
        self.completion_tokens += len(d.token_ids)

    def as_dict(self) -> dict[str, object]:
        prompt = sum(self.prompt_tokens.values())
        cached = sum(self.cached_tokens.values())
        return {
            "prompt_tokens": prompt,
            "completion_tokens": self.completion_tokens,
            "total_tokens": prompt + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached} if self.details and cached else None,
        }
