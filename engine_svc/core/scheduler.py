"""The scheduler: one token budget per step, continuous batching, chunked prefill, preemption.

Each step walks running requests first, then waiting ones, giving each
``min(num_tokens - num_computed_tokens, budget left)`` tokens. There is no prefill or decode
phase: a long prompt simply takes several steps (chunked prefill), a decode takes one token.
When the KV pool cannot hold a running request's next tokens, the lowest-priority running
request (newest, under FCFS) is preempted: its blocks are freed and it is recomputed later.

A request with a structured-output grammar waits (WAITING_FOR_GRAMMAR) until the grammar is
compiled, keeping its place in the queue while the requests behind it are admitted; one whose
grammar does not compile finishes with an error (``take_errors``). Its matcher is advanced with
each token appended here, and the request stops once the grammar has accepted its end.

A pooling request is scheduled exactly like a prompt (same budget, chunks, blocks and prefix
cache), samples nothing, and finishes (STOPPED, its blocks freed) in the update of the step that
computed its last prompt token; the model runner pooled its hidden states in that step.

With LoRA adapters (``lora``), a waiting request whose adapter would push the running requests'
adapters plus the pinned ones past the device slots (max_loras) is stepped over like a compiling
one: it keeps its place, later requests with adapters already running (or none) go ahead, and it
is admitted once a slot frees. So every step's adapters fit the device together. A request holds
its adapter from add to finish (``LoRASlots.release``, whatever way it ends).
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from engine_svc.core.errors import DuplicateRequestError
from engine_svc.core.kv_cache_manager import KVCacheManager
from engine_svc.core.request import Request, RequestStatus

if TYPE_CHECKING:  # only read here; engine_svc.config pulls in the kernels (torch)
    from engine_svc.config import SchedulerConfig


class LoRASlots(Protocol):
    """What the scheduler asks of the LoRA adapters (``LoRAManager``; no torch needed)."""

    def can_admit(self, lora_id: int, running: set[int]) -> bool:
        """Whether a request with ``lora_id`` may run beside requests using ``running``."""
        ...

    def release(self, lora_id: int) -> None:
        """A request holding ``lora_id`` finished."""
        ...


@dataclass
class ScheduledRequest:
    request: Request
    num_tokens: int  # tokens computed this step, starting at request.num_computed_tokens
    # Admitted from the waiting queue this step (new, or back after a preemption): block_ids are
    # all of its blocks and the model runner (re)builds its row. Otherwise block_ids are only the
    # blocks allocated this step (usually none), so a step costs O(new blocks), not O(blocks).
    admitted: bool
    block_ids: list[int]
    # Speculative decoding: proposed tokens computed after the request's last token in this
    # step (num_tokens = 1 + their count), verified by the runner; empty for every other row.
    spec_token_ids: Sequence[int] = ()  # (a shared empty tuple: no list per row and step)


@dataclass
class SchedulerOutput:
    """What one step computes: the only thing the model runner is handed."""

    scheduled: list[ScheduledRequest]
    num_batched_tokens: int
    preempted_ids: list[str] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)  # freed since the last step

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class SchedulerStats:
    """The scheduler's figures at one moment: gauges (requests running and waiting, KV cache
    usage, requests per LoRA adapter) and the counters of the current interval (prefix-cache
    queries and hits, preemptions), which ``Scheduler.take_stats`` starts again from zero."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    # With LoRA adapters: requests per adapter name, running and waiting (vLLM's figures).
    running_lora_adapters: dict[str, int] = field(default_factory=dict)
    waiting_lora_adapters: dict[str, int] = field(default_factory=dict)
    num_waiting_deferred: int = 0  # of num_waiting: grammar compiling or no LoRA slot (vLLM's)
    # Speculative decoding in the interval (vLLM's spec_decode counters): requests verified,
    # tokens proposed, tokens accepted, and accepted tokens by position in the proposal.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=list)


