"""Tandem's engine service: the vLLM-v1-style engine core and its offline ``LLM`` API."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine_svc.core.pooling_params import PoolingParams
from engine_svc.core.request import RequestStatus
from engine_svc.core.sampling_params import SamplingParams
from engine_svc.lora.request import LoRARequest
from protos.types import FinishReason, PoolingTask

if TYPE_CHECKING:
    from engine_svc.entrypoints.llm import LLM, CompletionOutput, RequestOutput

__all__ = [
    "LLM",
    "CompletionOutput",
    "FinishReason",
    "LoRARequest",
    "PoolingParams",
    "PoolingTask",
    "RequestOutput",
    "RequestStatus",
    "SamplingParams",
]


def __getattr__(name: str) -> Any:
    # LLM pulls in torch; keep `import engine_svc` light for code that only needs the core types.
    if name in ("LLM", "CompletionOutput", "RequestOutput"):
        from engine_svc.entrypoints import llm

        return getattr(llm, name)
    raise AttributeError(name)
