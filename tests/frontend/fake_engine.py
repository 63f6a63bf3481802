"""A real grpc.aio server implementing engine.proto with a scripted, deterministic "model".

The model writes ``SCRIPT`` over and over (starting at an offset derived from the seed), one
token per engine step, for every running request. It honours max_tokens, min_tokens,
stop_token_ids, logprobs, prompt_logprobs, aborts and a request limit (queue full), and it
exposes what happened (requests in flight, aborted ids) so tests can assert on it. A Stream's
window (FlowControl) is honoured: at most that many messages unread in flight; the steps made
meanwhile are merged by the engine's own ``protos.stream_outbox.StreamOutbox``.

Given ``supported_tasks`` with pooling tasks it also answers pooling requests, after
``pooling_steps`` steps, with ``fake_pooled``: a vector computed from the prompt's ids and their
order (so a test can tell which input a result belongs to), normalized / cut / passed through
softmax or sigmoid as the contract says.

LoRA adapters and the utility calls are served as the contract says, in memory: AddLora checks
only that the directory holds an adapter_config.json (INVALID_ARGUMENT naming it otherwise), a
request naming an unknown
adapter fails with ERROR_CODE_NOT_FOUND, an adapter shifts the script (so a test can tell which
one ran) and has its own prefix-cache entries. Sleep waits for the running requests, then health
says NOT_SERVING and new requests fail UNAVAILABLE until WakeUp; StartProfile needs
``profile_dir``. With ``utility_rpcs=False`` all ten rpcs answer UNIMPLEMENTED (an older engine).
Every such call's name is appended to ``calls``; ``call_errors[name] = (status, message)`` makes
the next call of that rpc fail so.

It runs on its own event loop in a background thread, so synchronous tests (openai client,
httpx) can drive the gateway against it; ``stop()`` kills every stream like a crashed engine.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
import uuid
from array import array
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.stream_outbox import StreamOutbox
from protos.tandem.engine.v1 import engine_pb2 as pb
from protos.tandem.engine.v1 import engine_pb2_grpc as pb_grpc

SCRIPT = "Hello world! The quick brown fox jumps over the lazy dog. Café ☕ 日本語. "
MODEL_NAME = "tiny-fake"
_CHUNK_BYTES = 4096  # small, to exercise reassembly of tokenizer files
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


# A step's message for one client, and the tokens it carried (prompts completed + generated).
Step = tuple[pb.EngineCoreOutputs, int]
Sink = asyncio.Queue[Step]

_TASK_NAMES = {
    pb.POOLING_TASK_EMBED: "embed",
    pb.POOLING_TASK_CLASSIFY: "classify",
    pb.POOLING_TASK_SCORE: "score",
}


def fake_hidden(prompt: Sequence[int], size: int, salt: float = 0.0) -> list[float]:
    """The fake model's pooled state of a prompt: depends on every id and on their order."""
    return [
        sum(math.sin(0.37 * (t + 1) * (j + 1) + 0.11 * i + salt) for i, t in enumerate(prompt))
        for j in range(size)
    ]


def _float32(values: list[float]) -> list[float]:
    return array("f", values).tolist()


def _l2(v: list[float]) -> list[float]:
    norm = math.sqrt(sum(x * x for x in v)) or 1.0
    return [x / norm for x in v]


def fake_pooled(
    prompt: Sequence[int], params: pb.PoolingParams, embedding_size: int, num_labels: int
) -> list[float]:
    """What the fake engine returns for a pooling request, rounded to float32 as on the wire."""
    if params.task == pb.POOLING_TASK_EMBED:
        v = fake_hidden(prompt, embedding_size)
        normalize = params.normalize if params.HasField("normalize") else True
        if normalize:
            v = _l2(v)
        if params.HasField("dimensions"):
            v = v[: params.dimensions]
            v = _l2(v) if normalize else v
        return _float32(v)
    logits = fake_hidden(prompt, num_labels, salt=1.0)
    if not params.HasField("activation") or params.activation:
        if len(logits) == 1:
            logits = [1.0 / (1.0 + math.exp(-logits[0]))]
        else:
            top = max(logits)
            exps = [math.exp(x - top) for x in logits]
            logits = [e / sum(exps) for e in exps]
    return _float32(logits)


