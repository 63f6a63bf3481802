"""A small synchronous client for the engine's gRPC contract, used by the tests."""

from __future__ import annotations

import queue
from collections.abc import Iterator

import grpc

from protos.tandem.engine.v1 import engine_pb2 as pb
from protos.tandem.engine.v1 import engine_pb2_grpc as pb_grpc


def add_request(
    request_id: str,
    prompt: list[int],
    max_tokens: int,
    *,
    temperature: float = 0.0,
    ignore_eos: bool = True,
    **params: object,
) -> pb.AddRequest:
    sp = pb.SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        ignore_eos=ignore_eos,
        **params,  # type: ignore[arg-type]
    )
    return pb.AddRequest(request_id=request_id, prompt_token_ids=prompt, sampling_params=sp)


def generate(
    stub: pb_grpc.EngineStub, request: pb.AddRequest, timeout: float = 30.0
) -> list[pb.GenerateResponse]:
    return list(stub.Generate(pb.GenerateRequest(request=request), timeout=timeout))


class StreamSession:
    """One ``Stream`` call: ``send`` messages from the test, iterate the engine's replies."""

    def __init__(self, stub: pb_grpc.EngineStub, timeout: float = 30.0) -> None:
        self._outbox: queue.Queue[pb.EngineCoreRequest | None] = queue.Queue()
        self.call = stub.Stream(self._requests(), timeout=timeout)

    def _requests(self) -> Iterator[pb.EngineCoreRequest]:
        while (item := self._outbox.get()) is not None:
            yield item

    def add(self, request: pb.AddRequest) -> None:
        self._outbox.put(pb.EngineCoreRequest(add=request))

    def abort(self, *request_ids: str) -> None:
        self._outbox.put(pb.EngineCoreRequest(abort=pb.AbortRequest(request_ids=request_ids)))

    def flow(self, window: int = 0, messages_read: int = 0) -> None:
        flow = pb.FlowControl(window=window, messages_read=messages_read)
        self._outbox.put(pb.EngineCoreRequest(flow=flow))

    def half_close(self) -> None:
        self._outbox.put(None)

    def __iter__(self) -> Iterator[pb.EngineCoreOutputs]:
        return iter(self.call)

    def cancel(self) -> None:
        self._outbox.put(None)
        self.call.cancel()


def tokens_of(responses: list[pb.GenerateResponse]) -> list[int]:
    return [t for r in responses for t in r.output.new_token_ids]


def is_code(error: grpc.RpcError, code: grpc.StatusCode) -> bool:
    return error.code() == code  # type: ignore[no-any-return, attr-defined]
