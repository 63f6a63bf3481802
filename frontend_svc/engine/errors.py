"""How the gateway's engine client reports what went wrong: the engine unreachable, a request
refused or failed, a unary call refused (the codes are the contract's, ``protos.types``)."""

from __future__ import annotations

from protos.types import EngineErrorCode


class EngineUnavailableError(Exception):
    """The engine cannot be reached, or the connection broke while a request was in flight."""


class EngineRequestError(Exception):
    """The engine refused or failed one request."""

    def __init__(self, code: EngineErrorCode, message: str) -> None:
        super().__init__(f"{code.value}: {message}")
        self.code = code
        self.message = message


class EngineCallError(Exception):
    """An engine refused or failed one of its unary calls (``rpc``: the contract's name, e.g.
    ``AddLora``); ``address``: which engine (the pool names it when several answered)."""

    def __init__(self, rpc: str, address: str, code: EngineErrorCode, message: str) -> None:
        super().__init__(f"{rpc} on {address}: {code.value}: {message}")
        self.rpc = rpc
        self.address = address
        self.code = code
        self.message = message
