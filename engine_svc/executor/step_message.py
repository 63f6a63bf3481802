"""One step's scheduler output as the workers receive it, and the requests they mirror.

The scheduler runs once, in the engine process, over live ``Request`` objects. A worker runs
the same step on its shard with a ``ModelRunner`` of its own, which reads the same fields of
the same requests; it keeps a mirror of each running request, brought up to date by each step's
message with what changed since the worker last heard of it::

    engine (rank 0)                               worker (rank r)
    SchedulerOutput ── StepEncoder.encode ──►  StepMessage ── RequestMirrors.decode ──►
                                                                   SchedulerOutput (mirrors)

    admitted request     a copy of the whole request (no grammar matcher)
    running request      its num_computed_tokens, and the output tokens rank 0 appended since;
                         the proposals it verifies this step (speculative decoding)
    finished/preempted   ids: the mirror is dropped (a preempted request comes back admitted)

Every rank must make the same collective calls in the same order, so a worker's runner must
take every decision rank 0's takes (which rows sample, which prompt-logprob chunks it computes):
the mirrors hold exactly what rank 0's requests hold for those decisions. Rank 0's sampled
tokens come with the next message and are what a worker feeds its model (``worker_proc``). A
structured-output request's grammar matcher stays with the scheduler: rank 0 masks and samples,
a worker's mirror has no grammar (its unmasked sample is replaced by rank 0's token before the
model sees it), and the grammar decides nothing a collective depends on.

Speculative decoding: the proposals are made on rank 0 only (n-gram, or its draft model); each
running row's come with the step (``ScheduledRequest.spec_token_ids`` on the worker too), so
every rank computes the same ``1 + k`` verification tokens. Rank 0's verification decides what
a row emits; a worker's may emit another number of tokens (a sampled row: its draws and its
draft's q are not rank 0's), and the next message's new output tokens replace them, count and
all (``worker_proc``).

LoRA: a mirror keeps its request's adapter id (``lora_id``), and the message brings what rank
0's adapter slots hold whenever that changed (``lora``: each slot's adapter id and directory,
rank 0 having already put this step's adapters in their slots), so a worker puts the same
adapter in the same slot (``LoRAManager.follow``) before its runner maps the step's tokens,
from the host copy rank 0 gave it when it took the adapter (``MultiprocExecutor.put_lora``).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass, field

from engine_svc.core.request import Request
from engine_svc.core.scheduler import ScheduledRequest, SchedulerOutput
from engine_svc.lora.registry import Placement


@dataclass(frozen=True)
class ScheduledDelta:
    """An admitted request: a copy of the whole request, as it is now."""

    request_id: str
    num_tokens: int  # tokens computed this step
    block_ids: list[int]
    snapshot: Request


@dataclass(frozen=True)
class StepMessage:
    """One step for the workers. Admitted requests travel whole; the running ones (nearly every
    row of a decode step) as columns of plain ints, which pickle and unpickle in a fraction of
    the time one object per row takes (256 decode rows: 0.64 -> 0.08 ms, 2-core VM)::

        is_admitted   1 or 0 per scheduled row, in schedule order (every rank orders its
                      batch the same way: the all-reduces sum rows by position)
        ids, num_tokens, num_computed           one entry per running row
        new_counts -> new_tokens                output tokens rank 0 appended since the last
                                                message, concatenated
        block_counts -> block_ids               blocks allocated this step, concatenated
        spec_counts -> spec_tokens              the proposals each row verifies this step,
                                                concatenated (both empty when no row has any)
        lora                                    rank 0's LoRA slots, when they changed
    """

    admitted: list[ScheduledDelta]
    is_admitted: bytes
    ids: list[str]
    num_tokens: list[int]
    num_computed: list[int]
    new_counts: list[int]
    new_tokens: list[int]
    block_counts: list[int]
    block_ids: list[int]
    num_batched_tokens: int
    preempted_ids: list[str]
    finished_ids: list[str]
    lora: Placement | None = None  # None: the slots hold what they held at the last message
    spec_counts: list[int] = field(default_factory=list)  # [] or one entry per running row
    spec_tokens: list[int] = field(default_factory=list)

    def new_token_runs(self) -> Iterator[tuple[str, list[int]]]:
        """(request id, the output tokens rank 0 appended since the last message) of each
        running row that has any."""
        at = 0
        for rid, n in zip(self.ids, self.new_counts, strict=True):
            if n:
                yield rid, self.new_tokens[at : at + n]
                at += n


class StepEncoder:
    """Rank 0's side: remembers how many output tokens each worker mirror holds."""

    def __init__(self) -> None:
        self._known: dict[str, int] = {}
        self._lora: Placement | None = None  # the LoRA slots the workers last heard of

    def encode(self, so: SchedulerOutput, lora: Placement | None = None) -> StepMessage:
        """``lora``: what rank 0's LoRA slots hold for this step (None: LoRA is off)."""
        known = self._known
        for rid in (*so.finished_ids, *so.preempted_ids):
            known.pop(rid, None)
        admitted: list[ScheduledDelta] = []
        flags = bytearray()
        ids: list[str] = []
        num_tokens: list[int] = []
        computed: list[int] = []
        new_counts: list[int] = []
        new_tokens: list[int] = []
        block_counts: list[int] = []
        block_ids: list[int] = []
        spec_counts: list[int] = []
        spec_tokens: list[int] = []
        for s in so.scheduled:
            req = s.request
            rid = req.request_id
            outputs = req.output_token_ids
            if s.admitted:
                assert not s.spec_token_ids, "an admitted row verifies no proposals"
                flags.append(1)
                admitted.append(ScheduledDelta(rid, s.num_tokens, s.block_ids, _snapshot(req)))
            else:
                flags.append(0)
                ids.append(rid)
                num_tokens.append(s.num_tokens)
                computed.append(req.num_computed_tokens)
                n = len(outputs) - known[rid]
                new_counts.append(n)
                if n:
                    new_tokens += outputs[len(outputs) - n :]
                block_counts.append(len(s.block_ids))
                if s.block_ids:
                    block_ids += s.block_ids
                spec_counts.append(len(s.spec_token_ids))
                if s.spec_token_ids:
                    spec_tokens += s.spec_token_ids
            known[rid] = len(outputs)
        changed = lora if lora != self._lora else None
        self._lora = lora
        return StepMessage(
            admitted, bytes(flags), ids, num_tokens, computed, new_counts, new_tokens,
            block_counts, block_ids, so.num_batched_tokens, list(so.preempted_ids),
            list(so.finished_ids), changed, spec_counts if spec_tokens else [], spec_tokens,
        )  # fmt: skip


