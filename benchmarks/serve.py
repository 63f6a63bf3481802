"""Online serving benchmark with the metrics of ``vllm bench serve``.

Against any OpenAI-compatible server (streaming completions, ``concurrency`` requests in flight)::

    python benchmarks/serve.py --base-url http://127.0.0.1:8000 --model tandem-tiny-llama \
        --num-prompts 128 --concurrency 64 --input-len 32 256 --output-len 32 128 --out r.json

Or ``--compare``: build the ``llama-25m`` random-weight model of benchmarks/throughput.py and run
the same workload (random token-id prompts, ignore_eos, greedy) three ways, in one run:

    in-process  EngineCore in this process, every request added at once
    grpc        ``python -m engine_svc --model DIR``; one ``Stream``, ``concurrency`` in flight
    http        engine + ``python -m frontend_svc``; ``concurrency`` streaming completions

    python benchmarks/serve.py --compare --num-prompts 128 --concurrency 64 --out r.json

Metrics (as vLLM defines them): TTFT to the first chunk with choices, ITL between chunks,
TPOT = (latency - TTFT) / (output_len - 1), E2EL; mean/median/p99 of each; request, output and
total (input + output) token throughput over the wall time of the whole run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import platform
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

Workload = list[tuple[list[int], int]]  # (prompt token ids, output length)
_WORDS = (
    "the engine schedules every request under one token budget and keeps keys and values in a "
    "paged cache of fixed size blocks while the gateway streams tokens back to many clients"
).split()


@dataclass
class RequestRecord:
    """What one request saw: when it was sent, when each chunk with tokens came, the end."""

    prompt_len: int
    start: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    output_len: int = 0
    end: float = 0.0
    error: str | None = None

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.start

    @property
    def latency(self) -> float:
        return self.end - self.start

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:], strict=False)]

    @property
    def tpot(self) -> float | None:
        if self.output_len < 2:
            return None
        return (self.latency - self.ttft) / (self.output_len - 1)


def _stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": float("nan"), "median": float("nan"), "p99": float("nan")}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, max(0, round(0.99 * len(ordered) + 0.5) - 1))]
    return {
        "mean": statistics.fmean(values),
        "median": statistics.median(values),
        "p99": p99,
    }


def summarize(records: list[RequestRecord], wall_s: float) -> dict[str, Any]:
    ok = [r for r in records if r.error is None and r.chunk_times]
    out_tokens = sum(r.output_len for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    ms = 1000.0
    tpots = [t for t in (r.tpot for r in ok) if t is not None]
    return {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "wall_s": wall_s,
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "request_throughput": len(ok) / wall_s,
        "output_throughput": out_tokens / wall_s,
        "total_token_throughput": (in_tokens + out_tokens) / wall_s,
        "ttft_ms": {k: v * ms for k, v in _stats([r.ttft for r in ok]).items()},
        "tpot_ms": {k: v * ms for k, v in _stats(tpots).items()},
        "itl_ms": {k: v * ms for k, v in _stats([x for r in ok for x in r.itls]).items()},
        "e2el_ms": {k: v * ms for k, v in _stats([r.latency for r in ok]).items()},
    }


def format_table(name: str, s: dict[str, Any]) -> str:
    lines = [
        f"{'=' * 18} Serving Benchmark Result: {name} {'=' * 18}",
        f"{'Successful requests:':<40}{s['completed']:>12}",
        f"{'Failed requests:':<40}{s['failed']:>12}",
        f"{'Benchmark duration (s):':<40}{s['wall_s']:>12.2f}",
        f"{'Total input tokens:':<40}{s['input_tokens']:>12}",
        f"{'Total generated tokens:':<40}{s['output_tokens']:>12}",
        f"{'Request throughput (req/s):':<40}{s['request_throughput']:>12.2f}",
        f"{'Output token throughput (tok/s):':<40}{s['output_throughput']:>12.1f}",
        f"{'Total token throughput (tok/s):':<40}{s['total_token_throughput']:>12.1f}",
    ]
    for key, title in (
        ("ttft_ms", "Time to First Token"),
        ("tpot_ms", "Time per Output Token (excl. 1st token)"),
        ("itl_ms", "Inter-token Latency"),
        ("e2el_ms", "End-to-end Latency"),
    ):
        short = key.split("_")[0].upper()
        lines.append(f"{'-' * 15}{title}{'-' * 15}")
        for stat in ("mean", "median", "p99"):
            label = f"{stat.capitalize() if stat != 'p99' else 'P99'} {short} (ms):"
            lines.append(f"{label:<40}{s[key][stat]:>12.2f}")
    return "\n".join(lines)


def make_workload(
    n: int, input_len: tuple[int, int], output_len: tuple[int, int], vocab: int, seed: int
) -> Workload:
    rng = random.Random(seed)
    return [
        (
            [rng.randrange(10, vocab) for _ in range(rng.randint(*input_len))],
            rng.randint(*output_len),
        )
        for _ in range(n)
    ]


# ---------------------------------------------------------------------------------- HTTP client


def _text_prompt(ids: list[int]) -> str:
    return " ".join(_WORDS[t % len(_WORDS)] for t in ids)


async def _http_one(
    http: httpx.AsyncClient,
    url: str,
    model: str,
    prompt: list[int],
    max_tokens: int,
    as_text: bool,
    sem: asyncio.Semaphore,
) -> RequestRecord:
    body = {
        "model": model,
        "prompt": _text_prompt(prompt) if as_text else prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    rec = RequestRecord(prompt_len=len(prompt))
    async with sem:
        rec.start = time.perf_counter()
        try:
            async with http.stream("POST", url, json=body) as r:
                if r.status_code != 200:
                    rec.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                    return rec
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    now = time.perf_counter()
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        rec.error = str(chunk["error"])
                    elif chunk.get("choices"):
                        rec.chunk_times.append(now)
                    elif chunk.get("usage"):
                        rec.output_len = chunk["usage"]["completion_tokens"]
                        rec.prompt_len = chunk["usage"]["prompt_tokens"]
        except httpx.HTTPError as e:
            rec.error = repr(e)
        rec.end = time.perf_counter()
    return rec


async def run_http(
    base_url: str,
    model: str,
    workload: Workload,
    concurrency: int,
    api_key: str | None = None,
    as_text: bool = False,
) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency)
    url = base_url.rstrip("/") + "/v1/completions"
    async with httpx.AsyncClient(headers=headers, timeout=600, limits=limits) as http:
        warm = asyncio.Semaphore(2)
        await asyncio.gather(
            *(_http_one(http, url, model, p, 4, as_text, warm) for p, _ in workload[:2])
        )
        sem = asyncio.Semaphore(concurrency)
        start = time.perf_counter()
        records = await asyncio.gather(
            *(_http_one(http, url, model, p, o, as_text, sem) for p, o in workload)
        )
        wall = time.perf_counter() - start
    return summarize(list(records), wall)


# ---------------------------------------------------------------------------------- gRPC client


async def run_grpc(address: str, workload: Workload, concurrency: int) -> dict[str, Any]:
    """All requests on one ``Stream``, at most ``concurrency`` in flight."""
    import grpc

    from protos.tandem.engine.v1 import engine_pb2 as pb
    from protos.tandem.engine.v1 import engine_pb2_grpc as pb_grpc

    async def one_pass(reqs: Workload, limit: int) -> tuple[list[RequestRecord], float]:
        outbox: asyncio.Queue[Any] = asyncio.Queue()

        async def requests() -> Any:
            while (item := await outbox.get()) is not None:
                yield item

        channel = grpc.aio.insecure_channel(address)
        call = pb_grpc.EngineStub(channel).Stream(requests())
        sem = asyncio.Semaphore(limit)
        records: dict[str, RequestRecord] = {}

        async def feed() -> None:
            for i, (prompt, out_len) in enumerate(reqs):
                await sem.acquire()
                rid = f"r{i}"
                records[rid] = RequestRecord(prompt_len=len(prompt), start=time.perf_counter())
                sp = pb.SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
                add = pb.AddRequest(request_id=rid, prompt_token_ids=prompt, sampling_params=sp)
                outbox.put_nowait(pb.EngineCoreRequest(add=add))

        start = time.perf_counter()
        feeder = asyncio.create_task(feed())
        finished = 0
        async for msg in call:
            now = time.perf_counter()
            for e in msg.errors:
                raise RuntimeError(f"request {e.request_id} failed: {e.message}")
            for out in msg.outputs:
                rec = records[out.request_id]
                if out.new_token_ids:
                    rec.chunk_times.append(now)
                    rec.output_len += len(out.new_token_ids)
                if out.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                    rec.end = now
                    finished += 1
                    sem.release()
            if finished == len(reqs):
                outbox.put_nowait(None)  # half-close: nothing is in flight, the stream ends
        wall = time.perf_counter() - start
        await feeder
        await channel.close()
        return list(records.values()), wall

    await one_pass([(p, 4) for p, _ in workload[:2]], 2)  # warm-up
    records, wall = await one_pass(workload, concurrency)
    return summarize(records, wall)


# ---------------------------------------------------------------------------------- in-process


def run_in_process(model_dir: Path, workload: Workload, args: argparse.Namespace) -> dict:
    """EngineCore in this process: every request added at once, stepped until idle."""
    from engine_svc import LLM, SamplingParams

    llm = LLM(
        model_dir,
        max_num_seqs=args.concurrency,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory=args.kv_cache_memory,
    )
    core = llm.engine

    def one_pass(reqs: Workload) -> tuple[list[RequestRecord], float]:
        records: dict[str, RequestRecord] = {}
        start = time.perf_counter()
        for i, (prompt, out_len) in enumerate(reqs):
            records[f"r{i}"] = RequestRecord(prompt_len=len(prompt), start=start)
            params = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
            core.add_request(f"r{i}", prompt, params)
        while core.has_unfinished_requests():
            outputs = core.step().outputs
            now = time.perf_counter()
            for out in outputs:
                rec = records[out.request_id]
                rec.chunk_times.append(now)
                rec.output_len += len(out.new_token_ids)
                if out.finished:
                    rec.end = now
        return list(records.values()), time.perf_counter() - start

    one_pass([(p, 4) for p, _ in workload[:2]])  # warm-up
    cpu0 = cpu_seconds()
    records, wall = one_pass(workload)
    cpu = cpu_seconds() - cpu0
    del llm
    return {**summarize(records, wall), "cpu_s": {"engine+client": cpu}}


# ---------------------------------------------------------------------------------- processes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_seconds(pid: int | None = None) -> float:
    """User + system CPU seconds used so far by process ``pid`` (None: this process)."""
    if pid is None:
        t = os.times()
        return t.user + t.system
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def _process(
    argv: list[str],
    ready: str | None,
    url: str | None,
    log: Path,
    env: dict[str, str] | None = None,
) -> Iterator[subprocess.Popen[str]]:
    """Start a subprocess (in ``env``, default this one's); wait for a stdout line starting with
    ``ready`` or for ``url`` to answer 200; always kill it on the way out."""
    with log.open("wb") as err:
        env = dict(env or os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, env=env, text=True)
        try:
            deadline = time.monotonic() + 120
            if ready is not None:
                assert proc.stdout is not None
                for line in proc.stdout:
                    if line.startswith(ready):
                        break
                else:
                    raise RuntimeError(f"{argv[2]} exited; see {log}")
            while url is not None:
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(url, timeout=2).status_code == 200:
                        break
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{argv[2]} never became healthy; see {log}")
                time.sleep(0.2)
            yield proc
        finally:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _engine_argv(model_dir: Path, port: int, args: argparse.Namespace) -> list[str]:
    return [
        sys.executable,
        "-m",
        "engine_svc",
        "--model",
        str(model_dir),
        "--served-model-name",
        "bench",
        "--port",
        str(port),
        "--max-num-seqs",
        str(args.concurrency),
        "--max-num-batched-tokens",
        str(args.max_num_batched_tokens),
        "--kv-cache-memory",
        args.kv_cache_memory,
        "--shutdown-timeout",
        "1",
    ]


def add_word_tokenizer(model_dir: Path, vocab: int) -> None:
    """Give a random-weight checkpoint a tokenizer (one word per token id, ``w0`` .. ``wN``) so
    the gateway can detokenize it: every generated token becomes visible text, as with a real
    model."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(model_dir / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "w2", "bos_token": "w1"}
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))