@dataclass
class _Running:
    request_id: str
    prompt: list[int]
    params: pb.SamplingParams
    max_tokens: int
    sink: Sink
    offset: int
    cached: int
    output: list[int] = field(default_factory=list)
    first: bool = True
    added_at: float = field(default_factory=time.monotonic)  # also "scheduled": no queue here
    first_token_at: float | None = None
    pooling: pb.PoolingParams | None = None  # a pooling request
    steps_left: int = 0  # a pooling request's steps before its result


class FakeEngine:
    """The scripted engine; ``start()`` serves it on 127.0.0.1 in a background thread."""

    def __init__(
        self,
        tokenizer_dir: Path,
        script_ids: list[int],
        *,
        vocab_size: int,
        eos_token_id: int = 1,
        max_model_len: int = 256,
        step_s: float = 0.004,
        max_requests: int = 64,
        block_size: int = 4,
        model_name: str = MODEL_NAME,
        host: str = "127.0.0.1",
        health: bool = False,
        supported_tasks: Sequence[str] = (),
        embedding_size: int = 0,
        is_matryoshka: bool = False,
        matryoshka_dimensions: Sequence[int] = (),
        labels: Sequence[str] = (),
        pooling_steps: int = 1,
        utility_rpcs: bool = True,
        lora_modules: dict[str, str] | None = None,
        profile_dir: str | None = None,
        model_type: str = "",
        max_logprobs: int = 5,
    ) -> None:
        self.max_logprobs = max_logprobs
        self.tokenizer_dir = tokenizer_dir
        self.model_type = model_type  # GetModelInfo's (config.json's "model_type")
        self.script = script_ids
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.max_model_len = max_model_len
        self.step_s = step_s
        self.max_requests = max_requests  # tests lower it to provoke queue-full errors
        self.block_size = block_size
        self.model_name = model_name  # tests change it to play an engine serving another model
        self.host = host  # another loopback address (127.0.0.2) plays another machine
        # With ``health``, grpc.health.v1 is served too (without it: UNIMPLEMENTED, as an
        # engine that has no health service).
        self.health = _FakeHealth() if health else None
        # Pooling (empty supported_tasks: reported as the proto default, an old engine's).
        self.supported_tasks = list(supported_tasks)
        self.embedding_size = embedding_size
        self.is_matryoshka = is_matryoshka
        self.matryoshka_dimensions = list(matryoshka_dimensions)
        self.labels = list(labels)
        self.pooling_steps = pooling_steps  # tests raise it to keep pooling requests in flight
        # LoRA adapters and utility calls (see the module docstring).
        self.utility_rpcs = utility_rpcs
        self.loras: dict[str, pb.LoraInfo] = {
            name: pb.LoraInfo(lora_name=name, lora_path=path, rank=4)
            for name, path in (lora_modules or {}).items()
        }
        self.call_errors: dict[str, tuple[grpc.StatusCode, str]] = {}  # rpc -> its next failure
        self.calls: list[str] = []  # every adapter or utility rpc received, by name
        self.sleeping = False
        self.sleep_levels: list[int] = []
        self.profile_dir = profile_dir
        self.profiling = False
        self.traces: list[str] = []
        self.peak_in_flight = 0  # the most requests held at once
        self.requests: dict[str, _Running] = {}
        self.added: list[str] = []
        self.add_messages: dict[str, pb.AddRequest] = {}  # every admitted request, as sent
        self.aborted: list[str] = []
        self.abort_requests: list[str] = []  # every id a Stream asked to abort, running or not
        self.flow: list[tuple[int, int]] = []  # every FlowControl (window, messages_read) received
        self._seen_prompts: list[tuple[str | int, ...]] = []
        self._queries = 0
        self._hits = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: grpc.aio.Server | None = None
        self.port = 0

    # -- what tests look at -------------------------------------------------------------------

    @property
    def num_in_flight(self) -> int:
        return len(self.requests)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self, port: int = 0) -> int:
        started = threading.Event()
        self._loop = asyncio.new_event_loop()

        def run() -> None:
            assert self._loop is not None
            asyncio.set_event_loop(self._loop)
            self._loop.run_until_complete(self._serve(port, started))

        self._thread = threading.Thread(target=run, name="fake-engine", daemon=True)
        self._thread.start()
        if not started.wait(10):
            raise RuntimeError("fake engine did not start")
        return self.port

    def stop(self) -> None:
        """Stop at once, cancelling every stream (what clients see when an engine dies)."""
        if self._loop is None or self._thread is None:
            return
        asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(10)
        self._thread.join(10)
        self._loop.close()
        self._loop = self._thread = None
        self.requests.clear()

    async def _serve(self, port: int, started: threading.Event) -> None:
        self._server = grpc.aio.server()
        pb_grpc.add_EngineServicer_to_server(_Servicer(self), self._server)
        if self.health is not None:
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        self.port = self._server.add_insecure_port(f"{self.host}:{port}")
        await self._server.start()
        self._stopping = asyncio.Event()
        stepper = asyncio.create_task(self._step_loop())
        started.set()
        await self._stopping.wait()
        stepper.cancel()
        await self._server.stop(grace=None)
        # let grpc's own per-rpc tasks finish before the loop closes
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in others:
            task.cancel()
        if others:
            await asyncio.wait(others, timeout=2)

    async def _shutdown(self) -> None:
        self._stopping.set()

    # -- the "model" --------------------------------------------------------------------------

    def add(self, add: pb.AddRequest, sink: Sink) -> str | None:
        """Admit a request, or put a RequestError into ``sink``. Returns the id if admitted."""
        rid = add.request_id or uuid.uuid4().hex
        p = add.sampling_params
        prompt = list(add.prompt_token_ids)
        error = None
        if not prompt:
            error = (pb.ERROR_CODE_INVALID_ARGUMENT, "prompt_token_ids must not be empty")
        elif any(t >= self.vocab_size for t in prompt):
            error = (pb.ERROR_CODE_INVALID_ARGUMENT, "prompt_token_ids has an id out of range")
        elif rid in self.requests:
            error = (pb.ERROR_CODE_DUPLICATE_REQUEST_ID, f"request id {rid} is in use")
        elif len(self.requests) >= self.max_requests:
            error = (pb.ERROR_CODE_RESOURCE_EXHAUSTED, "the waiting queue is full")
        elif self.sleeping:
            error = (pb.ERROR_CODE_UNAVAILABLE, "the engine is sleeping")
        elif add.lora_name and add.lora_name not in self.loras:
            error = (pb.ERROR_CODE_NOT_FOUND, f"unknown LoRA adapter '{add.lora_name}'")
        pooling = add.pooling_params if add.HasField("pooling_params") else None
        if error is None and pooling is not None:
            error = self._pooling_error(pooling, len(prompt))
        max_tokens = p.max_tokens if p.HasField("max_tokens") else self.max_model_len - len(prompt)
        if error is None and pooling is None and len(prompt) + max_tokens > self.max_model_len:
            error = (
                pb.ERROR_CODE_CONTEXT_LENGTH_EXCEEDED,
                f"{len(prompt)} + {max_tokens} tokens exceed max_model_len={self.max_model_len}",
            )
        if error is not None:
            err = pb.RequestError(request_id=rid, code=error[0], message=error[1])
            sink.put_nowait((pb.EngineCoreOutputs(errors=[err], load=self._load()), 0))
            return None
        seed = p.seed if p.HasField("seed") else 0
        seed += sum(map(ord, add.lora_name))  # an adapter changes the "model"'s output
        cached = 0
        key = (add.lora_name, *prompt)  # adapters never share prefix-cache entries
        if key in self._seen_prompts:
            cached = (len(prompt) - 1) // self.block_size * self.block_size
        self._seen_prompts.append(key)
        self._queries += len(prompt)
        self._hits += cached
        self.requests[rid] = _Running(
            rid,
            prompt,
            p,
            max_tokens,
            sink,
            offset=seed % len(self.script),
            cached=cached,
            pooling=pooling,
            steps_left=self.pooling_steps,
        )
        self.peak_in_flight = max(self.peak_in_flight, len(self.requests))
        self.added.append(rid)
        self.add_messages[rid] = add
        return rid

    def _pooling_error(self, params: pb.PoolingParams, prompt_len: int) -> tuple[int, str] | None:
        task = _TASK_NAMES.get(params.task)
        if task not in self.supported_tasks:
            served = ", ".join(self.supported_tasks) or "generate"
            return (
                pb.ERROR_CODE_INVALID_ARGUMENT,
                f"pooling_params.task: {task or 'unset'} is not served (serves {served})",
            )
        listed = self.matryoshka_dimensions
        if params.HasField("dimensions") and not (
            (self.is_matryoshka or listed)
            and 1 <= params.dimensions <= self.embedding_size
            and (not listed or params.dimensions in listed)
        ):
            return (pb.ERROR_CODE_INVALID_ARGUMENT, "pooling_params.dimensions: not accepted")
        if prompt_len > self.max_model_len:
            return (
                pb.ERROR_CODE_CONTEXT_LENGTH_EXCEEDED,
                f"{prompt_len} tokens exceed max_model_len={self.max_model_len}",
            )
        return None

    def abort(self, request_ids: list[str]) -> int:
        n = 0
        for rid in request_ids:
            r = self.requests.pop(rid, None)
            if r is None:
                continue
            n += 1
            self.aborted.append(rid)
            final = self._output(r, [], pb.FINISH_REASON_ABORT, None)
            r.sink.put_nowait((pb.EngineCoreOutputs(outputs=[final], load=self._load()), 0))
        return n

    async def _step_loop(self) -> None:
        while True:
            await asyncio.sleep(self.step_s)
            self.step()

    def step(self) -> None:
        by_sink: dict[int, tuple[Sink, list[pb.RequestOutput], list[int]]] = {}
        for r in list(self.requests.values()):
            if r.pooling is not None:
                r.steps_left -= 1
                if r.steps_left > 0:
                    continue
                del self.requests[r.request_id]
                pooled = fake_pooled(r.prompt, r.pooling, self.embedding_size, len(self.labels))
                entry = by_sink.setdefault(id(r.sink), (r.sink, [], [0]))
                entry[1].append(self._output(r, [], pb.FINISH_REASON_STOP, None, pooled))
                entry[2][0] += len(r.prompt)  # a pooled result counts its prompt
                continue
            token = self.script[(r.offset + len(r.output)) % len(self.script)]
            r.output.append(token)
            p = r.params
            finish, stop_reason = pb.FINISH_REASON_UNSPECIFIED, None
            may_stop = len(r.output) >= p.min_tokens
            if may_stop and token in p.stop_token_ids:
                finish, stop_reason = pb.FINISH_REASON_STOP, token
            elif may_stop and token == self.eos_token_id and not p.ignore_eos:
                finish, stop_reason = pb.FINISH_REASON_STOP, token
            elif len(r.output) >= r.max_tokens:
                finish = pb.FINISH_REASON_LENGTH
            if finish != pb.FINISH_REASON_UNSPECIFIED:
                del self.requests[r.request_id]
            entry = by_sink.setdefault(id(r.sink), (r.sink, [], [0]))
            entry[2][0] += 1 + (len(r.prompt) if r.first else 0)  # a first token: its prompt too
            entry[1].append(self._output(r, [token], finish, stop_reason))
        load = self._load()
        for sink, outputs, tokens in by_sink.values():
            sink.put_nowait((pb.EngineCoreOutputs(outputs=outputs, load=load), tokens[0]))

    def _output(
        self,
        r: _Running,
        tokens: list[int],
        finish: int,
        stop_reason: int | None,
        pooled: list[float] | None = None,
    ) -> pb.RequestOutput:
        out = pb.RequestOutput(
            request_id=r.request_id,
            new_token_ids=tokens,
            finish_reason=finish,  # type: ignore[arg-type]
            num_cached_tokens=r.cached,
            num_prompt_tokens=len(r.prompt),
        )
        if pooled is not None:
            out.pooled.data.extend(pooled)
        if stop_reason is not None:
            out.stop_reason = stop_reason
        if r.params.HasField("logprobs"):
            out.logprobs.extend(self._logprob(t, r.params.logprobs) for t in tokens)
        if r.first and r.params.HasField("prompt_logprobs"):
            k = r.params.prompt_logprobs
            out.prompt_logprobs.extend(self._logprob(t, k, -1.0) for t in r.prompt[1:])
        now = time.monotonic()
        if tokens and r.first_token_at is None:
            r.first_token_at = now
        if r.first or finish != pb.FINISH_REASON_UNSPECIFIED:  # the contract's phase times
            first_token = now if r.first_token_at is None else r.first_token_at
            out.queued_time_s = 0.0
            out.prefill_time_s = first_token - r.added_at
            if finish != pb.FINISH_REASON_UNSPECIFIED:
                out.decode_time_s = now - first_token
        r.first = False
        return out

    def _logprob(self, token: int, k: int, logprob: float = -0.25) -> pb.TokenLogprob:
        top = [pb.TopLogprob(token_id=token, logprob=logprob)]
        top += [
            pb.TopLogprob(token_id=(token + i) % self.vocab_size, logprob=logprob - 1.0 - i)
            for i in range(1, k)
        ]
        return pb.TokenLogprob(token_id=token, logprob=logprob, rank=1, top_logprobs=top[:k])

    def _load(self) -> pb.LoadStats:
        return pb.LoadStats(
            num_running_requests=len(self.requests),
            num_waiting_requests=0,
            kv_cache_usage=min(1.0, len(self.requests) / 64),
            prefix_cache_queries=self._queries,
            prefix_cache_hits=self._hits,
            num_preemptions=0,
        )


