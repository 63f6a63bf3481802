"""A request as the engine core sees it: token ids in, token ids out, no torch."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine_svc.core.pooling_params import PoolingParams
from engine_svc.core.sampling_params import SamplingParams
from protos.types import FinishReason

if TYPE_CHECKING:
    from engine_svc.structured_output.grammar import RequestGrammar


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    WAITING_FOR_GRAMMAR = enum.auto()  # its structured-output grammar is still compiling
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()  # failed (its grammar does not compile): a RequestError, no output

    @property
    def finished(self) -> bool:
        # Asked for every request every step: ``_value_`` is a plain attribute, where ``value``
        # (a descriptor) and hashing a member (Enum.__hash__) run Python code.
        return self._value_ >= _FIRST_FINISHED


_FIRST_FINISHED = RequestStatus.FINISHED_STOPPED.value

# By status value (index 0 unused): the finish reason each status reports.
_FINISH_REASONS: tuple[FinishReason | None, ...] = tuple(
    {
        RequestStatus.FINISHED_STOPPED.value: FinishReason.STOP,
        RequestStatus.FINISHED_LENGTH.value: FinishReason.LENGTH,
        RequestStatus.FINISHED_ABORTED.value: FinishReason.ABORT,
    }.get(v)
    for v in range(max(s.value for s in RequestStatus) + 1)
)


@dataclass(frozen=True)
class PhaseTimes:
    """Seconds a request spent in each phase (vLLM's queue, prefill and decode times)."""

    queued_s: float  # taken by the engine -> first scheduled
    prefill_s: float  # first scheduled -> first token sampled
    decode_s: float  # first token -> finished (or now)


@dataclass
class Logprobs:
    """Logprob of one chosen token plus the top-N alternatives (token id -> logprob)."""

    token_id: int
    logprob: float
    rank: int
    top: dict[int, float]


class Request:
    """One sequence being generated.

    The scheduler only reasons about two counters: ``num_tokens`` (prompt + output so far) and
    ``num_computed_tokens`` (how many of them have KV in the cache). Prefill, chunked prefill and
    decode are all "catch ``num_computed_tokens`` up to ``num_tokens``".

    A pooling request (``pooling_params`` set, checked by ``ModelTasks.check``) is prefill only:
    it samples nothing and finishes once its whole prompt is computed; its ``sampling_params``
    are the defaults and unused.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: tuple[int, ...] = (),
        arrival_time: float | None = None,
        priority: int = 0,
        pooling_params: PoolingParams | None = None,
        lora_id: int = 0,
        lora_name: str | None = None,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError("prompt_token_ids must not be empty")
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = priority
        self.pooling_params = pooling_params
        # The LoRA adapter it runs with (the engine's id, held from add to finish; 0: the base
        # model). Part of its prefix-cache block hashes.
        self.lora_id = lora_id
        self.lora_name = lora_name if lora_id else None  # its name, for the load figures
        # The structured-output constraint's matcher, when sampling_params.structured_output is
        # set: it has accepted exactly output_token_ids (the scheduler advances it as tokens are
        # appended; a recompute after preemption replays tokens without touching it).
        self.grammar: RequestGrammar | None = None

        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prompt tokens found in the prefix cache; -1 until known
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | None = None
        # Engine-clock moments (time.monotonic) behind phase_times(): taken by the engine, first
        # scheduled (a preemption does not restart it), first token sampled.
        self.queued_ts = time.monotonic()
        self.scheduled_ts: float | None = None
        self.first_token_ts: float | None = None
        self.logprobs: list[Logprobs] = []
        self.prompt_logprobs: list[Logprobs | None] = []
        # Speculative decoding: tokens proposed for the next step (the scheduler takes them).
        self.spec_token_ids: list[int] = []
        self.num_step_tokens = 0  # output tokens the last verification step appended

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_pooling(self) -> bool:
        return self.pooling_params is not None

    @property
    def skips_prefix_cache(self) -> bool:
        """Whether every prompt position must be computed (no prefix-cache look-up): prompt
        logprobs need logits everywhere, MEAN and CLS pooling the hidden states."""
        if self.pooling_params is not None:
            return self.pooling_params.skips_prefix_cache
        return self.sampling_params.prompt_logprobs is not None

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS[self.status._value_]

    @property
    def max_tokens(self) -> int:
        mt = self.sampling_params.max_tokens
        assert mt is not None, "max_tokens is resolved when the request enters the engine"
        return mt

    def phase_times(self, now: float) -> PhaseTimes:
        """Time spent so far in each phase; a phase not reached yet counts 0, the current one
        runs until ``now``."""
        scheduled = now if self.scheduled_ts is None else self.scheduled_ts
        first_token = now if self.first_token_ts is None else self.first_token_ts
        return PhaseTimes(scheduled - self.queued_ts, first_token - scheduled, now - first_token)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def sort_key(self) -> tuple[int, float]:
        """Lower runs first: (priority, arrival time)."""
        return (self.priority, self.arrival_time)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )
