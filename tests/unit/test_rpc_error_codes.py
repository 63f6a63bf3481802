"""Each refusal reaches the client with the code the contract documents for it."""

from __future__ import annotations

import grpc
import pytest

from engine_svc.core.errors import ContextLengthError, DuplicateRequestError
from engine_svc.loop.errors import Draining, QueueFull
from engine_svc.rpc import convert
from engine_svc.rpc.servicer import _status_code
from protos.convert import error_code_to_pb
from protos.tandem.engine.v1 import engine_pb2 as pb


@pytest.mark.parametrize(
    ("error", "stream_code", "generate_status"),
    [
        (ContextLengthError("too long"), pb.ERROR_CODE_CONTEXT_LENGTH_EXCEEDED, "OUT_OF_RANGE"),
        (DuplicateRequestError("dup"), pb.ERROR_CODE_DUPLICATE_REQUEST_ID, "ALREADY_EXISTS"),
        (ValueError("temperature"), pb.ERROR_CODE_INVALID_ARGUMENT, "INVALID_ARGUMENT"),
        (RuntimeError("boom"), pb.ERROR_CODE_INTERNAL, "INTERNAL"),
    ],
)
def test_error_codes(error: Exception, stream_code: int, generate_status: str) -> None:
    assert error_code_to_pb(convert.error_code(error)) == stream_code
    assert _status_code(error) is getattr(grpc.StatusCode, generate_status)


def test_queue_and_drain_statuses() -> None:
    assert _status_code(QueueFull("full")) is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert _status_code(Draining("bye")) is grpc.StatusCode.UNAVAILABLE
