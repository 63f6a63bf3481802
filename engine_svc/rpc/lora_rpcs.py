"""The LoRA adapter rpcs (AddLora / RemoveLora / ListLoras / PinLora) of the ``Engine`` service.

The adapters belong to the engine loop thread (``EngineCore.add_lora`` ...): each rpc is handed
to it as a call (``EngineLoop.call``) that runs between two steps, in order with the requests
queued around it. AddLora reads and checks the adapter directory first, on a worker thread (no
engine state, no torch kernel: ``LoRAManager.read``), so a slow disk never stalls a step.

Status codes, as the contract gives them: INVALID_ARGUMENT (a bad directory, naming the file; a
bad name or path), ALREADY_EXISTS (a name in use), NOT_FOUND (an unknown name),
RESOURCE_EXHAUSTED (a pin that every slot or waiting requests rule out), FAILED_PRECONDITION
(AddLora on an engine started without --enable-lora), UNAVAILABLE (the engine loop stopped).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

import grpc

from engine_svc.core.model_info import ModelInfo
from engine_svc.engine_core import EngineCore
from engine_svc.loop.engine_loop import EngineLoop
from engine_svc.loop.errors import Unavailable
from engine_svc.lora.config import check_lora_name
from engine_svc.lora.errors import (
    LoRACapacityError,
    LoRADisabledError,
    LoRAError,
    LoRAExistsError,
    LoRANotFoundError,
)
from engine_svc.rpc import convert
from protos.convert import lora_to_pb
from protos.tandem.engine.v1 import engine_pb2 as pb

T = TypeVar("T")


def lora_status(e: Exception) -> grpc.StatusCode:
    """The gRPC status of a LoRA error (INVALID_ARGUMENT for any other ValueError)."""
    if isinstance(e, LoRANotFoundError):
        return grpc.StatusCode.NOT_FOUND
    if isinstance(e, LoRAExistsError):
        return grpc.StatusCode.ALREADY_EXISTS
    if isinstance(e, LoRACapacityError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(e, LoRADisabledError):
        return grpc.StatusCode.FAILED_PRECONDITION
    if isinstance(e, Unavailable):
        return grpc.StatusCode.UNAVAILABLE
    if isinstance(e, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT
    return grpc.StatusCode.INTERNAL


class LoRARpcs:
    """Mixed into ``EngineServicer``, which provides ``loop`` and ``info``."""

    loop: EngineLoop
    info: ModelInfo

    async def _on_loop(self, fn: Callable[[EngineCore], T], context: grpc.aio.ServicerContext) -> T:
        try:
            return await asyncio.wrap_future(self.loop.call(fn))
        except (LoRAError, ValueError, Unavailable) as e:
            await context.abort(lora_status(e), str(e))
            raise  # abort() raises; this only tells type checkers

    async def AddLora(  # noqa: N802 - gRPC method name
        self, request: pb.AddLoraRequest, context: grpc.aio.ServicerContext
    ) -> pb.AddLoraResponse:
        name, path = request.lora_name, request.lora_path
        try:
            check_lora_name(name)
            if not path:
                raise ValueError("lora_path must not be empty")
            if not self.info.max_loras:
                raise LoRADisabledError(
                    "this engine serves no LoRA adapters (start it with --enable-lora)"
                )
            adapter = await asyncio.to_thread(self.loop.core.read_lora, path)
        except (LoRAError, ValueError) as e:
            await context.abort(lora_status(e), str(e))
            raise
        info = await self._on_loop(lambda core: core.add_lora(name, adapter, request.pin), context)
        return pb.AddLoraResponse(lora=lora_to_pb(convert.lora_adapter(info)))

    async def RemoveLora(  # noqa: N802
        self, request: pb.RemoveLoraRequest, context: grpc.aio.ServicerContext
    ) -> pb.RemoveLoraResponse:
        await self._on_loop(lambda core: core.remove_lora(request.lora_name), context)
        return pb.RemoveLoraResponse()

    async def ListLoras(  # noqa: N802
        self, request: pb.ListLorasRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListLorasResponse:
        infos = await self._on_loop(lambda core: core.list_loras(), context)
        return pb.ListLorasResponse(loras=[lora_to_pb(convert.lora_adapter(i)) for i in infos])

    async def PinLora(  # noqa: N802
        self, request: pb.PinLoraRequest, context: grpc.aio.ServicerContext
    ) -> pb.PinLoraResponse:
        await self._on_loop(lambda core: core.pin_lora(request.lora_name), context)
        return pb.PinLoraResponse()