class _WaitingQueue:
    """FCFS deque, or a (priority, arrival) heap under the priority policy. Keeps how many of
    its requests use each LoRA adapter (``per_adapter``), so the step's stats need not walk a
    long queue."""

    def __init__(self, by_priority: bool) -> None:
        self.by_priority = by_priority
        self._fifo: deque[Request] = deque()
        self._heap: list[tuple[tuple[int, float], int, Request]] = []
        self._tie = itertools.count()
        self.per_adapter: dict[str, int] = {}

    def _count(self, request: Request, delta: int) -> None:
        if (name := request.lora_name) is not None:
            if n := self.per_adapter.get(name, 0) + delta:
                self.per_adapter[name] = n
            else:
                del self.per_adapter[name]

    def add(self, request: Request, front: bool = False) -> None:
        self._count(request, 1)
        if self.by_priority:
            heapq.heappush(self._heap, (request.sort_key(), next(self._tie), request))
        elif front:
            self._fifo.appendleft(request)
        else:
            self._fifo.append(request)

    def peek(self) -> Request:
        return self._heap[0][2] if self.by_priority else self._fifo[0]

    def pop(self) -> Request:
        request = heapq.heappop(self._heap)[2] if self.by_priority else self._fifo.popleft()
        self._count(request, -1)
        return request

    def remove(self, doomed: set[Request]) -> None:
        for r in self:
            if r in doomed:
                self._count(r, -1)
        if self.by_priority:
            self._heap = [e for e in self._heap if e[2] not in doomed]
            heapq.heapify(self._heap)
        else:
            self._fifo = deque(r for r in self._fifo if r not in doomed)

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter([e[2] for e in self._heap] if self.by_priority else self._fifo)

    def __len__(self) -> int:
        return len(self._heap) if self.by_priority else len(self._fifo)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv_manager: KVCacheManager,
        max_model_len: int,
        lora: LoRASlots | None = None,
        num_lookahead_tokens: int = 0,
    ) -> None:
        """``max_model_len``: the longest prompt + output, a fact found when the engine is built
        (the checkpoint's context, shortened to what the KV cache holds).
        ``num_lookahead_tokens``: KV slots a step that reaches a request's last token allocates
        past it, for a draft model's proposals (k with a draft model, else 0)."""
        if not config.enable_chunked_prefill and config.max_num_batched_tokens < max_model_len:
            raise ValueError(
                "without chunked prefill max_num_batched_tokens must be >= max_model_len "
                f"({config.max_num_batched_tokens} < {max_model_len})"
            )
        self.config = config
        self.max_model_len = max_model_len
        self.kv = kv_manager
        self.lora = lora
        self.num_lookahead_tokens = num_lookahead_tokens
        self.requests: dict[str, Request] = {}
        self.waiting = _WaitingQueue(config.policy == "priority")
        self.running: list[Request] = []
        self._finished_ids: list[str] = []
        self._num_preemptions = 0
        self._compiling: dict[str, Request] = {}  # WAITING_FOR_GRAMMAR, in arrival order
        self._lora_deferred = 0  # waiting requests the last step stepped over for a LoRA slot
        # Speculative decoding counters of the interval (see SchedulerStats).
        self._spec_drafts = self._spec_draft_tokens = self._spec_accepted = 0
        self._spec_per_pos: list[int] = []
        self._errors: list[tuple[str, Exception]] = []  # failed since the last take_errors()

    # ------------------------------------------------------------------ requests in and out
    def add_request(self, request: Request) -> None:
        """Queue a request whose prompt was checked against the context length where it entered
        the engine (``ModelInfo``: the gRPC edge, or ``EngineCore.add_request``)."""
        if request.request_id in self.requests:
            raise DuplicateRequestError(f"request_id {request.request_id!r} is already in use")
        # Invariants the schedule relies on, not checks (those are ModelInfo's, and the engine
        # serves a max_model_len the cache holds): a generation prompt leaves room for its first
        # token within max_model_len (the runner's rows are max_model_len long), and no request
        # needs more blocks than the whole cache (it would preempt all the others, then itself,
        # forever).
        # Raised, not asserted: they hold under python -O too, and a caller that skipped the
        # checks gets an internal error rather than a loop that never ends.
        room = 0 if request.is_pooling else 1
        if request.num_tokens + room > self.max_model_len:
            raise RuntimeError(
                f"scheduler invariant: prompt has {request.num_tokens} tokens; "
                f"max_model_len is {self.max_model_len}"
            )
        needed = -(-request.num_tokens // self.kv.block_size)
        if needed > self.kv.num_blocks:
            raise RuntimeError(
                f"scheduler invariant: prompt needs {needed} KV blocks but the cache only has "
                f"{self.kv.num_blocks}"
            )
        # A cached grammar is ready at once; one known not to compile raises its error here.
        if request.grammar is not None and not request.grammar.ready():
            request.status = RequestStatus.WAITING_FOR_GRAMMAR
            self._compiling[request.request_id] = request
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def abort_requests(self, request_ids: Iterable[str]) -> list[Request]:
        """Abort waiting or running requests; unknown or finished ids are ignored."""
        # Fix: dict.fromkeys drops repeated ids, which were finished (and freed) twice.
        doomed = [self.requests[r] for r in dict.fromkeys(request_ids) if r in self.requests]
        if not doomed:
            return []
        doomed_set = set(doomed)
        self.running = [r for r in self.running if r not in doomed_set]
        self.waiting.remove(doomed_set)
        for request in doomed:
            self.finish(request, RequestStatus.FINISHED_ABORTED)
        return doomed

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Mark finished and free its blocks; the caller has removed it from the queues."""
        request.status = status
        self.kv.free(request)
        if request.lora_id and self.lora is not None:
            self.lora.release(request.lora_id)
        del self.requests[request.request_id]
        self._compiling.pop(request.request_id, None)
        self._finished_ids.append(request.request_id)

    def take_errors(self) -> list[tuple[str, Exception]]:
        """(request id, error) of the requests that failed since the last call; each is
        finished (FINISHED_ERROR) and produces no output."""
        errors, self._errors = self._errors, []
        return errors

    def num_waiting_for_grammar(self) -> int:
        return len(self._compiling)

    def _fail(self, request: Request, error: Exception) -> None:
        """Finish a request with an error; the caller has removed it from ``running``."""
        self.waiting.remove({request})
        self.finish(request, RequestStatus.FINISHED_ERROR)
        self._errors.append((request.request_id, error))

    def _check_grammars(self) -> None:
        """Release requests whose grammar is compiled; fail those whose grammar is invalid."""
        for request in list(self._compiling.values()):
            assert request.grammar is not None
            try:
                if not request.grammar.ready():
                    continue
            except ValueError as e:  # the grammar does not compile
                self._fail(request, e)
                continue
            request.status = RequestStatus.WAITING
            del self._compiling[request.request_id]

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ------------------------------------------------------------------ one step
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []
        if self._compiling:
            self._check_grammars()

        # 1) Running requests, oldest first. Preempt from the other end when blocks run out.
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new <= 0:  # everything computed; waits for its sampled token
                i += 1
                continue
            spec: Sequence[int] = ()
            if request.spec_token_ids:
                spec = self._spec_tokens(request, num_new, budget)
                num_new += len(spec)
            lookahead = (
                self._lookahead(request, request.num_computed_tokens, num_new)
                if self.num_lookahead_tokens  # (a draft model only: no call per row otherwise)
                else 0
            )
            while (new_blocks := self.kv.allocate_slots(request, num_new, None, lookahead)) is None:
                victim = self._pick_victim()
                victim_index = self.running.index(victim)
                self.running.pop(victim_index)
                if victim_index < i:  # already scheduled this step (priority policy): undo it
                    undone = next(s for s in scheduled if s.request is victim)
                    scheduled.remove(undone)
                    budget += undone.num_tokens
                    i -= 1
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            else:
                new_ids = [b.block_id for b in new_blocks]
                scheduled.append(ScheduledRequest(request, num_new, False, new_ids, spec))
                budget -= num_new
                i += 1
                continue
            # ``request`` itself was preempted; everything after it already was too.
            i = len(self.running)

        # 2) Waiting requests, when nothing had to be preempted this step. One whose grammar is
        # still compiling, or whose LoRA adapter finds no device slot, is stepped over and put
        # back in its place afterwards.
        stepped_over: list[Request] = []
        loras = {r.lora_id for r in self.running if r.lora_id} if self.lora is not None else set()
        while (
            not preempted
            and len(self.waiting)
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            request = self.waiting.peek()
            if request.status is RequestStatus.WAITING_FOR_GRAMMAR or (
                request.lora_id
                and self.lora is not None
                and not self.lora.can_admit(request.lora_id, loras)
            ):
                stepped_over.append(self.waiting.pop())
                continue
            computed_blocks: list = []
            num_computed = request.num_computed_tokens
            if num_computed == 0:
                computed_blocks, num_computed = self.kv.get_computed_blocks(request)
            num_new = request.num_tokens - num_computed
            if num_new > budget:
                if not self.config.enable_chunked_prefill:
                    break
                num_new = budget
            lookahead = self._lookahead(request, num_computed, num_new)
            if self.kv.allocate_slots(request, num_new, computed_blocks, lookahead) is None:
                break
            self.waiting.pop()
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_computed
            request.num_computed_tokens = num_computed
            request.status = RequestStatus.RUNNING
            if request.scheduled_ts is None:  # back after a preemption: its queue time is kept
                request.scheduled_ts = time.monotonic()
            self.running.append(request)
            if request.lora_id:
                loras.add(request.lora_id)
            block_ids = self.kv.get_block_ids(request.request_id)
            scheduled.append(ScheduledRequest(request, num_new, True, block_ids))
            budget -= num_new
        for request in reversed(stepped_over):
            self.waiting.add(request, front=True)
        self._lora_deferred = sum(r.status is RequestStatus.WAITING for r in stepped_over)

        out = SchedulerOutput(
            scheduled=scheduled,
            num_batched_tokens=self.config.max_num_batched_tokens - budget,
            preempted_ids=[r.request_id for r in preempted],
            finished_ids=self._finished_ids,
        )
        self._finished_ids = []
        return out

    def _spec_tokens(self, request: Request, num_new: int, budget: int) -> Sequence[int]:
        """The request's proposals this step may verify (taken: it has none after): only in a
        decode (one token to compute), as many as the token budget, the context length and
        max_tokens leave room for (the step emits at most one token more than it verifies)."""
        proposed, request.spec_token_ids = request.spec_token_ids, []
        if num_new != 1:
            return []
        room = min(
            budget - 1,
            self.max_model_len - request.num_tokens,
            request.max_tokens - len(request.output_token_ids) - 1,
        )
        return proposed[: max(room, 0)]

    def _lookahead(self, request: Request, num_computed: int, num_new: int) -> int:
        """Slots for the draft's proposals after a step that reaches the request's last token
        (none after a partial prefill chunk), never past max_model_len."""
        k = self.num_lookahead_tokens
        if not k or request.is_pooling or num_computed + num_new < request.num_tokens:
            return 0
        return max(min(k, self.max_model_len - num_computed - num_new), 0)

    def _pick_victim(self) -> Request:
        if self.config.policy == "priority":
            return max(self.running, key=Request.sort_key)
        return self.running[-1]

    def _preempt(self, request: Request) -> None:
        request.spec_token_ids = []
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self._num_preemptions += 1
        self.waiting.add(request, front=True)

    # ------------------------------------------------------------------ after the forward pass
    def update_from_output(
        self,
        output: SchedulerOutput,
        sampled: dict[str, int],
        spec_accepted: dict[str, list[int]] | None = None,
    ) -> list[Request]:
        """Advance computed counters, append sampled tokens, stop finished requests.

        ``sampled`` maps request id -> token for requests whose step reached the end of their
        known tokens (a partial prefill chunk samples nothing). ``spec_accepted``: for a row
        that verified proposals, those accepted (they come before its sampled token; the KV of
        the rejected ones is not counted as computed). Returns requests that got a token or
        finished this step, in schedule order: a pooling request once, when its last prompt
        chunk was computed (it finishes STOPPED; the runner pooled it in this step). A request
        that verified proposals has ``num_step_tokens``: how many tokens this step appended.
        """
        touched: list[Request] = []
        for s in output.scheduled:
            request = s.request
            if request.is_finished or request.status is RequestStatus.PREEMPTED:
                continue  # aborted between schedule and update, or preempted by a later one
            if s.spec_token_ids:
                accepted = (spec_accepted or {}).get(request.request_id, [])
                self._count_spec(len(s.spec_token_ids), len(accepted))
                # The rejected proposals' KV is not the context's: it is written over later.
                request.num_computed_tokens += s.num_tokens - len(s.spec_token_ids) + len(accepted)
                token = sampled.get(request.request_id)
                if token is not None and self._append(request, [*accepted, token]):
                    touched.append(request)
                continue
            request.num_computed_tokens += s.num_tokens
            if request.pooling_params is not None:
                if request.num_computed_tokens >= request.num_prompt_tokens:
                    self.running.remove(request)
                    self.finish(request, RequestStatus.FINISHED_STOPPED)
                    touched.append(request)
                continue
            token = sampled.get(request.request_id)
            if token is None:
                continue
            request.append_output_token(token)
            if request.grammar is not None and not request.grammar.accept(token):
                # Only a masking bug gets here: the sampler picked a token the grammar forbids.
                self.running.remove(request)
                self._fail(request, RuntimeError(f"sampled token {token} breaks the grammar"))
                continue
            status = self._check_stop(request, token)
            if status is not None:
                self.running.remove(request)
                self.finish(request, status)
            touched.append(request)
        return touched

    def _append(self, request: Request, tokens: list[int]) -> bool:
        """Append a verified run of tokens, stopping at the first that ends the request (the
        rest are dropped, as if never sampled). False when the request failed (no output)."""
        request.num_step_tokens = 0
        for token in tokens:
            request.append_output_token(token)
            request.num_step_tokens += 1
            if request.grammar is not None and not request.grammar.accept(token):
                self.running.remove(request)
                self._fail(request, RuntimeError(f"sampled token {token} breaks the grammar"))
                return False
            status = self._check_stop(request, token)
            if status is not None:
                self.running.remove(request)
                self.finish(request, status)
                break
        return True

    def _count_spec(self, proposed: int, accepted: int) -> None:
        self._spec_drafts += 1
        self._spec_draft_tokens += proposed
        self._spec_accepted += accepted
        per_pos = self._spec_per_pos
        if len(per_pos) < proposed:
            per_pos.extend([0] * (proposed - len(per_pos)))
        for j in range(accepted):
            per_pos[j] += 1

    def _check_stop(self, request: Request, token: int) -> RequestStatus | None:
        # Runs for every request every step: plain reads, each counter taken once.
        params = request.sampling_params
        num_output = len(request.output_token_ids)
        if num_output >= params.min_tokens:
            if not params.ignore_eos and token in request.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if params.stop_token_ids and token in params.stop_token_ids:
                request.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if request.grammar is not None and request.grammar.is_terminated:
            return RequestStatus.FINISHED_STOPPED  # the text is complete and its EOS accepted
        if num_output >= request.max_tokens or len(request.all_token_ids) >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def stats(self) -> SchedulerStats:
        """The figures now: the gauges, and the counters of the interval so far (since the last
        ``take_stats``). A pure read: calling it twice gives the same figures."""
        prefix = self.kv.stats
        stats = SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=self.kv.usage(),
            prefix_cache_queries=prefix.queries,
            prefix_cache_hits=prefix.hits,
            num_preemptions=self._num_preemptions,
            num_waiting_deferred=min(len(self.waiting), len(self._compiling) + self._lora_deferred),
            spec_num_drafts=self._spec_drafts,
            spec_num_draft_tokens=self._spec_draft_tokens,
            spec_num_accepted_tokens=self._spec_accepted,
            spec_accepted_per_pos=list(self._spec_per_pos),
        )
        if self.lora is not None:
            stats.running_lora_adapters = _per_adapter(self.running)
            stats.waiting_lora_adapters = dict(self.waiting.per_adapter)
        return stats

    def take_stats(self) -> SchedulerStats:
        """``stats()``, then the interval's counters (prefix-cache queries and hits,
        preemptions) start again from zero. ``EngineCore.step`` takes them once per step, so
        each step's outputs carry that step's counts and every count is reported once."""
        stats = self.stats()
        self.kv.stats.reset()
        self._num_preemptions = 0
        if self._spec_drafts:
            self._spec_drafts = self._spec_draft_tokens = self._spec_accepted = 0
            self._spec_per_pos = []
        return stats


def _per_adapter(requests: Iterable[Request]) -> dict[str, int]:
    """How many of ``requests`` run with each LoRA adapter (by name)."""
    counts: dict[str, int] = {}
    for r in requests:
        if r.lora_name is not None:
            counts[r.lora_name] = counts.get(r.lora_name, 0) + 1
    return counts
