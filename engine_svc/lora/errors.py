"""Why a LoRA operation was refused. Every class is a ``ValueError`` so request validation paths
that catch ``ValueError`` keep working; the gRPC layer maps each to its own status code."""

from __future__ import annotations


class LoRAError(ValueError):
    """Base class of the LoRA errors."""


class LoRAInvalidError(LoRAError):
    """An adapter directory cannot be served: a missing or malformed file, an unsupported
    option, a rank above --max-lora-rank, a module the model does not have. The message names
    the file (and the key or tensor) at fault. gRPC: INVALID_ARGUMENT."""


class LoRANotFoundError(LoRAError):
    """No loaded adapter has this name (never added, or removed). gRPC: NOT_FOUND."""


class LoRAPathNotFoundError(LoRANotFoundError):
    """An adapter path that does not exist on the engine's file system. gRPC: NOT_FOUND (vLLM
    answers a load of a missing path 404)."""


class LoRAExistsError(LoRAError):
    """An adapter with this name is already loaded. gRPC: ALREADY_EXISTS."""


class LoRACapacityError(LoRAError):
    """Pinning would leave no device slot for adapters that requests are waiting for, or a
    request names an unpinned adapter while every device slot is pinned. gRPC:
    RESOURCE_EXHAUSTED."""


class LoRADisabledError(LoRAError):
    """An adapter rpc reached an engine started without --enable-lora. gRPC:
    FAILED_PRECONDITION. (A request naming an adapter there is simply NOT_FOUND.)"""
