"""The two servers benchmarks/gateway_relay.py measures the gateway against::

    python benchmarks/relay_standins.py engine --port P --tokenizer-dir D --token-id T
    python benchmarks/relay_standins.py bare --port P

``engine``  a stand-in for a GPU engine that is never the bottleneck: the Engine service of
            engine.proto (GetModelInfo, GetTokenizer, Stream) plus grpc.health.v1 SERVING. Every
            step it writes, on each open Stream, one EngineCoreOutputs with one new token (always
            ``--token-id``) for every running request of that stream, then yields to its event
            loop; a request finishes after max_tokens (FINISH_REASON_LENGTH). A step's message is
            written only once grpc has taken the previous one, but gRPC flow control alone lets
            it run megabytes ahead of a slow reader, which finishes every request within a few
            steps of its arrival and turns the steps into one-request messages. So, unpaced, it
            also stays at most ``--lead-steps`` steps ahead of the tokens the client has received
            (read from the ``--progress`` board the client writes): the batches stay whole and
            the steps go as fast as the gateway drains them. The messages are built from bytes
            encoded once per request, so the engine costs little beyond gRPC's own per-message
            work. A client that sets a window (the contract's FlowControl, as the gateway does)
            gets what the real engine does: the steps that come while its window is full are
            held and sent as one message (each request's tokens in one entry) once it reports
            progress (unpaced, those steps are taken at once, up to the lead: an engine that is
            never the bottleneck spends no time per step); half-closing drops the window.
            ``--step-ms X`` paces the steps (one every X ms per stream); ``--record PATH`` keeps
            each step's time (CLOCK_MONOTONIC: when it is sent, or for a step held while the
            client's window was full, when it was taken, so the hold counts as latency) and
            each request's first step, written to PATH on SIGUSR1.
``bare``    the floor: a minimal Starlette app under uvicorn whose streaming /v1/completions
            sends the gateway's completion chunks (same JSON shape) one token per event, then
            ``data: [DONE]``, as fast as it can or paced by ``--step-ms``; no engine behind it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import struct
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import orjson
import uvicorn
import uvloop
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from relay_client import GENERATION, MESSAGES, OUTPUTS, RECEIVED, Progress
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from tokenizers import Tokenizer

from protos.stream_outbox import StreamOutbox
from protos.tandem.engine.v1 import engine_pb2 as pb

MODEL_NAME = "relay-bench"
READY = "RELAY_ENGINE_READY"

# ------------------------------------------------------------------------------ stand-in engine


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _len_field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field (an embedded message) as encoded bytes."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


_TIMESTAMP_TAG = _varint(4 << 3 | 1)  # EngineCoreOutputs.timestamp, a double


async def paced(next_t: float, step_s: float) -> float:
    """Sleep until ``next_t + step_s`` and return that time; when it is already past, return now
    (a server that fell behind does not catch up in a burst)."""
    next_t += step_s
    delay = next_t - time.monotonic()
    if delay <= 0:
        return time.monotonic()
    await asyncio.sleep(delay)
    return next_t


@dataclass
class _Request:
    request_id: str
    entry: bytes  # EngineCoreOutputs.outputs entry: one token, still running
    last: bytes  # the same with finish_reason LENGTH
    remaining: int
    first_step: int = -1
    num_prompt_tokens: int = 0


@dataclass
class _ClientStream:
    """One client's Stream call: its running requests and the time of each of its steps."""

    number: int
    running: dict[str, _Request] = field(default_factory=dict)
    finals: list[bytes] = field(default_factory=list)  # aborted requests' last outputs
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    steps: int = 0
    step_times: list[float] = field(default_factory=list)  # kept with --record only
    # The client's FlowControl and the steps held while its window is full, merged: the
    # engine's own outbox (protos.stream_outbox). A step that finds nothing held and room in
    # the window goes out at once as pre-encoded bytes, as the outbox would send it.
    outbox: StreamOutbox = field(default_factory=StreamOutbox)

    def window_full(self) -> bool:
        return self.outbox.flow_window.full

    @property
    def held(self) -> bool:
        return not self.outbox.empty


