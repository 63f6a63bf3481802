"""What a ``Stream`` call holds for its client between engine steps and gRPC writes.

The engine steps at its own pace; the client reads at its own. Steps that arrive while the
previous message is still being written, or while the client's window (the contract's
``FlowControl``) is full, are merged here into one message instead of queueing one message per
step: a slow client gets fewer, larger messages, and the engine holds one pending batch per
client rather than a backlog that grows with every step.

Merging keeps the contract's rules: a message has at most one entry per request id, holding that
request's tokens (and logprobs) of every merged step in order and the latest value of its other
fields; no output follows a finished one or an error for the same id, so a request id that
ended and was reused (or refused twice) starts a new message. A merged message also says how
many tokens each of its steps carried (``step_tokens``), so the client's per-step figures
(vLLM's iteration_tokens) stay exact.
"""

from __future__ import annotations

from collections import deque
from dataclasses import replace

from engine_svc.core.outputs import EngineCoreOutput
from engine_svc.loop.clients import ClientBatch
from protos.flow_window import FlowWindow


class _Merged:
    """Consecutive steps merged into one message. The first step's batch is kept as it is; the
    lookups that merging needs are built only when a second step comes (most never does)."""

    __slots__ = ("outputs", "errors", "load", "step_tokens", "_index", "_copied", "_ended")

    def __init__(self, batch: ClientBatch) -> None:
        self.outputs, self.errors, self.load = batch.outputs, batch.errors, batch.load
        self.step_tokens: list[int] | None = None  # each step's tokens, once a second one comes
        self._index: dict[str, int] | None = None
        self._copied: set[str] = set()  # entries that are our own copies, safe to extend in place
        self._ended: set[str] = set()  # ids nothing may follow in this message: finished, failed

    def _lookups(self) -> dict[str, int]:
        if self._index is None:
            self.outputs, self.errors = list(self.outputs), list(self.errors)
            self._index = {o.request_id: i for i, o in enumerate(self.outputs)}
            self._ended = {o.request_id for o in self.outputs if o.finished}
            self._ended.update(rid for rid, _ in self.errors)
        return self._index

    def accepts(self, batch: ClientBatch) -> bool:
        self._lookups()
        ended = self._ended
        return not any(o.request_id in ended for o in batch.outputs) and not any(
            rid in ended for rid, _ in batch.errors
        )

    def merge(self, batch: ClientBatch) -> None:
        # Each step that carried tokens (not the batches of aborts or refusals between steps).
        if self.step_tokens is None:  # (the first step's outputs, not yet extended)
            self.step_tokens = [n] if (n := _tokens(self.outputs)) else []
        if n := _tokens(batch.outputs):
            self.step_tokens.append(n)
        index = self._lookups()
        for o in batch.outputs:
            rid = o.request_id
            i = index.get(rid)
            if i is None:
                index[rid] = len(self.outputs)
                self.outputs.append(o)
            else:
                self.outputs[i] = self._extend(self.outputs[i], o)
            if o.finished:
                self._ended.add(rid)
        self.errors.extend(batch.errors)
        self._ended.update(rid for rid, _ in batch.errors)
        if batch.load is not None:
            self.load = batch.load

    def _extend(self, a: EngineCoreOutput, b: EngineCoreOutput) -> EngineCoreOutput:
        """``a`` followed by ``b`` of the same request (``a`` unfinished), as one output."""
        if a.request_id not in self._copied:  # never change the engine's own objects
            a = replace(a, new_token_ids=list(a.new_token_ids), new_logprobs=list(a.new_logprobs))
            self._copied.add(a.request_id)
        a.new_token_ids.extend(b.new_token_ids)
        a.new_logprobs.extend(b.new_logprobs)
        if a.prompt_logprobs is None:
            a.prompt_logprobs = b.prompt_logprobs
        a.finish_reason, a.stop_reason = b.finish_reason, b.stop_reason
        a.num_cached_tokens = b.num_cached_tokens
        a.num_prompt_tokens = b.num_prompt_tokens or a.num_prompt_tokens
        if b.phase_times is not None:
            a.phase_times = b.phase_times
        if b.pooled is not None:
            a.pooled = b.pooled
        return a

    def batch(self) -> ClientBatch:
        steps = self.step_tokens
        return ClientBatch(
            self.outputs, self.errors, self.load, tuple(steps) if steps and len(steps) > 1 else ()
        )


def _tokens(outputs: list[EngineCoreOutput]) -> int:
    """A step's tokens for one client: the prompts it completed plus the tokens it generated."""
    return sum(len(o.new_token_ids) + (o.num_prompt_tokens if o.first else 0) for o in outputs)


class StreamOutbox:
    """The steps a Stream has not sent yet, merged, and the client's window.

    ``add`` a step's batch as it comes; ``ready`` says whether a message may be sent now; ``take``
    returns it (and counts it sent); ``flow`` records the client's window and progress.
    """

    def __init__(self) -> None:
        self._pending: deque[_Merged] = deque()
        self.flow_window = FlowWindow()
        self.steps_merged = 0  # batches folded into an earlier one, for tests and metrics

    def add(self, batch: ClientBatch) -> None:
        last = self._pending[-1] if self._pending else None
        if last is not None and last.accepts(batch):
            last.merge(batch)
            self.steps_merged += 1
        else:
            self._pending.append(_Merged(batch))

    @property
    def window(self) -> int:
        return self.flow_window.window

    @property
    def sent(self) -> int:
        return self.flow_window.sent

    @property
    def read(self) -> int:
        return self.flow_window.read

    def flow(self, window: int, messages_read: int) -> None:
        """The client's FlowControl (``protos.flow_window``)."""
        self.flow_window.flow(window, messages_read)

    def drop_window(self) -> None:
        """The client half-closed (it can report no more progress) or the stream is ending:
        what is held goes out as gRPC takes it, whatever window comes later."""
        self.flow_window.drop()

    @property
    def empty(self) -> bool:
        return not self._pending

    def ready(self) -> bool:
        """Something to send, and room for it in the client's window."""
        return bool(self._pending) and not self.flow_window.full

    def take(self) -> ClientBatch:
        self.flow_window.sent += 1
        return self._pending.popleft().batch()
