"""Why the engine refuses a request; both are ``ValueError`` so callers may catch them as such.

The gRPC layer maps each class to its contract code (``ErrorCode`` and the Generate status)."""

from __future__ import annotations


class ContextLengthError(ValueError):
    """The prompt (with room for one generated token) does not fit the context or the KV cache."""


class DuplicateRequestError(ValueError):
    """The request id is already used by an unfinished request of the same client."""


class EngineAsleepError(RuntimeError):
    """The engine sleeps (sleep mode): it takes no request until it is woken up."""


class EngineDeadError(RuntimeError):
    """The engine cannot go on: a part of it is gone (a tensor-parallel worker process died).
    Every request in flight fails with it, and the engine reports NOT_SERVING and exits."""
