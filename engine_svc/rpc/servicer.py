"""The gRPC ``Engine`` service (grpc.aio) over the ``EngineLoop``.

Stream:   one client per call; its requests' outputs come back once per engine step.
Generate: one request per call; cancelling the call aborts it.
Errors:   INVALID_ARGUMENT (parameter named), OUT_OF_RANGE (context length), RESOURCE_EXHAUSTED
          (waiting queue full), UNAVAILABLE (draining, stalled, asleep), as the proto's ErrorCode
          documents. In Stream they arrive per request, never ending the stream; a Stream ends
          with a status only on a malformed message (INVALID_ARGUMENT) or when the engine stops
          (UNAVAILABLE).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import grpc

from engine_svc.core.errors import ContextLengthError, DuplicateRequestError
from engine_svc.core.model_info import ModelInfo
from engine_svc.core.pooling_params import PoolingParams
from engine_svc.core.sampling_params import SamplingParams
from engine_svc.loop.clients import ClientBatch
from engine_svc.loop.engine_loop import EngineLoop
from engine_svc.loop.errors import QueueFull, Unavailable
from engine_svc.lora.errors import LoRAError
from engine_svc.rpc import convert
from engine_svc.rpc.handlers import Malformed
from engine_svc.rpc.lora_rpcs import LoRARpcs, lora_status
from engine_svc.rpc.open_calls import OpenCalls
from engine_svc.rpc.utility_rpcs import UtilityRpcs
from protos.convert import error_code_to_pb, load_to_pb, model_info_to_pb, request_from_pb
from protos.stream_outbox import StreamOutbox
from protos.tandem.engine.v1 import engine_pb2 as pb
from protos.tandem.engine.v1 import engine_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
)
_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")
_CHUNK = 1 << 20
_POOLING_SAMPLING = SamplingParams(max_tokens=1)  # what a pooling request carries (unused)
_client_ids = itertools.count()


@dataclass(frozen=True)
class _Close:
    """Ends a Stream with a status: a malformed message, or the engine stopping."""

    code: grpc.StatusCode
    details: str


class InFlight:
    """A multiset of request ids: a finished id may be added again at once (ids are reusable),
    and ids that ended are forgotten (a gateway's Stream lives for days)."""

    def __init__(self) -> None:
        self._count: dict[str, int] = {}

    def add(self, request_id: str) -> None:
        self._count[request_id] = self._count.get(request_id, 0) + 1

    def end(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            left = self._count.get(rid, 0) - 1
            if left > 0:
                self._count[rid] = left
            else:
                self._count.pop(rid, None)

    def __len__(self) -> int:
        return len(self._count)


class _Wake:
    """The client reported progress: its window may have room again."""


_WAKE = _Wake()

# What a Stream's inbox carries: an engine step's batch for this client (or a refused request's
# error, built here), a _Close, _WAKE, or None when the client half-closed.
_StreamItem = ClientBatch | _Close | _Wake | None


class EngineServicer(LoRARpcs, UtilityRpcs, pb_grpc.EngineServicer):
    def __init__(
        self,
        loop: EngineLoop,
        info: ModelInfo,
        model_dir: str,
        version: str,
        tokenizer_dir: str | None = None,
        chat_template: str | None = None,
    ) -> None:
        """``tokenizer_dir`` (default: ``model_dir``) holds the tokenizer files GetTokenizer
        serves; ``chat_template``, when given, is served in place of that directory's."""
        self.loop = loop
        self.info = info
        self.model_dir = Path(model_dir)
        self.tokenizer_dir = Path(tokenizer_dir) if tokenizer_dir else self.model_dir
        self.chat_template = chat_template
        self.version = version
        # Inboxes of the open Stream and Generate calls, to end them at shutdown.
        self._open_calls: OpenCalls[asyncio.Queue[Any]] = OpenCalls()

    # ------------------------------------------------------------------ validation
    def _validate(
        self, add: pb.AddRequest
    ) -> tuple[str, list[int], SamplingParams, PoolingParams | None]:
        """Raise ValueError naming the bad field; returns (id, prompt, SamplingParams, the
        checked PoolingParams of a pooling request or None). A pooling request's
        sampling_params are ignored (the contract)."""
        request = request_from_pb(add)
        if not request.request_id:
            raise ValueError("request_id must not be empty")
        prompt = list(request.prompt_token_ids)
        if request.pooling_params is not None:
            pooling = convert.pooling_params(request.pooling_params)
            return (
                request.request_id,
                prompt,
                _POOLING_SAMPLING,
                self.info.check_pooling(prompt, pooling),
            )
        params = convert.sampling_params(request.sampling_params, self.info.max_logprobs)
        self.info.check_request(prompt, params.max_tokens)
        self.info.check_params(params)
        return request.request_id, prompt, params, None

    def _submit(self, client: str, add: pb.AddRequest) -> None:
        rid, prompt, params, pooling = self._validate(add)
        self.loop.submit(
            client,
            rid,
            prompt,
            params,
            arrival_time=add.arrival_time or None,
            priority=add.priority,
            pooling_params=pooling,
            lora_name=add.lora_name or None,
        )

    # ------------------------------------------------------------------ Stream
    async def Stream(  # noqa: N802 - gRPC method name
        self,
        request_iterator: AsyncIterator[pb.EngineCoreRequest | Malformed],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[pb.EngineCoreOutputs]:
        client = f"s{next(_client_ids)}"
        aio_loop = asyncio.get_running_loop()
        inbox: asyncio.Queue[_StreamItem] = asyncio.Queue()

        def sink(batch: ClientBatch) -> None:
            # Runs on the engine loop thread: only a hand-off. The message is built on this
            # call's event loop, so the engine loop goes on to its next step at once.
            aio_loop.call_soon_threadsafe(inbox.put_nowait, batch)

        self.loop.register(client, sink)
        self._open_calls.add(inbox)
        # Requests this stream added that have not ended yet, counted on this event loop from
        # the messages themselves. (Asking the engine loop instead raced: it forgets a request
        # before its final output reaches this queue, so a half-closed stream could end first
        # and lose that output.)
        in_flight = InFlight()
        # Steps not sent yet, merged, and the client's window (see stream_outbox).
        outbox = StreamOutbox()

        async def read() -> None:
            try:
                async for msg in request_iterator:
                    if isinstance(msg, Malformed):
                        inbox.put_nowait(_Close(grpc.StatusCode.INVALID_ARGUMENT, msg.describe()))
                        return
                    kind = msg.WhichOneof("kind")
                    if kind == "add":
                        try:
                            self._submit(client, msg.add)
                        except (ValueError, QueueFull, Unavailable) as e:
                            refused: list[tuple[str, Exception]] = [(msg.add.request_id, e)]
                            inbox.put_nowait(ClientBatch(errors=refused, load=self.loop.load))
                        # Counted when refused too: its error ends it, like any other's.
                        in_flight.add(msg.add.request_id)
                    elif kind == "abort":
                        self.loop.abort(client, list(msg.abort.request_ids))
                    elif kind == "flow":
                        outbox.flow(msg.flow.window, msg.flow.messages_read)
                        inbox.put_nowait(_WAKE)
            finally:
                inbox.put_nowait(None)

        reader = asyncio.create_task(read())
        half_closed = False
        stopping: _Close | None = None  # the engine stops: send what is held, then this
        try:
            while True:
                # Everything queued is taken (and merged) before a message is sent.
                if inbox.empty() or stopping is not None:
                    if stopping is not None:  # what came after the close goes out too
                        _take_batches(inbox, outbox)
                    if outbox.ready():
                        message = outbox.take()
                        # The ids that end here travel with the message, so this handler
                        # counts them itself (see ``in_flight`` above).
                        in_flight.end([o.request_id for o in message.outputs if o.finish_reason])
                        in_flight.end([e.request_id for e in message.errors])
                        yield message
                        continue
                    if stopping is not None:
                        await context.abort(stopping.code, stopping.details)
                        return  # abort() raises; this only tells type checkers
                    # A client that half-closed gets everything it has in flight, then the end.
                    if half_closed and not in_flight and outbox.empty:
                        break
                item = await inbox.get()
                if isinstance(item, ClientBatch):
                    outbox.add(*_batch_to_pb(item))
                elif item is None:
                    half_closed = True
                    outbox.drop_window()  # no progress can come
                elif isinstance(item, _Close):
                    if item.code is grpc.StatusCode.INVALID_ARGUMENT:
                        logger.warning("stream %s: %s; closing it", client, item.details)
                        await context.abort(item.code, item.details)
                        return  # abort() raises; this only tells type checkers
                    # The engine stops: what is queued and held for the client goes out first,
                    # as gRPC takes it (no progress is waited for), then the stream ends.
                    outbox.drop_window()
                    stopping = item
        finally:
            self._open_calls.discard(inbox)
            reader.cancel()
            self.loop.unregister(client)  # aborts everything this stream still carried

    def close_calls(self, details: str) -> None:
        """End every open Stream and Generate call with UNAVAILABLE (the engine is stopping), so
        none is left for the server to cancel mid-call (even if a stalled loop never answers
        them)."""
        for inbox in self._open_calls:
            inbox.put_nowait(_Close(grpc.StatusCode.UNAVAILABLE, details))

    async def calls_ended(self, timeout_s: float) -> bool:
        """Wait until every Stream and Generate call has returned (after ``close_calls``)."""
        return await self._open_calls.ended(timeout_s)

    # ------------------------------------------------------------------ Generate
    async def Generate(  # noqa: N802
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        client = f"g{next(_client_ids)}"
        aio_loop = asyncio.get_running_loop()
        inbox: asyncio.Queue[ClientBatch | _Close] = asyncio.Queue()

        def sink(batch: ClientBatch) -> None:
            aio_loop.call_soon_threadsafe(inbox.put_nowait, batch)

        add = request.request
        if not add.request_id:  # the contract lets Generate callers leave it to the engine
            add = pb.AddRequest()
            add.CopyFrom(request.request)
            add.request_id = f"gen-{uuid.uuid4().hex}"
        self.loop.register(client, sink)
        self._open_calls.add(inbox)
        try:
            try:
                self._submit(client, add)
            except (ValueError, QueueFull, Unavailable) as e:
                await context.abort(_status_code(e), str(e))
            while True:
                batch = await inbox.get()
                if isinstance(batch, _Close):
                    await context.abort(batch.code, batch.details)
                    return  # abort() raises; this only tells type checkers
                for _, err in batch.errors:
                    await context.abort(_status_code(err), str(err))
                load = load_to_pb(batch.load) if batch.load else None
                for o in batch.outputs:
                    yield pb.GenerateResponse(output=convert.output_to_pb(o), load=load)
                    if o.finished:
                        return
        finally:
            self._open_calls.discard(inbox)
            self.loop.unregister(client)  # cancelled or failed: abort the request

    # ------------------------------------------------------------------ unary
    async def Abort(  # noqa: N802
        self, request: pb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> pb.AbortResponse:
        return pb.AbortResponse(num_aborted=self.loop.abort(None, list(request.request_ids)))

    async def GetModelInfo(  # noqa: N802
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetModelInfoResponse:
        return model_info_to_pb(
            replace(
                self.info,
                model_source=str(self.model_dir),
                engine_version=self.version,
                model_type=_model_type(self.model_dir),
            )
        )

    async def GetTokenizer(  # noqa: N802
        self, request: pb.GetTokenizerRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GetTokenizerResponse]:
        names = [n for n in TOKENIZER_FILES if self._tokenizer_file(n).is_file()]
        if not names:
            await context.abort(
                grpc.StatusCode.NOT_FOUND, "the served model has no tokenizer files"
            )
        chat_template = self.chat_template
        if chat_template is None:
            chat_template = _chat_template(self.tokenizer_dir)
        else:  # --chat-template: it replaces the template files too, for clients that read them
            names = [n for n in names if n not in _TEMPLATE_FILES] + ["chat_template.jinja"]
        first = True
        for name in names:
            if name == "chat_template.jinja" and self.chat_template is not None:
                data = self.chat_template.encode("utf-8")
            else:
                data = self._tokenizer_file(name).read_bytes()
            for start in range(0, max(len(data), 1), _CHUNK):
                msg = pb.GetTokenizerResponse(file_name=name, data=data[start : start + _CHUNK])
                if first:
                    msg.chat_template = chat_template
                    first = False
                yield msg

    def _tokenizer_file(self, name: str) -> Path:
        """Where GetTokenizer reads ``name``: the tokenizer directory, except the model's own
        generation_config.json."""
        home = self.model_dir if name == "generation_config.json" else self.tokenizer_dir
        return home / name


def _status_code(e: Exception) -> grpc.StatusCode:
    """The Generate status for a refused or failed request (the proto's ErrorCode table)."""
    if isinstance(e, ContextLengthError):
        return grpc.StatusCode.OUT_OF_RANGE
    if isinstance(e, DuplicateRequestError):
        return grpc.StatusCode.ALREADY_EXISTS
    if isinstance(e, LoRAError):
        return lora_status(e)  # an unknown adapter: NOT_FOUND
    if isinstance(e, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(e, QueueFull):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(e, Unavailable):
        return grpc.StatusCode.UNAVAILABLE
    return grpc.StatusCode.INTERNAL


def _model_type(model_dir: Path) -> str:
    """The checkpoint's config.json ``model_type`` (its text config's for a multimodal one, as
    vLLM's ``hf_text_config``); "" when there is none."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return ""
    if not isinstance(config, dict):
        return ""
    text = config.get("text_config")
    found = text.get("model_type") if isinstance(text, dict) else None
    found = found or config.get("model_type")
    return found if isinstance(found, str) else ""


def _chat_template(model_dir: Path) -> str:
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    cfg = model_dir / "tokenizer_config.json"
    if cfg.is_file():
        template = json.loads(cfg.read_text()).get("chat_template") or ""
        return template if isinstance(template, str) else ""
    return ""


def _take_batches(inbox: asyncio.Queue[_StreamItem], outbox: StreamOutbox) -> None:
    """Move the engine's batches queued for a stopping stream into its outbox (the rest of the
    queue, progress wake-ups and the reader's end, no longer matters)."""
    while not inbox.empty():
        if isinstance(queued := inbox.get_nowait(), ClientBatch):
            outbox.add(*_batch_to_pb(queued))


def _batch_to_pb(batch: ClientBatch) -> tuple[pb.EngineCoreOutputs, int]:
    """A step's batch for this client as the contract's message (stamped when sent), and the
    tokens the step carried for it: the prompts it completed (vLLM's iteration tokens count a
    prompt with its first token or pooled result) plus the tokens it generated."""
    msg = pb.EngineCoreOutputs()
    outputs = msg.outputs
    for o in batch.outputs:
        convert.add_output(outputs, o)
    for rid, e in batch.errors:
        msg.errors.add(request_id=rid, code=error_code_to_pb(convert.error_code(e)), message=str(e))
    if batch.load is not None:
        msg.load.CopyFrom(load_to_pb(batch.load))
    tokens = sum(
        len(o.new_token_ids) + (o.num_prompt_tokens if o.first else 0) for o in batch.outputs
    )
    return msg, tokens