async def _woken_or_closed(s: _ClientStream, reader: asyncio.Task[None]) -> None:
    """Wait until the stream is woken (an add, an abort, progress) or its client half-closes."""
    s.wake.clear()
    waiter = asyncio.ensure_future(s.wake.wait())
    await asyncio.wait({waiter, reader}, return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()


class StandInEngine:
    """Engine service handlers; Stream messages are pre-encoded bytes (identity serializer)."""

    def __init__(
        self,
        tokenizer_dir: Path,
        token_id: int,
        vocab_size: int,
        step_s: float,
        record: bool,
        progress: Progress | None = None,
        lead_steps: int = 0,
    ) -> None:
        self.tokenizer_dir = tokenizer_dir
        self.token_id = token_id
        self.vocab_size = vocab_size
        self.step_s = step_s
        self.record = record
        self.streams: list[_ClientStream] = []
        self.first_steps: dict[str, tuple[int, int]] = {}  # request id -> (stream, step)
        self.progress = progress
        self.lead_steps = lead_steps
        self.messages = self.outputs = 0
        self._generation = 0
        self._outputs_before = 0  # outputs sent before the current client started

    def _ahead(self) -> bool:
        """Whether this engine has sent ``lead_steps`` steps more than the client received."""
        if self.progress is None or self.lead_steps <= 0:
            return False
        generation = self.progress.get(GENERATION)
        if generation != self._generation:  # a new client: count from here
            self._generation, self._outputs_before = generation, self.outputs
        running = sum(len(s.running) for s in self.streams)
        lead = self.outputs - self._outputs_before - self.progress.get(RECEIVED)
        return lead > self.lead_steps * max(running, 8)

    def handler(self) -> Any:
        handlers = {
            "Stream": grpc.stream_stream_rpc_method_handler(
                self.stream,
                request_deserializer=pb.EngineCoreRequest.FromString,
                response_serializer=bytes,
            ),
            "GetModelInfo": grpc.unary_unary_rpc_method_handler(
                self.get_model_info,
                request_deserializer=pb.GetModelInfoRequest.FromString,
                response_serializer=pb.GetModelInfoResponse.SerializeToString,
            ),
            "GetTokenizer": grpc.unary_stream_rpc_method_handler(
                self.get_tokenizer,
                request_deserializer=pb.GetTokenizerRequest.FromString,
                response_serializer=pb.GetTokenizerResponse.SerializeToString,
            ),
        }
        service = pb.DESCRIPTOR.services_by_name["Engine"].full_name
        return grpc.method_handlers_generic_handler(service, handlers)

    async def get_model_info(self, request: Any, context: Any) -> Any:
        return pb.GetModelInfoResponse(
            served_model_name=MODEL_NAME,
            max_model_len=1 << 16,
            vocab_size=self.vocab_size,
            eos_token_ids=[1],
            bos_token_id=0,
            block_size=16,
            num_kv_blocks=1 << 16,
            kv_capacity_tokens=1 << 20,
            max_logprobs=5,
            model_source="benchmarks/relay_processes.py stand-in engine",
            engine_version="relay-stand-in",
        )

    async def get_tokenizer(self, request: Any, context: Any) -> AsyncIterator[Any]:
        yield pb.GetTokenizerResponse(chat_template="")
        for path in sorted(self.tokenizer_dir.iterdir()):
            data = path.read_bytes()
            for i in range(0, max(len(data), 1), 1 << 20):
                yield pb.GetTokenizerResponse(file_name=path.name, data=data[i : i + (1 << 20)])

    def _add(self, s: _ClientStream, add: Any) -> None:
        p = add.sampling_params
        max_tokens = p.max_tokens if p.HasField("max_tokens") else 16
        out = pb.RequestOutput(
            request_id=add.request_id,
            new_token_ids=[self.token_id],
            num_prompt_tokens=len(add.prompt_token_ids),
        )
        entry = _len_field(1, out.SerializeToString())
        out.finish_reason = pb.FINISH_REASON_LENGTH
        last = _len_field(1, out.SerializeToString())
        s.running[add.request_id] = _Request(
            add.request_id,
            entry,
            last,
            max(1, max_tokens),
            num_prompt_tokens=len(add.prompt_token_ids),
        )
        s.wake.set()

    def _abort(self, s: _ClientStream, request_ids: list[str]) -> None:
        for rid in request_ids:
            if s.running.pop(rid, None) is not None:
                out = pb.RequestOutput(request_id=rid, finish_reason=pb.FINISH_REASON_ABORT)
                if s.held:  # after its held tokens, merged into their entry
                    s.outbox.add(pb.EngineCoreOutputs(outputs=[out]))
                else:
                    s.finals.append(_len_field(1, out.SerializeToString()))
                s.wake.set()

    def _advance(self, s: _ClientStream) -> list[tuple[_Request, bool]]:
        """One engine step for stream ``s``: a token for each running request; returns each
        request with whether it just finished (those leave ``running``)."""
        step = s.steps
        advanced = []
        for r in s.running.values():
            if r.first_step < 0:
                r.first_step = step
                if self.record:
                    self.first_steps[r.request_id] = (s.number, step)
            r.remaining -= 1
            advanced.append((r, not r.remaining))
        for r, finished in advanced:
            if finished:
                del s.running[r.request_id]
        s.steps += 1
        self.outputs += len(advanced)
        if self.progress is not None:
            self.progress.set(OUTPUTS, self.outputs)
        return advanced

    def _hold(self, s: _ClientStream) -> None:
        """A step while the client's window is full: it waits in the outbox, merged."""
        if self.record:  # the step's time is now: the hold counts as latency
            s.step_times.append(time.monotonic())
        step, tokens = s.steps, 0
        parts, s.finals = s.finals, []
        for r, finished in self._advance(s):
            parts.append(r.last if finished else r.entry)
            # as the engine counts a step: the prompts it completed and the tokens it generated
            tokens += 1 + (r.num_prompt_tokens if r.first_step == step else 0)
        s.outbox.add(pb.EngineCoreOutputs.FromString(b"".join(parts)), tokens)

    def _flush(self, s: _ClientStream) -> bytes:
        """The held steps, merged by the outbox (a request's tokens in one entry), as one
        message."""
        message = s.outbox.take()
        message.load.num_running_requests = len(s.running)
        self._count_message()
        return message.SerializeToString()

    def _message(self, s: _ClientStream, parts: list[bytes]) -> bytes:
        load = pb.LoadStats(num_running_requests=len(s.running)).SerializeToString()
        parts.append(_len_field(3, load))
        parts.append(_TIMESTAMP_TAG + struct.pack("<d", time.time()))
        s.outbox.flow_window.sent += 1
        self._count_message()
        return b"".join(parts)

    def _count_message(self) -> None:
        self.messages += 1
        if self.progress is not None:
            self.progress.set(MESSAGES, self.messages)

    def _step(self, s: _ClientStream) -> bytes:
        """One step for one stream: a token for each running request, as EngineCoreOutputs."""
        parts, s.finals = s.finals, []
        parts += [r.last if finished else r.entry for r, finished in self._advance(s)]
        if self.record:
            s.step_times.append(time.monotonic())
        return self._message(s, parts)

    async def _read(self, s: _ClientStream, requests: AsyncIterator[Any]) -> None:
        async for message in requests:
            kind = message.WhichOneof("kind")
            if kind == "add":
                self._add(s, message.add)
            elif kind == "abort":
                self._abort(s, list(message.abort.request_ids))
            elif kind == "flow":
                s.outbox.flow(message.flow.window, message.flow.messages_read)
                s.wake.set()

    async def stream(self, requests: AsyncIterator[Any], context: Any) -> AsyncIterator[bytes]:
        s = _ClientStream(len(self.streams))
        self.streams.append(s)
        reader = asyncio.create_task(self._read(s, requests))
        reader.add_done_callback(lambda t: t.cancelled() or t.exception())  # seen: not logged
        next_t = time.monotonic()
        try:
            while True:
                if reader.done():
                    s.outbox.drop_window()  # half-closed: no more progress reports can come
                if s.held and not s.window_full():
                    yield self._flush(s)
                    continue
                if not s.running and not s.finals:
                    if reader.done() and not s.held:
                        return  # half-closed and nothing in flight: end the stream with OK
                    await _woken_or_closed(s, reader)
                    next_t = time.monotonic()
                    continue
                if self.step_s > 0:
                    next_t += self.step_s
                    if next_t <= time.monotonic():  # fell behind: no burst to catch up
                        next_t = time.monotonic()
                    # Until the step is due, send what is held as soon as the client makes room.
                    while (delay := next_t - time.monotonic()) > 0:
                        if s.held and not s.window_full():
                            yield self._flush(s)
                            continue
                        s.wake.clear()
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(s.wake.wait(), delay)
                else:
                    await asyncio.sleep(0)  # let the reader take adds and aborts between steps
                    while self._ahead():
                        if s.held and not s.window_full():
                            break  # room again: send what is held at once
                        # A progress report wakes this at once; the board is read every ~1 ms.
                        s.wake.clear()
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(s.wake.wait(), 0.0005)
                if s.held and not s.window_full():
                    yield self._flush(s)  # then this step, if the window still has room
                paced_somehow = self.step_s > 0 or (self.progress is not None and self.lead_steps)
                if s.window_full():
                    if s.running and paced_somehow:
                        self._hold(s)  # the engine steps on; its tokens wait, merged
                        # Unpaced, an engine that is never the bottleneck takes no time per
                        # step: it steps on at once up to its lead, not one step per turn of
                        # its event loop (which cost this process ~5 us of CPU per step).
                        while self.step_s <= 0 and s.running and not self._ahead():
                            self._hold(s)
                    else:  # only finals, or no model of the engine's pace: wait for room
                        await _woken_or_closed(s, reader)
                elif s.running or s.finals:
                    yield self._step(s)  # resumes once grpc has taken the message
        finally:
            reader.cancel()
            s.running.clear()

    def dump(self, path: Path) -> None:
        record = {
            "step_times": [s.step_times for s in self.streams],
            "first_steps": self.first_steps,
        }
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(orjson.dumps(record))
        os.replace(tmp, path)


async def serve_engine(args: argparse.Namespace) -> None:
    tok = Tokenizer.from_file(str(args.tokenizer_dir / "tokenizer.json"))
    engine = StandInEngine(
        args.tokenizer_dir,
        args.token_id,
        tok.get_vocab_size(),
        args.step_ms / 1e3,
        bool(args.record),
        Progress(args.progress) if args.progress else None,
        args.lead_steps,
    )
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((engine.handler(),))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for service in ("", "tandem.engine.v1.Engine"):
        await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    server.add_insecure_port(f"127.0.0.1:{args.port}")
    await server.start()
    loop = asyncio.get_running_loop()
    if args.record:
        loop.add_signal_handler(signal.SIGUSR1, engine.dump, args.record)
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    print(READY, flush=True)
    await stop.wait()
    await server.stop(grace=None)


# ------------------------------------------------------------------------------ bare server


@dataclass
class _BareRequest:
    """One paced bare stream: the step of each token it has been given and not yet sent."""

    remaining: int
    steps: list[int] = field(default_factory=list)
    waiter: asyncio.Future[None] | None = None


class Ticker:
    """The bare server's engine-like clock (``--step-ms``): every step gives one token to every
    running request at once, as an engine step does, and keeps the step's time, so the paced
    bare run measures (client receive - step time) exactly as the gateway's paced run does. What
    it measures is the floor under the gateway's figure: the HTTP write of a step's events, one
    after the other, and the client's read of them."""

    def __init__(self, step_s: float) -> None:
        self.step_s = step_s
        self.running: list[_BareRequest] = []
        self.step_times: list[float] = []
        self.first_steps: dict[str, tuple[int, int]] = {}  # "<chunk id>-0" -> (0, first step)

    def add(self, chunk_id: str, num_tokens: int) -> _BareRequest:
        r = _BareRequest(num_tokens)
        self.running.append(r)
        self.first_steps[f"{chunk_id}-0"] = (0, len(self.step_times))
        return r

    async def run(self) -> None:
        next_t = time.monotonic()
        while True:
            next_t = await paced(next_t, self.step_s)
            if self.running:
                self.tick()

    def tick(self) -> None:
        step = len(self.step_times)
        self.step_times.append(time.monotonic())
        still: list[_BareRequest] = []
        for r in self.running:
            r.steps.append(step)
            r.remaining -= 1
            if r.remaining > 0:
                still.append(r)
            if r.waiter is not None and not r.waiter.done():
                r.waiter.set_result(None)
        self.running = still

    async def tokens(self, r: _BareRequest) -> AsyncIterator[int]:
        """The request's tokens as the steps give them (several, if it fell behind)."""
        while True:
            while not r.steps:
                r.waiter = asyncio.get_running_loop().create_future()
                await r.waiter
            steps, r.steps = r.steps, []
            for step in steps:
                yield step
            if r.remaining <= 0 and not r.steps:
                return

    def dump(self, path: Path) -> None:
        record = {"step_times": [self.step_times], "first_steps": self.first_steps}
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(orjson.dumps(record))
        os.replace(tmp, path)


def build_bare_app(step_s: float, ticker: Ticker | None = None) -> Starlette:
    """Starlette app: /v1/completions streams max_tokens one-character chunks; /health.

    With a ``ticker`` the tokens come from its steps; otherwise as fast as the loop turns, or
    each stream paced on its own every ``step_s``."""

    async def completions(request: Request) -> Response:
        body = await request.json()
        n = int(body.get("max_tokens") or 16)
        head = {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": body.get("model") or MODEL_NAME,
        }

        def event(i: int) -> str:
            choice = {
                "index": 0,
                "text": "a",
                "logprobs": None,
                "finish_reason": "length" if i == n - 1 else None,
                "stop_reason": None,
            }
            data = json.dumps(
                {**head, "choices": [choice]}, ensure_ascii=False, separators=(",", ":")
            )
            return f"data: {data}\n\n"

        async def events() -> AsyncIterator[str]:
            next_t = time.monotonic()
            for i in range(n):
                if step_s > 0:
                    next_t = await paced(next_t, step_s)
                else:
                    await asyncio.sleep(0)  # a step boundary, as the engine has
                yield event(i)
            yield "data: [DONE]\n\n"

        async def ticked_events(t: Ticker) -> AsyncIterator[str]:
            i = 0
            async for _ in t.tokens(t.add(head["id"], n)):
                yield event(i)
                i += 1
            yield "data: [DONE]\n\n"

        source = events() if ticker is None else ticked_events(ticker)
        return StreamingResponse(source, media_type="text/event-stream")

    async def health_route(request: Request) -> Response:
        return Response(status_code=200)

    return Starlette(
        routes=[
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/health", health_route),
        ]
    )


async def serve_bare(args: argparse.Namespace) -> None:
    ticker = Ticker(args.step_ms / 1e3) if args.record else None
    app = build_bare_app(args.step_ms / 1e3, ticker)
    config = uvicorn.Config(app, host="127.0.0.1", port=args.port, log_level="warning")
    server = uvicorn.Server(config)
    tasks = []
    if ticker is not None:
        tasks.append(asyncio.create_task(ticker.run()))
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGUSR1, ticker.dump, args.record)
    try:
        await server.serve()
    finally:
        for task in tasks:
            task.cancel()


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = ap.add_subparsers(dest="command", required=True)
    e = sub.add_parser("engine", help="the stand-in engine (gRPC)")
    e.add_argument("--port", type=int, required=True)
    e.add_argument("--tokenizer-dir", type=Path, required=True)
    e.add_argument("--token-id", type=int, required=True, help="the token every step emits")
    e.add_argument("--step-ms", type=float, default=0.0, help="pace: a step every X ms")
    e.add_argument("--record", type=Path, default=None, help="write send times here on SIGUSR1")
    e.add_argument("--progress", type=Path, default=None, help="the board shared with the client")
    e.add_argument(
        "--lead-steps",
        type=int,
        default=4,
        help="unpaced: stay at most this many steps (of every running request, at least 8 "
        "tokens each) ahead of the tokens the client has received; 0: only gRPC flow control",
    )
    b = sub.add_parser("bare", help="the bare Starlette SSE server")
    b.add_argument("--port", type=int, required=True)
    b.add_argument("--step-ms", type=float, default=0.0)
    b.add_argument(
        "--record",
        type=Path,
        default=None,
        help="engine-like steps every --step-ms (one token to every stream at once), their "
        "times written here on SIGUSR1",
    )
    args = ap.parse_args()
    if args.command == "engine":
        asyncio.run(serve_engine(args))
    else:
        uvloop.run(serve_bare(args))  # what uvicorn.run picks when uvloop is installed


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
