"""What the engine core hands back after each step: per-request deltas plus load figures."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine_svc.core.request import FinishReason, Logprobs
from engine_svc.core.scheduler import SchedulerStats


@dataclass
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[Logprobs] = field(default_factory=list)
    prompt_logprobs: list[Logprobs | None] | None = None  # once, with the first token
    finish_reason: FinishReason | None = None
    stop_reason: int | None = None
    num_cached_tokens: int = 0
    num_prompt_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class EngineCoreOutputs:
    outputs: list[EngineCoreOutput]
    stats: SchedulerStats
