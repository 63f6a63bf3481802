"""Registers the ``Engine`` service with deserializers that never raise.

The generated ``add_EngineServicer_to_server`` parses requests with ``Message.FromString``: on
bytes that are not the message, grpc.aio answers a unary call with UNKNOWN and logs a traceback,
and a ``Stream`` just sees its request iterator end (the call ends OK, nothing logged). Here a
request that does not parse becomes a :class:`Malformed` value instead: unary calls are answered
INVALID_ARGUMENT before the servicer runs, and ``Stream`` ends the call with INVALID_ARGUMENT
itself. The method table is read from the service descriptor, so it follows the ``.proto``; a
method the servicer does not implement answers UNIMPLEMENTED (no traceback logged).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf import message as pb_message
from google.protobuf import message_factory
from google.protobuf.descriptor import MethodDescriptor, ServiceDescriptor

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Malformed:
    """A request message that failed to parse."""

    type_name: str
    error: str

    def describe(self) -> str:
        return f"malformed {self.type_name} message: {self.error}"


def _lenient(cls: type[pb_message.Message]) -> Callable[[bytes], pb_message.Message | Malformed]:
    name = cls.DESCRIPTOR.full_name

    def parse(data: bytes) -> pb_message.Message | Malformed:
        try:
            return cls.FromString(data)
        except pb_message.DecodeError as e:
            return Malformed(name, str(e) or "cannot parse")

    return parse


def _reject_malformed_unary(behaviour: Callable[..., Any], method: str) -> Callable[..., Any]:
    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, Malformed):
            logger.warning("%s: %s", method, request.describe())
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.describe())
        return await behaviour(request, context)

    return unary


def _reject_malformed_stream(behaviour: Callable[..., Any], method: str) -> Callable[..., Any]:
    async def streaming(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        if isinstance(request, Malformed):
            logger.warning("%s: %s", method, request.describe())
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.describe())
        async for response in behaviour(request, context):
            yield response

    return streaming


def _unimplemented(path: str, streaming: bool) -> Callable[..., Any]:
    """UNIMPLEMENTED for a method the servicer leaves to the generated base class, which would
    raise NotImplementedError (grpc.aio then logs a traceback)."""
    details = f"{path} is not implemented by this engine"

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, details)

    async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, details)
        yield  # pragma: no cover - abort() raises; this makes it an async generator

    return stream if streaming else unary


def _handler(servicer: object, method: MethodDescriptor) -> grpc.RpcMethodHandler:
    request_cls = message_factory.GetMessageClass(method.input_type)
    response_cls = message_factory.GetMessageClass(method.output_type)
    path = f"/{method.containing_service.full_name}/{method.name}"
    behaviour = getattr(servicer, method.name)
    if getattr(behaviour, "__module__", "").endswith("_pb2_grpc"):  # the generated placeholder
        behaviour = _unimplemented(path, method.server_streaming)
    kwargs: dict[str, Any] = {
        "request_deserializer": _lenient(request_cls),
        "response_serializer": response_cls.SerializeToString,
    }
    if method.client_streaming:  # the servicer sees Malformed items in its request iterator
        if method.server_streaming:
            return grpc.stream_stream_rpc_method_handler(behaviour, **kwargs)
        return grpc.stream_unary_rpc_method_handler(behaviour, **kwargs)
    if method.server_streaming:
        return grpc.unary_stream_rpc_method_handler(
            _reject_malformed_stream(behaviour, path), **kwargs
        )
    return grpc.unary_unary_rpc_method_handler(_reject_malformed_unary(behaviour, path), **kwargs)


def add_service(servicer: object, service: ServiceDescriptor, server: grpc.aio.Server) -> None:
    """Register every method of ``service`` on ``server``, implemented by ``servicer``'s
    same-named coroutine methods."""
    handlers = {m.name: _handler(servicer, m) for m in service.methods}
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service.full_name, handlers),)
    )
    server.add_registered_method_handlers(service.full_name, handlers)
