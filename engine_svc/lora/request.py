"""``LoRARequest``: the offline API's way to name an adapter, in vLLM's shape."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """An adapter for ``LLM.generate(..., lora_request=...)``: loaded from ``lora_path`` the
    first time its name is used. ``lora_int_id`` must be positive and name one adapter only
    (vLLM's rule); the engine keys its own state by its internal ids."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be positive, got {self.lora_int_id}")
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")