class _FakeHealth(health_pb2_grpc.HealthServicer):
    """Health the test sets (``serving``); ``reset_watches`` breaks every open Watch call the way
    a proxy resetting a quiet stream would, leaving the Engine stream alone."""

    def __init__(self) -> None:
        self.serving = True
        self.watches_opened = 0
        self._generation = 0

    def reset_watches(self) -> None:
        self._generation += 1

    def _status(self) -> int:
        return SERVING if self.serving else NOT_SERVING

    async def Check(  # noqa: N802
        self, request: health_pb2.HealthCheckRequest, context: object
    ) -> health_pb2.HealthCheckResponse:
        return health_pb2.HealthCheckResponse(status=self._status())  # type: ignore[arg-type]

    async def Watch(  # noqa: N802
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> None:
        self.watches_opened += 1
        generation, last = self._generation, None
        while True:
            if self._generation != generation:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "stream reset by a proxy")
            status = self._status()
            if status != last:
                await context.write(health_pb2.HealthCheckResponse(status=status))  # type: ignore[arg-type]
                last = status
            await asyncio.sleep(0.01)


class _Servicer(pb_grpc.EngineServicer):
    def __init__(self, engine: FakeEngine) -> None:
        self.engine = engine

    async def Stream(  # noqa: N802 (the rpc's name)
        self, request_iterator: AsyncIterator[pb.EngineCoreRequest], context: object
    ) -> AsyncIterator[pb.EngineCoreOutputs]:
        engine = self.engine
        sink: Sink = asyncio.Queue()
        owned: set[str] = set()
        # The steps not sent yet, merged, and the client's window: the engine's own outbox.
        outbox = StreamOutbox()
        room = asyncio.Event()

        async def read() -> None:
            async for message in request_iterator:
                kind = message.WhichOneof("kind")
                if kind == "add":
                    rid = engine.add(message.add, sink)
                    if rid is not None:
                        owned.add(rid)
                elif kind == "flow":
                    engine.flow.append((message.flow.window, message.flow.messages_read))
                    outbox.flow(message.flow.window, message.flow.messages_read)
                    room.set()
                elif kind == "abort":
                    engine.abort_requests.extend(message.abort.request_ids)
                    engine.abort(list(message.abort.request_ids))

        reader = asyncio.create_task(read())
        try:
            while True:
                while not sink.empty():  # everything queued is merged before a message goes
                    outbox.add(*sink.get_nowait())
                if reader.done():
                    outbox.drop_window()  # half-closed: no progress can come
                if outbox.ready():
                    yield outbox.take()
                    continue
                if reader.done():
                    break  # the client half-closed: closing the stream aborts what it carried
                room.clear()
                get = asyncio.ensure_future(sink.get())
                wait = asyncio.ensure_future(room.wait())
                await asyncio.wait({get, wait, reader}, return_when=asyncio.FIRST_COMPLETED)
                wait.cancel()
                if get.done():
                    outbox.add(*get.result())
                else:
                    get.cancel()
        finally:
            reader.cancel()
            engine.abort([rid for rid in owned if rid in engine.requests])

    async def Generate(  # noqa: N802
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        sink: Sink = asyncio.Queue()
        rid = self.engine.add(request.request, sink)
        try:
            while True:
                message, _ = await sink.get()
                if message.errors:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message.errors[0].message)
                for out in message.outputs:
                    yield pb.GenerateResponse(output=out, load=message.load)
                    if out.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                        return
        finally:
            if rid is not None:
                self.engine.abort([rid])

    async def Abort(  # noqa: N802
        self, request: pb.AbortRequest, context: object
    ) -> pb.AbortResponse:
        return pb.AbortResponse(num_aborted=self.engine.abort(list(request.request_ids)))

    async def GetModelInfo(  # noqa: N802
        self, request: pb.GetModelInfoRequest, context: object
    ) -> pb.GetModelInfoResponse:
        e = self.engine
        return pb.GetModelInfoResponse(
            served_model_name=e.model_name,
            max_model_len=e.max_model_len,
            vocab_size=e.vocab_size,
            eos_token_ids=[e.eos_token_id],
            bos_token_id=0,
            block_size=e.block_size,
            num_kv_blocks=64,
            kv_capacity_tokens=64 * e.block_size,
            max_logprobs=e.max_logprobs,
            model_source="scripted fake engine",
            engine_version="fake-0",
            enable_prefix_caching=True,
            kv_cache_dtype="float32",
            supported_tasks=e.supported_tasks,
            embedding_size=e.embedding_size,
            pooling_type="LAST" if "embed" in e.supported_tasks else "",
            is_matryoshka=e.is_matryoshka,
            matryoshka_dimensions=e.matryoshka_dimensions,
            labels=e.labels,
            model_type=e.model_type,
        )

    async def GetTokenizer(  # noqa: N802
        self, request: pb.GetTokenizerRequest, context: object
    ) -> AsyncIterator[pb.GetTokenizerResponse]:
        import json

        config = json.loads((self.engine.tokenizer_dir / "tokenizer_config.json").read_text())
        yield pb.GetTokenizerResponse(chat_template=config.get("chat_template", ""))
        for path in sorted(self.engine.tokenizer_dir.iterdir()):
            data = path.read_bytes()
            for i in range(0, max(len(data), 1), _CHUNK_BYTES):
                yield pb.GetTokenizerResponse(file_name=path.name, data=data[i : i + _CHUNK_BYTES])

    # -- LoRA adapters and utility calls ------------------------------------------------------

    async def _enter(self, rpc: str, context: grpc.aio.ServicerContext) -> FakeEngine:
        engine = self.engine
        engine.calls.append(rpc)
        if not engine.utility_rpcs:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
        error = engine.call_errors.pop(rpc, None)
        if error is not None:
            await context.abort(*error)
        return engine

    async def _known(self, name: str, context: grpc.aio.ServicerContext) -> None:
        if name not in self.engine.loras:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown LoRA adapter '{name}'")

    async def AddLora(  # noqa: N802
        self, request: pb.AddLoraRequest, context: grpc.aio.ServicerContext
    ) -> pb.AddLoraResponse:
        e = await self._enter("AddLora", context)
        name, path = request.lora_name, request.lora_path
        if not name:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "lora_name must not be empty")
        if name in e.loras:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"lora_name '{name}' is in use")
        if not Path(path).exists():  # as the engine: NOT_FOUND for a path that is not there
            await context.abort(grpc.StatusCode.NOT_FOUND, f"{path}: no such adapter directory")
        config = Path(path) / "adapter_config.json"
        if not config.is_file():
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"{config}: no such file (not a PEFT adapter)"
            )
        info = pb.LoraInfo(lora_name=name, lora_path=path, rank=4, pinned=request.pin)
        e.loras[name] = info
        return pb.AddLoraResponse(lora=info)

    async def RemoveLora(  # noqa: N802
        self, request: pb.RemoveLoraRequest, context: grpc.aio.ServicerContext
    ) -> pb.RemoveLoraResponse:
        e = await self._enter("RemoveLora", context)
        await self._known(request.lora_name, context)
        del e.loras[request.lora_name]
        return pb.RemoveLoraResponse()

    async def ListLoras(  # noqa: N802
        self, request: pb.ListLorasRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListLorasResponse:
        e = await self._enter("ListLoras", context)
        return pb.ListLorasResponse(loras=list(e.loras.values()))

    async def PinLora(  # noqa: N802
        self, request: pb.PinLoraRequest, context: grpc.aio.ServicerContext
    ) -> pb.PinLoraResponse:
        e = await self._enter("PinLora", context)
        await self._known(request.lora_name, context)
        e.loras[request.lora_name].pinned = True
        return pb.PinLoraResponse()

    async def ResetPrefixCache(  # noqa: N802
        self, request: pb.ResetPrefixCacheRequest, context: grpc.aio.ServicerContext
    ) -> pb.ResetPrefixCacheResponse:
        e = await self._enter("ResetPrefixCache", context)
        e._seen_prompts = [key for key in e._seen_prompts if key[1:] in _running_prompts(e)]
        return pb.ResetPrefixCacheResponse(reset=not e.requests)

    async def Sleep(  # noqa: N802
        self, request: pb.SleepRequest, context: grpc.aio.ServicerContext
    ) -> pb.SleepResponse:
        e = await self._enter("Sleep", context)
        while e.requests:  # the running requests finish first
            await asyncio.sleep(e.step_s)
        e.sleep_levels.append(request.level or 1)
        e.sleeping = True
        if e.health is not None:
            e.health.serving = False
        return pb.SleepResponse()

    async def WakeUp(  # noqa: N802
        self, request: pb.WakeUpRequest, context: grpc.aio.ServicerContext
    ) -> pb.WakeUpResponse:
        e = await self._enter("WakeUp", context)
        e.sleeping = False
        if e.health is not None:
            e.health.serving = True
        return pb.WakeUpResponse()

    async def IsSleeping(  # noqa: N802
        self, request: pb.IsSleepingRequest, context: grpc.aio.ServicerContext
    ) -> pb.IsSleepingResponse:
        e = await self._enter("IsSleeping", context)
        return pb.IsSleepingResponse(is_sleeping=e.sleeping)

    async def StartProfile(  # noqa: N802
        self, request: pb.StartProfileRequest, context: grpc.aio.ServicerContext
    ) -> pb.StartProfileResponse:
        e = await self._enter("StartProfile", context)
        if e.profile_dir is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, "no profile directory (--profile-dir)"
            )
        if e.profiling:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "a profile is running")
        e.profiling = True
        return pb.StartProfileResponse()

    async def StopProfile(  # noqa: N802
        self, request: pb.StopProfileRequest, context: grpc.aio.ServicerContext
    ) -> pb.StopProfileResponse:
        e = await self._enter("StopProfile", context)
        if not e.profiling:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "no profile is running")
        e.profiling = False
        e.traces.append(f"{e.profile_dir}/trace-{len(e.traces)}.json")
        return pb.StopProfileResponse(trace_path=e.traces[-1])


def _running_prompts(engine: FakeEngine) -> set[tuple[int, ...]]:
    return {tuple(r.prompt) for r in engine.requests.values()}
