"""One request's engine outputs, handed from the engine-stream reader to the request's consumer.

The reader (``EngineClient._dispatch``, on the gateway's event loop) calls :meth:`put` for every
output and :meth:`fail` when the request fails; the consumer awaits :meth:`get` (or, on the
per-token path, calls :meth:`take` and awaits :meth:`wait` when it gets None), which returns
everything that arrived since its previous call merged into one output. A client slower than the
engine therefore gets fewer, larger deltas instead of a backlog that grows with every step
(vLLM's ``RequestOutputCollector``), and a consumer that keeps up takes each output without a
queue or a task in between.
"""

from __future__ import annotations

import asyncio

from protos.types import EngineOutput, TokenLogprob


class OutputCollector:
    __slots__ = ("_pending", "_error", "_waiter", "_loop", "prefilled", "ended")

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None  # the consumer's, at its first wait
        self._pending: list[EngineOutput] = []
        self._error: Exception | None = None
        self._waiter: asyncio.Future[None] | None = None
        self.prefilled = False  # a token has arrived (the reader counts the prompt once)
        # The consumer has taken the request's last output or its error: nothing to abort.
        # Set here, where both are seen, so no consumer can get the order wrong.
        self.ended = False

    def put(self, output: EngineOutput) -> None:
        self._pending.append(output)
        self._wake()

    def fail(self, error: Exception) -> None:
        """The request failed: :meth:`get` raises ``error`` once the outputs before it are taken."""
        if self._error is None:
            self._error = error
        self._wake()

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    async def get(self) -> EngineOutput:
        """The outputs since the last call, merged; waits when there are none."""
        while (output := self.take()) is None:
            await self.wait()
        return output

    def take(self) -> EngineOutput | None:
        """The outputs since the last call, merged; None when there are none yet. Raises the
        request's error once every output before it has been taken."""
        pending = self._pending
        if not pending:
            if self._error is not None:
                self.ended = True
                raise self._error
            return None
        self._pending = []
        output = pending[0] if len(pending) == 1 else merge_outputs(pending)
        if output.finish_reason is not None:
            self.ended = True
        return output

    def wait(self) -> asyncio.Future[None]:
        """A future done when an output or the error arrives (at once if one is there). A
        consumer on the per-token path awaits it directly, with ``take``: ``get`` costs a
        coroutine more per token."""
        waiter = self._waiter
        if waiter is None or waiter.done():  # done: woken before, or its awaiter was cancelled
            loop = self._loop
            if loop is None:
                loop = self._loop = asyncio.get_running_loop()
            waiter = self._waiter = loop.create_future()
            if self._pending or self._error is not None:
                waiter.set_result(None)
        return waiter

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


def merge_outputs(outputs: list[EngineOutput]) -> EngineOutput:
    """Consecutive outputs of one request as one: tokens and logprobs in order, the prompt
    logprobs of the first, the finish reason, figures and pooled result of the last (the phase
    times of the last that has them)."""
    first, last = outputs[0], outputs[-1]
    timed = next((o for o in reversed(outputs) if o.queued_time_s is not None), last)
    token_ids: list[int] = []
    logprobs: list[TokenLogprob] = []
    for o in outputs:
        token_ids += o.new_token_ids
        logprobs += o.logprobs
    return EngineOutput(
        request_id=first.request_id,
        new_token_ids=tuple(token_ids),
        logprobs=tuple(logprobs),
        prompt_logprobs=first.prompt_logprobs,
        finish_reason=last.finish_reason,
        stop_reason=last.stop_reason,
        num_cached_tokens=max(o.num_cached_tokens for o in outputs),
        num_prompt_tokens=last.num_prompt_tokens or first.num_prompt_tokens,
        queued_time_s=timed.queued_time_s,
        prefill_time_s=timed.prefill_time_s,
        decode_time_s=last.decode_time_s,
        pooled=last.pooled,
    )
