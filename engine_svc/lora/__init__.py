"""Multi-LoRA serving: PEFT adapters read from disk (``adapter``), a torch-free registry of
device slots and host copies (``registry``), the stacked device weights (``weights``), the
batched op that applies a whole step's adapters at once (``ops``), and the manager that joins
them on the engine loop thread (``manager``)."""

from engine_svc.lora.config import LoRAConfig
from engine_svc.lora.request import LoRARequest

__all__ = ["LoRAConfig", "LoRARequest"]
