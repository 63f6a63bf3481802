"""Bodies of POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's
``LoadLoRAAdapterRequest`` / ``UnloadLoRAAdapterRequest``).

What makes a good adapter name or directory is the engine's to judge (it answers naming the
field or the file); these check only that the fields are there, strings, and of sane length.
"""

from __future__ import annotations

from pydantic import Field

from frontend_svc.protocol.base import RequestModel, validate
from frontend_svc.protocol.fields import Bool

MAX_LORA_NAME_CHARS = 128  # the engine's limit too
MAX_LORA_PATH_CHARS = 4096  # PATH_MAX on Linux


class LoadLoraAdapterBody(RequestModel):
    """Load a PEFT adapter directory on every engine, under a name requests will use."""

    lora_name: str = Field(
        min_length=1,
        max_length=MAX_LORA_NAME_CHARS,
        description="The name requests give as `model`; /v1/models lists it.",
    )
    lora_path: str = Field(
        min_length=1,
        max_length=MAX_LORA_PATH_CHARS,
        description="The PEFT adapter directory (adapter_config.json and "
        "adapter_model.safetensors), on the engines' file system.",
    )
    pin: Bool = Field(
        default=False,
        description="Tandem: keep the adapter on the device (never moved out for another).",
    )
    load_inplace: Bool = Field(
        default=False,
        description="vLLM's: replace an adapter already loaded under this name (requests "
        "running with the old one finish with it).",
    )


class UnloadLoraAdapterBody(RequestModel):
    """Unload an adapter from every engine (requests running with it finish first)."""

    lora_name: str = Field(min_length=1, max_length=MAX_LORA_NAME_CHARS)


def parse_load_lora_adapter(body: object) -> LoadLoraAdapterBody:
    return validate(LoadLoraAdapterBody, body)


def parse_unload_lora_adapter(body: object) -> UnloadLoraAdapterBody:
    return validate(UnloadLoraAdapterBody, body)
