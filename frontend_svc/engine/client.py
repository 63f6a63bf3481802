"""The gateway's side of the engine contract: the stream and the unary calls. The only module of
the gateway that imports the generated stubs; :mod:`protos.convert` turns the messages into the
contract's types (:mod:`protos.types`) and back.

One :class:`EngineClient` per engine keeps one long-lived bidirectional ``Stream`` open. Each
request gets its own :class:`~frontend_svc.engine.collector.OutputCollector`; the engine's
per-step ``EngineCoreOutputs`` are split by request id into those collectors (a consumer that
falls behind takes several steps' outputs merged into one). The stream has a window
(``FlowControl``): at most ``window`` engine messages in flight unread, progress reported each
time a window's worth has been read; an engine that outpaces this reader merges its steps instead
of queueing them. A consumer that goes away (its generator is closed) makes the client send an
abort. A pooling request (``pooling_params``) is answered by one final output whose ``pooled``
holds its vector. :meth:`EngineClient.generate` is the one way to run a request, for the pool
(which picks the engine and retries elsewhere) and for tests alike. When the stream breaks,
every in-flight request gets an :class:`EngineUnavailableError` at once and the client
reconnects with exponential backoff, fetching model info and the tokenizer again before it
reports itself connected (:meth:`EngineEvents.connected
<frontend_svc.engine.events.EngineEvents.connected>`, which may refuse it). The attempts
keep that pace however long the engine is away; their log lines do not
(:mod:`frontend_svc.engine.reconnect_log`).

Beside the stream, the client watches the engine's ``grpc.health.v1`` status: an engine that
drains or stalls says NOT_SERVING at once, and :attr:`EngineClient.serving` follows it, so the
pool stops sending it new requests while it cannot generate.

The engine's unary calls (LoRA adapters: ``add_lora`` ...; utilities: ``sleep`` ...) go over the
same channel while it is open; a refusal is an :class:`EngineCallError` carrying the gRPC status
as an :class:`EngineErrorCode` (UNIMPLEMENTED: an engine that predates the rpc).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc

from frontend_svc.config import BackoffConfig
from frontend_svc.engine.collector import OutputCollector
from frontend_svc.engine.errors import EngineCallError, EngineRequestError, EngineUnavailableError
from frontend_svc.engine.events import EngineEvents
from frontend_svc.engine.health import HealthFollower
from frontend_svc.engine.reconnect_log import ReconnectLog
from protos import convert
from protos.tandem.engine.v1 import engine_pb2 as pb
from protos.tandem.engine.v1 import engine_pb2_grpc as pb_grpc
from protos.types import (
    EngineErrorCode,
    EngineOutput,
    EngineRequest,
    FinishReason,
    LoraAdapter,
    ModelInfo,
    TokenizerFiles,
)

logger = logging.getLogger(__name__)
T = TypeVar("T")

# The gRPC status of a refused unary call, as the domain's code (anything else: INTERNAL).
_CALL_STATUSES = {
    grpc.StatusCode.INVALID_ARGUMENT: EngineErrorCode.INVALID_ARGUMENT,
    grpc.StatusCode.OUT_OF_RANGE: EngineErrorCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND: EngineErrorCode.NOT_FOUND,
    grpc.StatusCode.ALREADY_EXISTS: EngineErrorCode.ALREADY_EXISTS,
    grpc.StatusCode.FAILED_PRECONDITION: EngineErrorCode.FAILED_PRECONDITION,
    grpc.StatusCode.UNIMPLEMENTED: EngineErrorCode.UNIMPLEMENTED,
    grpc.StatusCode.RESOURCE_EXHAUSTED: EngineErrorCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNAVAILABLE: EngineErrorCode.UNAVAILABLE,
    grpc.StatusCode.CANCELLED: EngineErrorCode.UNAVAILABLE,  # the channel closed under it
    grpc.StatusCode.DEADLINE_EXCEEDED: EngineErrorCode.UNAVAILABLE,
}
_MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # tokenizer chunks and long prompts
ENGINE_SERVICE = pb.DESCRIPTOR.services_by_name["Engine"].full_name


class EngineClient:
    """Multiplexes many requests over one gRPC stream to one engine, reconnecting as needed."""

    def __init__(
        self,
        address: str,
        backoff: BackoffConfig | None = None,
        rpc_timeout_s: float = 10.0,
        events: EngineEvents | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        server_name: str | None = None,
        window: int = 1,
    ) -> None:
        """``events``: told of this engine's connection, load figures and token counts."""
        self.address = address
        self._window = window  # engine messages in flight unread; 0: no window
        self._credentials = credentials
        self._server_name = server_name
        self._backoff = backoff or BackoffConfig()
        self._rpc_timeout_s = rpc_timeout_s
        self._events = events or EngineEvents()
        self._collectors: dict[str, OutputCollector] = {}
        self._outbox: asyncio.Queue[pb.EngineCoreRequest | None] | None = None
        self._epoch = 0  # bumped on every (re)connection; requests remember theirs
        self._connected = asyncio.Event()
        # The engine's own verdict (grpc.health.v1 Watch): False while it drains or is stalled.
        self._health: HealthFollower | None = None
        self._task: asyncio.Task[None] | None = None
        self._stub: pb_grpc.EngineStub | None = None  # while a channel is open (unary calls)
        self._closing = False
        self.model_info: ModelInfo | None = None
        self.last_error: str | None = None
        self._log = ReconnectLog(address, logger)  # failed attempts, logged sparingly

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        """Start connecting in the background; returns at once."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="engine-client")

    async def close(self) -> None:
        """Half-close the stream (the engine aborts what it carried) and stop reconnecting."""
        self._closing = True
        if self._outbox is not None:
            self._outbox.put_nowait(None)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    @property
    def serving(self) -> bool:
        """Connected, and the engine says it can generate (health SERVING)."""
        return self._connected.is_set() and self._health is not None and self._health.serving

    async def wait_connected(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for a connection; return whether there is one."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._connected.wait(), timeout)
        return self.connected

    @property
    def num_in_flight(self) -> int:
        return len(self._collectors)

    # -- requests ---------------------------------------------------------------------------

    async def generate(self, request: EngineRequest) -> AsyncGenerator[EngineOutput, None]:
        """Send ``request`` and yield its outputs until the one with a finish reason (a consumer
        slower than the engine gets several steps' outputs merged into one).

        Raises :class:`EngineRequestError` when the engine refuses or fails the request and
        :class:`EngineUnavailableError` when there is no engine, the stream breaks, or the
        engine aborts the request before its first output (it was draining: another engine
        may take it). Closing the generator early aborts the request on the engine. Use it
        under ``contextlib.aclosing``.
        """
        outbox = self._outbox
        if outbox is None or not self.connected:
            raise EngineUnavailableError(self._unavailable_reason())
        rid = request.request_id
        collectors = self._collectors
        if rid in collectors:
            raise ValueError(f"request id {rid!r} is already in flight")
        collector = collectors[rid] = OutputCollector()
        epoch = self._epoch
        outbox.put_nowait(pb.EngineCoreRequest(add=convert.request_to_pb(request)))
        produced = False
        try:
            # take() and wait() rather than ``await collector.get()``: a coroutine fewer to run
            # for every token.
            while True:
                out = collector.take()
                if out is None:
                    await collector.wait()
                    continue
                if not produced and out.finish_reason is FinishReason.ABORT:
                    raise EngineUnavailableError(f"engine {self.address} aborted the request")
                produced = True
                yield out
                if out.finished:
                    return
        finally:
            # Aborts the request unless its last output or its error was taken
            # (``collector.ended``): a consumer that stops after the last output leaves nothing.
            if collectors.get(rid) is collector:
                del collectors[rid]
            if not collector.ended and epoch == self._epoch and self._outbox is not None:
                abort = pb.AbortRequest(request_ids=[rid])
                self._outbox.put_nowait(pb.EngineCoreRequest(abort=abort))

    # -- adapter and utility calls (unary rpcs) ---------------------------------------------
    #
    # Loading an adapter reads it from disk; sleeping waits for the running requests; waking up
    # may reload the weights: those calls get no deadline (a dead engine still fails them, by
    # the channel's keepalive). Queries get the usual rpc timeout.

    async def add_lora(self, name: str, path: str, pin: bool = False) -> LoraAdapter:
        """Load a PEFT adapter directory under ``name`` (``pin``: keep it on the device)."""
        request = pb.AddLoraRequest(lora_name=name, lora_path=path, pin=pin)
        reply = await self._call("AddLora", lambda stub: stub.AddLora(request))
        return convert.lora_from_pb(reply.lora)

    async def remove_lora(self, name: str) -> None:
        request = pb.RemoveLoraRequest(lora_name=name)
        await self._call("RemoveLora", lambda stub: stub.RemoveLora(request))

    async def list_loras(self) -> tuple[LoraAdapter, ...]:
        """The loaded adapters, in load order."""
        timeout = self._rpc_timeout_s
        reply = await self._call(
            "ListLoras", lambda stub: stub.ListLoras(pb.ListLorasRequest(), timeout=timeout)
        )
        return tuple(convert.lora_from_pb(lo) for lo in reply.loras)

    async def pin_lora(self, name: str) -> None:
        request = pb.PinLoraRequest(lora_name=name)
        await self._call("PinLora", lambda stub: stub.PinLora(request, timeout=self._rpc_timeout_s))

    async def reset_prefix_cache(self) -> bool:
        """Drop the prefix cache; False when blocks in use kept their entries."""
        request = pb.ResetPrefixCacheRequest()
        timeout = self._rpc_timeout_s
        reply = await self._call(
            "ResetPrefixCache", lambda stub: stub.ResetPrefixCache(request, timeout=timeout)
        )
        return bool(reply.reset)

    async def sleep(self, level: int) -> None:
        """Level 1: KV cache freed, weights to host memory; 2: weights dropped too."""
        request = pb.SleepRequest(level=level)
        await self._call("Sleep", lambda stub: stub.Sleep(request))

    async def wake_up(self) -> None:
        await self._call("WakeUp", lambda stub: stub.WakeUp(pb.WakeUpRequest()))

    async def is_sleeping(self) -> bool:
        request, timeout = pb.IsSleepingRequest(), self._rpc_timeout_s
        reply = await self._call(
            "IsSleeping", lambda stub: stub.IsSleeping(request, timeout=timeout)
        )
        return bool(reply.is_sleeping)

    async def start_profile(self) -> None:
        request, timeout = pb.StartProfileRequest(), self._rpc_timeout_s
        await self._call("StartProfile", lambda stub: stub.StartProfile(request, timeout=timeout))

    async def stop_profile(self) -> str:
        """Stop the profiler; where the engine wrote the trace."""
        reply = await self._call(
            "StopProfile", lambda stub: stub.StopProfile(pb.StopProfileRequest())
        )
        return str(reply.trace_path)

    async def _call(self, rpc: str, call: Callable[[Any], Awaitable[T]]) -> T:
        stub = self._stub
        if stub is None:
            raise EngineUnavailableError(self._unavailable_reason())
        try:
            return await call(stub)
        except grpc.aio.AioRpcError as e:
            code = _CALL_STATUSES.get(e.code(), EngineErrorCode.INTERNAL)
            raise EngineCallError(rpc, self.address, code, e.details() or e.code().name) from None

    # -- connection loop --------------------------------------------------------------------

    async def _run(self) -> None:
        delay = self._backoff.initial_s
        while not self._closing:
            was_connected = False
            unexpected: Exception | None = None
            try:
                was_connected = await self._serve_connection()
            except asyncio.CancelledError:
                raise
            except grpc.aio.AioRpcError as e:
                self.last_error = f"{e.code().name}: {e.details()}"
            except Exception as e:  # a bad tokenizer, a callback failure ...
                unexpected = e
                self.last_error = repr(e)
            if self._closing:
                break
            error = self.last_error or "connection lost"
            if was_connected:
                delay = self._backoff.initial_s
                self._log.broke(error)
            else:
                self._log.failed(error, unexpected)
            await asyncio.sleep(delay)
            delay = min(delay * self._backoff.multiplier, self._backoff.max_s)

    async def _serve_connection(self) -> bool:
        """Connect, then pump the stream until it ends. Returns whether it got connected."""
        options: list[tuple[str, str | int]] = [
            ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
            # Pings on the open Stream find a dead engine (or network) within ~40 s; the
            # engine accepts pings every 5 s or more.
            ("grpc.keepalive_time_ms", 30_000),
            ("grpc.keepalive_timeout_ms", 10_000),
        ]
        if self._credentials is None:
            channel = grpc.aio.insecure_channel(self.address, options=options)
        else:
            if self._server_name:
                options.append(("grpc.ssl_target_name_override", self._server_name))
            channel = grpc.aio.secure_channel(self.address, self._credentials, options=options)
        outbox: asyncio.Queue[pb.EngineCoreRequest | None] = asyncio.Queue()
        connected = accepted = False
        watcher: asyncio.Task[None] | None = None
        try:
            stub = self._stub = pb_grpc.EngineStub(channel)
            info = convert.model_info_from_pb(
                await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=self._rpc_timeout_s)
            )
            files = await self._fetch_tokenizer(stub)
            accepted = True
            await self._events.connected(self.address, info, files)
            if self._window:
                flow = pb.FlowControl(window=self._window)
                outbox.put_nowait(pb.EngineCoreRequest(flow=flow))
            call = stub.Stream(_drain(outbox))
            await call.wait_for_connection()
            health = HealthFollower(
                self.address, channel, ENGINE_SERVICE, self._rpc_timeout_s, self._backoff.max_s
            )
            await health.open()
            self._health = health
            self.model_info = info
            self._epoch += 1
            self._outbox = outbox
            self._connected.set()
            self.last_error = None
            connected = True
            self._log.connected(info.served_model_name)
            watcher = asyncio.create_task(health.follow(), name="engine-health")
            # Progress is reported each time a whole window has been read, which gives the
            # engine a window's room at once: one report per W messages. (Reporting every W/2
            # kept it from ever waiting on a report, but the reports' gRPC writes cost more
            # than that saved: benchmarks/results/gateway_relay_cpu.md.) The report queues on
            # the event loop behind the request tasks this message woke, so it normally leaves
            # once they have had their turn (not when the request writer is just finishing
            # another write: then it goes at once; n > 1 requests have one more hop, the merge
            # pump): an engine that outpaces the gateway's relaying, not only its reading,
            # merges its steps instead of queueing them.
            report_every = max(1, self._window)
            read, report_at = 0, report_every
            try:
                async for message in call:
                    self._dispatch(message)
                    read += 1
                    if read == report_at and self._window:
                        report_at += report_every
                        flow = pb.FlowControl(messages_read=read)
                        outbox.put_nowait(pb.EngineCoreRequest(flow=flow))
                self.last_error = "the engine closed the stream"
            except grpc.aio.AioRpcError as e:
                self.last_error = f"{e.code().name}: {e.details()}"
            return True
        finally:
            if watcher is not None:
                watcher.cancel()
            self._stub = None
            self._health = None
            self._connected.clear()
            self._outbox = None
            outbox.put_nowait(None)
            if connected:
                self._fail_in_flight(self.last_error or "connection lost")
            if accepted:
                self._events.disconnected(self.address)
            await channel.close(grace=None)

    async def _fetch_tokenizer(self, stub: pb_grpc.EngineStub) -> TokenizerFiles:
        files: dict[str, bytearray] = {}
        template: str | None = None
        stream = stub.GetTokenizer(pb.GetTokenizerRequest(), timeout=self._rpc_timeout_s)
        async for chunk in stream:
            if chunk.chat_template:
                template = chunk.chat_template
            if chunk.file_name:
                name = chunk.file_name
                if "/" in name or "\\" in name or name in (".", ".."):
                    raise ValueError(f"engine sent a tokenizer file with a bad name: {name!r}")
                files.setdefault(name, bytearray()).extend(chunk.data)
        return TokenizerFiles({k: bytes(v) for k, v in files.items()}, template)

    def _dispatch(self, message: pb.EngineCoreOutputs) -> None:
        if message.HasField("load"):
            self._events.load(self.address, convert.load_from_pb(message.load))
        collectors = self._collectors
        prompt_tokens = generation_tokens = 0  # of the requests still listened to, as vLLM counts
        for out in message.outputs:
            collector = collectors.get(out.request_id)
            if collector is not None:
                output = convert.output_from_pb(out)
                num_new = len(output.new_token_ids)
                # The prompt counts once: with a request's first token, or with a pooling
                # request's result (vLLM counts both).
                if not collector.prefilled and (num_new or output.pooled is not None):
                    collector.prefilled = True
                    prompt_tokens += output.num_prompt_tokens
                generation_tokens += num_new
                collector.put(output)
        if generation_tokens or prompt_tokens:
            self._events.step(self.address, prompt_tokens, generation_tokens, message.step_tokens)
        for err in message.errors:
            collector = collectors.get(err.request_id)
            if collector is not None:
                code = convert.error_code_from_pb(err.code)
                collector.fail(EngineRequestError(code, err.message))

    def _fail_in_flight(self, reason: str) -> None:
        error = EngineUnavailableError(f"lost the engine connection: {reason}")
        for collector in self._collectors.values():
            collector.fail(error)

    def _unavailable_reason(self) -> str:
        detail = f": {self.last_error}" if self.last_error else ""
        return f"the engine at {self.address} is not connected{detail}"


async def _drain(
    outbox: asyncio.Queue[pb.EngineCoreRequest | None],
) -> AsyncIterator[pb.EngineCoreRequest]:
    """The Stream's request iterator; ``None`` half-closes it."""
    while (item := await outbox.get()) is not None:
        yield item