def _grpc_path(
    model_dir: Path, workload: Workload, args: argparse.Namespace, tmp: Path
) -> dict[str, Any]:
    port = _free_port()
    argv = _engine_argv(model_dir, port, args)
    with _process(argv, "TANDEM_ENGINE_READY", None, tmp / "engine-grpc.log") as engine:
        cpu0 = (cpu_seconds(), cpu_seconds(engine.pid))
        r = asyncio.run(run_grpc(f"127.0.0.1:{port}", workload, args.concurrency))
        r["cpu_s"] = {
            "client": cpu_seconds() - cpu0[0],
            "engine": cpu_seconds(engine.pid) - cpu0[1],
        }
    return r


def _http_path(
    model_dir: Path, workload: Workload, args: argparse.Namespace, tmp: Path
) -> dict[str, Any]:
    port, http_port = _free_port(), _free_port()
    engine_argv = _engine_argv(model_dir, port, args)
    gateway_argv = [sys.executable, "-m", "frontend_svc", "--engine", f"127.0.0.1:{port}"]
    gateway_argv += ["--port", str(http_port), "--log-level", "warning"]
    base = f"http://127.0.0.1:{http_port}"
    with (
        _process(engine_argv, "TANDEM_ENGINE_READY", None, tmp / "engine-http.log") as engine,
        _process(gateway_argv, None, f"{base}/health", tmp / "gateway.log") as gw,
    ):
        cpu0 = (cpu_seconds(), cpu_seconds(engine.pid), cpu_seconds(gw.pid))
        r = asyncio.run(run_http(base, "bench", workload, args.concurrency))
        r["cpu_s"] = {
            "client": cpu_seconds() - cpu0[0],
            "engine": cpu_seconds(engine.pid) - cpu0[1],
            "gateway": cpu_seconds(gw.pid) - cpu0[2],
        }
    return r