def _snapshot(req: Request) -> Request:
    mirror = copy.copy(req)
    mirror.grammar = None  # rank 0 masks; the matcher (not picklable) stays with the scheduler
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
        requests = self.requests
        for rid in (*msg.finished_ids, *msg.preempted_ids):
            requests.pop(rid, None)
        scheduled = []
        admitted = iter(msg.admitted)
        row = tok = blk = at = 0
        spec_counts = msg.spec_counts
        for flag in msg.is_admitted:
            if flag:
                d = next(admitted)
                req = requests[d.request_id] = d.snapshot
                scheduled.append(ScheduledRequest(req, d.num_tokens, True, d.block_ids))
                continue
            req = requests[msg.ids[row]]
            n = msg.new_counts[row]
            if n:
                for token in msg.new_tokens[tok : tok + n]:
                    req.append_output_token(token)
                tok += n
            req.num_computed_tokens = msg.num_computed[row]
            nb = msg.block_counts[row]
            s = ScheduledRequest(req, msg.num_tokens[row], False, msg.block_ids[blk : blk + nb])
            if spec_counts and (ns := spec_counts[row]):
                s.spec_token_ids = msg.spec_tokens[at : at + ns]
                at += ns
            scheduled.append(s)
            blk += nb
            row += 1
        return SchedulerOutput(
            scheduled, msg.num_batched_tokens, msg.preempted_ids, msg.finished_ids
        )

    def keep_prompt_logprobs(self, prompt_logprobs: dict[str, list[object]]) -> None:
        """What the engine does with a step's prompt logprobs (only their count matters here)."""
        for rid, entries in prompt_logprobs.items():
            req = self.requests.get(rid)
            if req is not None:
                req.prompt_logprobs.extend([None] * len(entries))
