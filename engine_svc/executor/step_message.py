"""One step's scheduler output as the workers receive it, and the requests they mirror.

The scheduler runs once, in the engine process, over live ``Request`` objects. A worker runs
the same step on its shard with a ``ModelRunner`` of its own, which reads the same fields of
the same requests; it keeps a mirror of each running request, brought up to date by each step's
message with what changed since the worker last heard of it::

    engine (rank 0)                               worker (rank r)
    SchedulerOutput ── StepEncoder.encode ──►  StepMessage ── RequestMirrors.decode ──►
                                                                   SchedulerOutput (mirrors)

    admitted request     a copy of the whole request (no grammar matcher)
    running request      its num_computed_tokens, and the output tokens rank 0 appended since
    finished/preempted   ids: the mirror is dropped (a preempted request comes back admitted)

Every rank must make the same collective calls in the same order, so a worker's runner must
take every decision rank 0's takes (which rows sample, which prompt-logprob chunks it computes):
the mirrors hold exactly what rank 0's requests hold for those decisions. Rank 0's sampled
tokens come with the next message and are what a worker feeds its model (``worker_proc``). A
structured-output request (its grammar matcher lives with the scheduler) is refused for now.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from engine_svc.core.request import Request
from engine_svc.core.scheduler import ScheduledRequest, SchedulerOutput


class TensorParallelUnsupported(ValueError):
    """A request asks for something the tensor-parallel executor cannot run yet."""


@dataclass(frozen=True)
class ScheduledDelta:
    request_id: str
    num_tokens: int  # tokens computed this step
    admitted: bool
    block_ids: list[int]
    num_computed_tokens: int
    new_token_ids: list[int]  # running: output tokens appended since the last message
    snapshot: Request | None  # admitted: the request as it is now


@dataclass(frozen=True)
class StepMessage:
    scheduled: list[ScheduledDelta]
    num_batched_tokens: int
    preempted_ids: list[str]
    finished_ids: list[str]


class StepEncoder:
    """Rank 0's side: remembers how many output tokens each worker mirror holds."""

    def __init__(self) -> None:
        self._known: dict[str, int] = {}

    def encode(self, so: SchedulerOutput) -> StepMessage:
        """Raises ``TensorParallelUnsupported`` (changing nothing) for a request it cannot
        mirror."""
        for s in so.scheduled:
            if s.admitted:
                _check_mirrorable(s.request)
        for rid in (*so.finished_ids, *so.preempted_ids):
            self._known.pop(rid, None)
        deltas = []
        for s in so.scheduled:
            req = s.request
            outputs = req.output_token_ids
            snapshot, new = None, []
            if s.admitted:
                snapshot = _snapshot(req)
            else:
                new = outputs[self._known[req.request_id] :]
            self._known[req.request_id] = len(outputs)
            deltas.append(
                ScheduledDelta(
                    req.request_id,
                    s.num_tokens,
                    s.admitted,
                    s.block_ids,
                    req.num_computed_tokens,
                    new,
                    snapshot,
                )
            )
        return StepMessage(
            deltas, so.num_batched_tokens, list(so.preempted_ids), list(so.finished_ids)
        )


def _check_mirrorable(req: Request) -> None:
    if req.grammar is not None or req.sampling_params.structured_output is not None:
        raise TensorParallelUnsupported(
            f"request {req.request_id}: structured outputs are not supported with tensor "
            "parallelism yet"
        )


def _snapshot(req: Request) -> Request:
    mirror = copy.copy(req)
    mirror.all_token_ids = list(req.all_token_ids)
    mirror.output_token_ids = list(req.output_token_ids)
    mirror.prompt_logprobs = [None] * len(req.prompt_logprobs)  # only their count is read
    mirror.logprobs = []
    return mirror


class RequestMirrors:
    """A worker's side: its copies of the running requests."""

    def __init__(self) -> None:
        self.requests: dict[str, Request] = {}

    def decode(self, msg: StepMessage) -> SchedulerOutput:
        for rid in (*msg.finished_ids, *msg.preempted_ids):
            self.requests.pop(rid, None)
        scheduled = []
        for d in msg.scheduled:
            if d.snapshot is not None:
                req = self.requests[d.request_id] = d.snapshot
            else:
                req = self.requests[d.request_id]
                for token in d.new_token_ids:
                    req.append_output_token(token)
            req.num_computed_tokens = d.num_computed_tokens
            scheduled.append(ScheduledRequest(req, d.num_tokens, d.admitted, d.block_ids))
        return SchedulerOutput(
            scheduled, msg.num_batched_tokens, msg.preempted_ids, msg.finished_ids
        )

    def keep_prompt_logprobs(self, prompt_logprobs: dict[str, list[object]]) -> None:
        """What the engine does with a step's prompt logprobs (only their count matters here)."""
        for rid, entries in prompt_logprobs.items():
            req = self.requests.get(rid)
            if req is not None:
                req.prompt_logprobs.extend([None] * len(entries))