def compare(args: argparse.Namespace) -> dict[str, Any]:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import torch
    from throughput import SHAPES, build_model  # type: ignore[import-not-found]

    vocab = int(SHAPES[args.shape]["vocab_size"])
    workload = make_workload(
        args.num_prompts, tuple(args.input_len), tuple(args.output_len), vocab, args.seed
    )
    expected = sum(o for _, o in workload)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(args.shape, Path(tmp) / args.shape, torch.float32)
        add_word_tokenizer(model_dir, vocab)
        runs: dict[str, list[dict[str, Any]]] = {"in-process": [], "grpc": [], "http": []}
        for round_ in range(args.repeat):  # rounds interleave the paths: drift hits all alike
            runs["in-process"].append(run_in_process(model_dir, workload, args))
            runs["grpc"].append(_grpc_path(model_dir, workload, args, Path(tmp)))
            runs["http"].append(_http_path(model_dir, workload, args, Path(tmp)))
            print(
                f"round {round_ + 1}/{args.repeat}: "
                + ", ".join(f"{k} {v[-1]['output_throughput']:.1f}" for k, v in runs.items()),
                flush=True,
            )
        for name, path_runs in runs.items():
            ranked = sorted(path_runs, key=lambda r: r["output_throughput"])
            results[name] = {
                **ranked[len(ranked) // 2],  # the median run
                "all_output_throughputs": [r["output_throughput"] for r in path_runs],
            }
            print(format_table(f"{name} (median of {args.repeat})", results[name]), flush=True)

    for name, path_runs in runs.items():
        for r in path_runs:
            if r["failed"] or r["output_tokens"] != expected:
                raise RuntimeError(f"{name}: {r['failed']} failed, {r['output_tokens']}/{expected}")
    base_tps = results["in-process"]["output_throughput"]
    print()
    print(
        f"shape={args.shape} prompts={args.num_prompts} concurrency={args.concurrency} "
        f"input={list(args.input_len)} output={list(args.output_len)} "
        f"torch_threads={torch.get_num_threads()} cpus={os.cpu_count()}"
    )
    print(
        f"{'path':<14}{'out tok/s':>12}{'vs in-process':>16}{'TTFT p50 ms':>14}{'TPOT p50 ms':>14}"
    )
    for name, r in results.items():
        cpu = r.get("cpu_s", {})
        print(
            f"{name:<14}{r['output_throughput']:>12.1f}{r['output_throughput'] / base_tps:>15.2f}x"
            f"{r['ttft_ms']['median']:>14.1f}{r['tpot_ms']['median']:>14.1f}  "
            + " ".join(f"{k}={v:.1f}s" for k, v in cpu.items())
            + f"  wall={r['wall_s']:.1f}s"
        )
    results["ratios"] = {
        "grpc/in-process": results["grpc"]["output_throughput"] / base_tps,
        "http/in-process": results["http"]["output_throughput"] / base_tps,
    }
    per_round = {
        path: [
            r["output_throughput"] / b["output_throughput"]
            for r, b in zip(runs[path], runs["in-process"], strict=True)
        ]
        for path in ("grpc", "http")
    }
    results["ratios_per_round"] = per_round
    print(
        "per-round ratios vs in-process: "
        + "; ".join(f"{p} " + " ".join(f"{x:.2f}" for x in v) for p, v in per_round.items())
    )
    return results


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default=None, help="model name (default: the server's first)")
    ap.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    ap.add_argument("--num-prompts", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--input-len", type=int, nargs=2, default=(32, 256), metavar=("MIN", "MAX"))
    ap.add_argument("--output-len", type=int, nargs=2, default=(32, 128), metavar=("MIN", "MAX"))
    ap.add_argument(
        "--vocab-size", type=int, default=None, help="send token-id prompts drawn below this"
    )
    ap.add_argument(
        "--text",
        action="store_true",
        help="send text prompts (the default "
        "without --vocab-size; lengths are in words, not tokens)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compare", action="store_true", help="in-process vs gRPC vs HTTP")
    ap.add_argument(
        "--repeat", type=int, default=3, help="--compare: rounds; each path reports its median"
    )
    ap.add_argument("--shape", default="llama-25m", help="--compare: model shape")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--kv-cache-memory", default="512MiB")
    ap.add_argument("--out", type=Path, default=None, help="write results JSON here")
    args = ap.parse_args()
    # SIGTERM unwinds like Ctrl-C, so the engine and gateway subprocesses are stopped too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    if args.compare:
        results = compare(args)
    else:
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        model = args.model
        if model is None:
            r = httpx.get(f"{args.base_url.rstrip('/')}/v1/models", headers=headers, timeout=30)
            r.raise_for_status()
            model = r.json()["data"][0]["id"]
        as_text = args.text or args.vocab_size is None  # token ids need the model's vocab
        vocab = args.vocab_size or 10_000
        workload = make_workload(
            args.num_prompts, tuple(args.input_len), tuple(args.output_len), vocab, args.seed
        )
        results = {
            "http": asyncio.run(
                run_http(args.base_url, model, workload, args.concurrency, args.api_key, as_text)
            )
        }
        print(format_table(f"{args.base_url} concurrency={args.concurrency}", results["http"]))
    if args.out:
        record = {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": f"{platform.node()} {platform.machine()} cpus={os.cpu_count()}",
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "args": {
                k: (list(v) if isinstance(v, tuple) else v)
                for k, v in vars(args).items()
                if k not in ("out", "api_key")
            },
            "results": results,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=2, default=str))


if __name__ == "__main__":
    main()
