"""What the engine core hands back after each step: per-request deltas plus load figures."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from engine_svc.core.request import Logprobs, PhaseTimes
from engine_svc.core.scheduler import SchedulerStats
from protos.types import FinishReason


@dataclass(slots=True)  # one per request per step: slots make it cheaper to build
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[Logprobs] = field(default_factory=list)
    prompt_logprobs: list[Logprobs | None] | None = None  # once, with the first token
    finish_reason: FinishReason | None = None
    stop_reason: int | None = None
    num_cached_tokens: int = 0
    num_prompt_tokens: int = 0
    # This output carries the request's first token (or a pooling request's result): where its
    # prompt is counted (vLLM's iteration tokens). Once per request, even when a preemption makes
    # the prompt compute again.
    first: bool = False
    # With the first token and with the last output: the phases so far (the contract's
    # queued_time_s / prefill_time_s / decode_time_s).
    phase_times: PhaseTimes | None = None
    # A pooling request's result, in its one (final) output: float32, one row of the step's
    # pooled batch (the embedding, one value per label, or the score).
    pooled: npt.NDArray[np.float32] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class EngineCoreOutputs:
    outputs: list[EngineCoreOutput]
    stats: SchedulerStats
    # Requests that failed in this step (a grammar that does not compile), with the error; they
    # are finished and have no output.
    errors: list[tuple[str, Exception]] = field(default_factory=list)
