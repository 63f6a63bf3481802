"""What a ``Stream`` call holds for its client between engine steps and gRPC writes: the
contract's rule for merging steps, kept once for every engine (the engine's Stream, the test
fake engine, the benchmark stand-in).

The engine steps at its own pace; the client reads at its own. Steps that arrive while the
previous message is still being written, or while the client's window (``FlowControl``,
:mod:`protos.flow_window`) is full, are merged here into one ``EngineCoreOutputs`` instead of
queueing one message per step: a slow client gets fewer, larger messages, and the engine holds
one pending message per client rather than a backlog that grows with every step.

Merging keeps the contract's rules: a message has at most one entry per request id, holding that
request's tokens (and logprobs) of every merged step in order and the latest value of its other
fields; no output follows a finished one or an error for the same id, so a request id that
ended and was reused (or refused twice) starts a new message. A merged message also says how
many tokens each of its steps carried (``step_tokens``), so the client's per-step figures
(vLLM's iteration_tokens) stay exact: the caller says what each step carried, since only the
engine knows which of its outputs completed a prompt.

Works on the messages themselves: a step is converted once, when it comes; a merge extends
the held message's repeated fields (C code under upb). No torch, no service import.
"""

from __future__ import annotations

import time
from collections import deque

from protos.flow_window import FlowWindow
from protos.tandem.engine.v1 import engine_pb2 as pb


class _Held:
    """Consecutive steps merged into one message. The lookups that merging needs are built
    only when a second step comes (most messages never get one)."""

    __slots__ = ("message", "step_tokens", "_entries", "_ended")

    def __init__(self, message: pb.EngineCoreOutputs, tokens: int) -> None:
        self.message = message
        self.step_tokens = [tokens] if tokens else []  # each step's tokens that carried any
        self._entries: dict[str, pb.RequestOutput] | None = None  # each request's entry
        self._ended: set[str] = set()  # ids nothing may follow in this message: finished, failed

    def merge(self, step: pb.EngineCoreOutputs, tokens: int) -> bool:
        """Fold ``step`` in, unless it has an output or error for a request that ended in this
        message (then nothing changes and the answer is False)."""
        entries, ended = self._entries, self._ended
        if entries is None:
            outputs = self.message.outputs
            entries = self._entries = {o.request_id: o for o in outputs}
            ended.update(o.request_id for o in outputs if o.finish_reason)
            ended.update(e.request_id for e in self.message.errors)
        ids = [o.request_id for o in step.outputs]
        errors = [e.request_id for e in step.errors]
        if ended and (not ended.isdisjoint(ids) or not ended.isdisjoint(errors)):
            return False
        if tokens:  # (not the messages of aborts or refusals between steps)
            self.step_tokens.append(tokens)
        outputs = self.message.outputs
        for rid, o in zip(ids, step.outputs, strict=True):
            entry = entries.get(rid)
            if entry is None:
                outputs.append(o)
                entries[rid] = outputs[-1]
            else:
                _extend(entry, o)
            if o.finish_reason:
                ended.add(rid)
        if errors:
            self.message.errors.extend(step.errors)
            ended.update(errors)
        if step.HasField("load"):
            self.message.load.CopyFrom(step.load)
        return True

    def take(self) -> pb.EngineCoreOutputs:
        message = self.message
        if len(self.step_tokens) > 1:
            message.step_tokens.extend(self.step_tokens)
        message.timestamp = time.time()
        return message


def _extend(a: pb.RequestOutput, b: pb.RequestOutput) -> None:
    """``a`` followed by ``b`` of the same request (``a`` unfinished), as one output.

    Protobuf's own merge is the contract's rule here, field by field: the repeated fields (the
    tokens, their logprobs) are appended in order; a field ``b`` sets (its finish and stop
    reason, phase times, counts, pooled result) replaces ``a``'s, one ``b`` leaves unset keeps
    ``a``'s. (``a`` is unfinished, so it has no stop reason or pooled result to mix with ``b``'s;
    prompt logprobs come with a request's first output only.) One call into upb's C code."""
    a.MergeFrom(b)


class StreamOutbox:
    """The steps a Stream has not sent yet, merged, and the client's window.

    ``add`` each step's message as it comes, with the tokens the step carried for this client
    (the prompts it completed plus the tokens it generated; 0 for aborts and refusals);
    ``ready`` says whether a message may be sent now; ``take`` returns it (stamped, and counted
    sent); ``flow`` records the client's window and progress.
    """

    def __init__(self) -> None:
        self._pending: deque[_Held] = deque()
        self.flow_window = FlowWindow()
        self.steps_merged = 0  # messages folded into an earlier one, for tests and metrics

    def add(self, step: pb.EngineCoreOutputs, tokens: int = 0) -> None:
        if self._pending and self._pending[-1].merge(step, tokens):
            self.steps_merged += 1
        else:
            self._pending.append(_Held(step, tokens))

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

    def take(self) -> pb.EngineCoreOutputs:
        self.flow_window.sent += 1
        return self._pending.popleft().take()
