"""Does one gateway process keep up with a fast GPU engine?

Three systems on loopback, each driven by the same load client in its own process
(benchmarks/relay_client.py; the stand-in engine and the bare server are in
benchmarks/relay_standins.py):

    bare         a minimal Starlette + uvicorn app streaming the gateway's completion chunks,
                 one token per event, with no engine behind it: the floor of the HTTP side
    gateway      ``python -m frontend_svc`` in front of a stand-in engine that emits, per step and
                 per Stream, one EngineCoreOutputs with a token for every running request of that
                 stream, as fast as the gateway drains them (it stays at most ``--lead-steps``
                 steps ahead of the tokens the client has received: gRPC flow control alone lets
                 it run megabytes ahead and split its batches into one-request messages)
    gateway -wN  the same with ``--workers N`` (only when the gateway has that flag)
    gateway-winW the gateway points again with ``--engine-window W`` (``--compare-window W``;
                 ``--engine-window`` sets the others'). With a window the stand-in merges
                 the steps that come while it is full, as the real engine does, so a message
                 (``out/msg``) and a chunk (``tok/chunk``) can carry several steps' tokens;
                 tok/s counts tokens either way.

For each system and concurrency C (``--concurrency``, default 1 64 256) the client keeps C
streaming completions of ``--max-tokens`` tokens in flight (a closed loop, each connection's
first request shortened so requests end spread out), waits ``--warmup`` seconds, then counts for
``--duration`` seconds: tokens received (every token decodes to one character, so tokens are
counted from the chunk text even where several tokens share a chunk), the gaps between
consecutive chunks of a response (ITL, as ``vllm bench serve`` defines it), the time from
sending a request to its first token (TTFT) and the CPU seconds
(/proc/PID/stat utime + stime, the process and its children) of the server and, for the
gateway, of the stand-in engine, reported per 1k tokens.

Then the latency the gateway adds, below capacity: the stand-in engine is paced (``--step-ms``;
default: C streams at ``--paced-fraction`` of the lower of the bare and gateway capacities
measured at that C, in chunks per second: paced, every chunk carries one token, while unpaced
the gateway's chunks carry several when its engine window fills) and records when it sent each
step (a step held while the gateway's window was full: when it was taken, so the hold counts);
the client records when each chunk arrived.
The gateway's chunk id is ``cmpl-<hex>`` and the engine's request id ``<that id>-0``, so every
token's (client receive time - engine send time) is known: both are CLOCK_MONOTONIC.
That figure also holds what is not the gateway's: the HTTP writes of a step's events, one after
the other, and the client reading them (on a 2-core machine, a few ms for 256 streams). So the
bare app then runs on the same steps (``relay_standins.py bare --record``: every step gives each
stream its token at once and keeps the step's time), measured the same way, and the target is
on the gateway's percentiles over the bare app's.

And the floor of one stream (benchmarks/relay_grpc_floor.py): a grpc.aio client that only reads
the stand-in's one-token messages, as fast as they come. At C=1 the stand-in sends one message
per token, so that rate bounds any gateway on grpcio there, however little it does per token.

    python benchmarks/gateway_relay.py --out benchmarks/results/gateway_relay_cpu.json
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import math
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))  # tests.frontend.tiny_tokenizer
from provenance import provenance  # type: ignore[import-not-found]  # noqa: E402
from relay_client import Progress  # type: ignore[import-not-found]  # noqa: E402
from relay_standins import READY  # type: ignore[import-not-found]  # noqa: E402
from serve import _free_port, _process  # type: ignore[import-not-found]  # noqa: E402

from protos.grpc_runtime import prefer_polling_io  # noqa: E402

STANDINS = [sys.executable, str(HERE / "relay_standins.py")]
CLIENT_ARGV = [sys.executable, str(HERE / "relay_client.py")]
FLOOR_ARGV = [sys.executable, str(HERE / "relay_grpc_floor.py")]
CLIENT = (
    "benchmarks/relay_client.py: one process, asyncio streams, hand-written HTTP/1.1 "
    "(keep-alive, chunked), SSE split on blank lines, orjson per event"
)
TOK_S_RATIO_MIN = {1: 0.5, 64: 0.7, 256: 0.7}  # gateway / bare tok/s, by concurrency
CPU_PER_TOKEN_RATIO_MAX = 2.0  # gateway / bare server CPU seconds per token
PACED_P99_ADDED_MS_MAX = 5.0  # at 256 streams, well below capacity
WORKERS_SPEEDUP_MIN = 1.6  # --workers 2 / one worker tok/s, on a machine with the cores


@dataclass(frozen=True)
class Servers:
    """A running system: the URL the client drives and the processes whose CPU it reads."""

    url: str
    watch: dict[str, int]  # "server" / "engine" -> pid (its process tree is counted)
    progress: Path | None = None  # the board the client shares with the stand-in engine


# ---------------------------------------------------------------------------------- systems


def make_tokenizer(tmp: Path) -> tuple[Path, int]:
    """The tests' tiny byte-level BPE tokenizer, and a token id that decodes to one character."""
    from tokenizers import Tokenizer

    from tests.frontend.tiny_tokenizer import build_tiny_tokenizer

    directory = build_tiny_tokenizer(tmp / "tokenizer")
    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    token_id = tok.token_to_id("a")
    if token_id is None or tok.decode([token_id] * 5) != "aaaaa":
        raise RuntimeError("the tiny tokenizer has no single-character token 'a'")
    return directory, token_id


def engine_env() -> dict[str, str]:
    """The environment of the stand-in engine and the floor client: grpcio's I/O as the engine
    and the gateway choose it (``protos/grpc_runtime.py``). The gateway chooses its own."""
    env = dict(os.environ)
    prefer_polling_io(env)
    return env


def gateway_has_workers_flag() -> bool:
    argv = [sys.executable, "-m", "frontend_svc", "--help"]
    return "--workers" in subprocess.run(argv, capture_output=True, text=True, timeout=60).stdout


@contextlib.contextmanager
def bare_server(tmp: Path, step_ms: float = 0.0, record: Path | None = None) -> Iterator[Servers]:
    port = _free_port()
    argv = [*STANDINS, "bare", "--port", str(port), "--step-ms", str(step_ms)]
    if record is not None:  # engine-like steps, their times written to ``record``
        argv += ["--record", str(record)]
    url = f"http://127.0.0.1:{port}"
    with _process(argv, None, f"{url}/health", tmp / "bare.log") as proc:
        yield Servers(url, {"server": proc.pid})


@contextlib.contextmanager
def standin_engine(
    tmp: Path,
    tokenizer: tuple[Path, int],
    step_ms: float = 0.0,
    progress: Path | None = None,
    lead_steps: int = 4,
    record: Path | None = None,
) -> Iterator[tuple[str, int]]:
    """The stand-in engine (``relay_standins.py engine``); yields its address and pid."""
    port = _free_port()
    argv = [*STANDINS, "engine", "--port", str(port), "--step-ms", str(step_ms)]
    argv += ["--tokenizer-dir", str(tokenizer[0]), "--token-id", str(tokenizer[1])]
    if progress is not None:
        argv += ["--progress", str(progress), "--lead-steps", str(lead_steps)]
    if record is not None:
        argv += ["--record", str(record)]
    with _process(argv, READY, None, tmp / "engine.log", engine_env()) as engine:
        yield f"127.0.0.1:{port}", engine.pid


@contextlib.contextmanager
def gateway_servers(
    tmp: Path,
    tokenizer: tuple[Path, int],
    step_ms: float = 0.0,
    record: Path | None = None,
    workers: int = 1,
    lead_steps: int = 4,
    engine_window: int | None = None,
) -> Iterator[Servers]:
    progress = Progress.create(tmp / "progress.bin")
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    with standin_engine(tmp, tokenizer, step_ms, progress, lead_steps, record) as (address, pid):
        gateway_argv = [sys.executable, "-m", "frontend_svc", "--engine", address]
        gateway_argv += ["--port", str(port), "--log-level", "warning"]
        if workers > 1:
            gateway_argv += ["--workers", str(workers)]
        if engine_window is not None:  # else the gateway's default (older trees lack the flag)
            gateway_argv += ["--engine-window", str(engine_window)]
        with _process(gateway_argv, None, f"{url}/health", tmp / "gateway.log") as gateway:
            # every worker answers /health on its own connection: ask until many in a row say 200
            ok, deadline = 0, time.monotonic() + 60
            while ok < 10 * workers:
                try:
                    ok = ok + 1 if httpx.get(f"{url}/health", timeout=5).status_code == 200 else 0
                except httpx.HTTPError:
                    ok = 0
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the gateway's workers never all connected; see {tmp}")
            yield Servers(url, {"server": gateway.pid, "engine": pid}, progress)


def grpc_read_floor(tmp: Path, tokenizer: tuple[Path, int], duration: float) -> dict[str, Any]:
    """What a grpc.aio client that only reads the stand-in's one-token messages achieves
    (benchmarks/relay_grpc_floor.py): the most a gateway on grpcio relays at one stream."""
    with standin_engine(tmp, tokenizer) as (address, _):
        argv = [*FLOOR_ARGV, "--engine", address, "--duration", str(duration)]
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=duration + 120, env=engine_env()
        )
    if done.returncode != 0:
        raise RuntimeError(f"the gRPC floor client failed: {done.stderr[-2000:]}")
    floor: dict[str, Any] = orjson.loads(done.stdout.strip().splitlines()[-1])
    print(
        f"gRPC read floor: {floor['msg_s']:.0f} one-token messages/s, "
        f"{floor['cpu_us_per_msg']:.1f} us of CPU each",
        flush=True,
    )
    return floor


# ---------------------------------------------------------------------------------- one point


def run_point(
    system: str,
    servers: Servers,
    concurrency: int,
    args: argparse.Namespace,
    tmp: Path,
    record: bool = False,
) -> dict[str, Any]:
    """One client run against ``servers``; returns the point's figures (and the raw result)."""
    out = tmp / f"client-{system}-{concurrency}.json"
    argv = [*CLIENT_ARGV, "--url", servers.url, "--concurrency", str(concurrency)]
    argv += ["--warmup", str(args.warmup), "--duration", str(args.duration)]
    argv += ["--max-tokens", str(args.max_tokens), "--out", str(out)]
    argv += [f"--watch={name}={pid}" for name, pid in servers.watch.items()]
    if record:
        argv.append("--record")
    if servers.progress is not None:
        argv += ["--progress", str(servers.progress)]
    log = tmp / f"client-{system}-{concurrency}.log"
    with log.open("wb") as err:
        proc = subprocess.Popen(argv, stderr=err)
        try:
            proc.wait(timeout=args.warmup + args.duration + 120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if proc.returncode != 0:
        raise RuntimeError(f"client failed ({proc.returncode}): {log.read_text()[-2000:]}")
    raw = orjson.loads(out.read_bytes())
    if raw["tokens"] == 0:
        raise RuntimeError(f"{system} C={concurrency}: no tokens; errors {raw['first_errors']}")
    time.sleep(args.settle)  # the streams cut at the window's end are aborted and drained

    tokens, window = raw["tokens"], raw["window_s"]
    per_1k = {name: 1000.0 * s / tokens for name, s in raw["cpu_s"].items()}
    point = {
        "system": system,
        "concurrency": concurrency,
        "tok_s": tokens / window,
        "tokens": tokens,
        "window_s": window,
        "completed": raw["completed"],
        "errors": raw["errors"],
        "first_errors": raw["first_errors"],
        "tokens_per_chunk": tokens / max(raw["chunks"], 1),
        "engine_outputs_per_message": raw["engine_outputs"] / max(raw["engine_messages"], 1),
        "itl_ms": {k: 1000.0 * v for k, v in raw["gap_s"].items()},
        "ttft_ms": {k: 1000.0 * v for k, v in raw["ttft_s"].items()},
        "cpu_s": raw["cpu_s"],
        "cpu_s_per_1k_tok": {**per_1k, "client": 1000.0 * raw["client_cpu_s"] / tokens},
    }
    print(_row(point), flush=True)
    return {**point, "raw": raw} if record else point


# ---------------------------------------------------------------------------------- added latency


def added_latency(raw: dict[str, Any], engine_record: dict[str, Any]) -> dict[str, Any]:
    """Per token: client receive time - engine step time (when sent, or when held: the hold
    counts), for tokens received in the window."""
    steps = engine_record["step_times"]
    chunks_by_id = raw["records"]
    t0, t1 = raw["t0"], raw["t1"]
    lat: list[float] = []
    joined = unmatched = 0
    for request_id, (stream, first) in engine_record["first_steps"].items():
        chunks = chunks_by_id.get(request_id.rsplit("-", 1)[0])
        if chunks is None:
            unmatched += 1  # e.g. added in the last step, cut before its first chunk
            continue
        joined += 1
        k = first
        for t, n in chunks:
            if t0 <= t < t1:
                sent = steps[stream][k : k + n]
                # Fewer steps than tokens, or a token received before its step: misjoined.
                if len(sent) < n or t < sent[-1]:
                    raise RuntimeError(f"a token of {request_id} was received before its step")
                lat += [t - x for x in sent]
            k += n
    if not lat:
        raise RuntimeError(
            f"joined no tokens ({joined} requests matched, {unmatched} not): "
            "has the gateway's chunk id / engine request id scheme changed?"
        )
    lat.sort()
    pick = lambda q: 1000.0 * lat[min(len(lat) - 1, int(q * len(lat)))]  # noqa: E731
    return {
        "tokens": len(lat),
        "requests_joined": joined,
        "requests_unmatched": unmatched,
        "p50_ms": pick(0.50),
        "p90_ms": pick(0.90),
        "p99_ms": pick(0.99),
        "max_ms": 1000.0 * lat[-1],
        "min_ms": 1000.0 * lat[0],
    }


def _signal_and_wait(pid: int, path: Path) -> dict[str, Any]:
    os.kill(pid, signal.SIGUSR1)
    deadline = time.monotonic() + 30
    while not path.exists():
        if time.monotonic() > deadline:
            raise RuntimeError("the stand-in engine wrote no record")
        time.sleep(0.05)
    return dict(orjson.loads(path.read_bytes()))


# ---------------------------------------------------------------------------------- the run


def run(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {"points": []}
    points = results["points"]
    with tempfile.TemporaryDirectory(prefix="gateway_relay_") as tmp_name:
        tmp = Path(tmp_name)
        tokenizer = make_tokenizer(tmp)
        print(_header(), flush=True)
        with bare_server(tmp) as s:
            for c in args.concurrency:
                points.append(run_point("bare", s, c, args, tmp))
        with gateway_servers(
            tmp, tokenizer, lead_steps=args.lead_steps, engine_window=args.engine_window
        ) as s:
            for c in args.concurrency:
                points.append(run_point("gateway", s, c, args, tmp))
        if args.compare_window is not None:  # the same gateway with another engine window
            with gateway_servers(
                tmp, tokenizer, lead_steps=args.lead_steps, engine_window=args.compare_window
            ) as s:
                for c in args.concurrency:
                    points.append(run_point(f"gateway-win{args.compare_window}", s, c, args, tmp))

        floor = grpc_read_floor(tmp, tokenizer, args.duration)
        by = {(p["system"], p["concurrency"]): p for p in points}
        if ("bare", 1) in by:
            floor["vs_bare_c1_tok_s"] = floor["msg_s"] / by[("bare", 1)]["tok_s"]
        results["grpc_read_floor"] = floor

        c = args.paced_concurrency or max(args.concurrency)
        bare_cap = by.get(("bare", c), {}).get("tok_s", math.nan)
        capacity = chunk_capacity(by, c)
        if args.step_ms is None and math.isnan(capacity):
            raise SystemExit("--paced-concurrency not among --concurrency: give --step-ms")
        step_ms = args.step_ms or 1000.0 * c / (args.paced_fraction * capacity)
        offered = 1000.0 * c / step_ms
        # Each repeat: the gateway on the paced stand-in, then the bare app on the same steps
        # (the floor: every stream gets its token at once each step), measured by the same
        # client the same way. The tail moves by milliseconds between runs on a small shared
        # machine, so the figure judged is the median over the repeats; each is kept.
        repeats = []
        for i in range(max(1, args.paced_repeats)):
            record = tmp / f"engine-record-{i}.json"  # (a new file: its appearance is the signal)
            with gateway_servers(
                tmp, tokenizer, step_ms, record, engine_window=args.engine_window
            ) as s:
                p = run_point("gateway-paced", s, c, args, tmp, record=True)
                engine_record = _signal_and_wait(s.watch["engine"], record)
            raw = p.pop("raw")  # (every chunk's time: joined here, not kept)
            paced = {
                **p,
                "step_ms": step_ms,
                "offered_tok_s": offered,
                "offered_vs_bare_capacity": offered / bare_cap,
                "offered_vs_chunk_capacity": offered / capacity,
                "added_latency": added_latency(raw, engine_record),
            }
            bare_record = tmp / f"bare-record-{i}.json"
            with bare_server(tmp, step_ms=step_ms, record=bare_record) as s:
                p = run_point("bare-paced", s, c, args, tmp, record=True)
                record_of_bare = _signal_and_wait(s.watch["server"], bare_record)
            raw = p.pop("raw")
            paced_bare = {
                **p,
                "step_ms": step_ms,
                "added_latency": added_latency(raw, record_of_bare),
            }
            gw, floor = paced["added_latency"], paced_bare["added_latency"]
            paced["over_bare_ms"] = {
                q: gw[f"{q}_ms"] - floor[f"{q}_ms"] for q in ("p50", "p90", "p99")
            }
            repeats.append((paced, paced_bare))
        # The repeat whose p99 over bare is the median stands for the run.
        repeats.sort(key=lambda r: r[0]["over_bare_ms"]["p99"])
        results["paced"], results["paced_bare"] = repeats[len(repeats) // 2]
        results["paced"]["repeats_over_bare_ms"] = [r[0]["over_bare_ms"] for r in repeats]

        results["workers_flag"] = gateway_has_workers_flag()
        if results["workers_flag"] and args.workers > 1:
            with gateway_servers(
                tmp,
                tokenizer,
                workers=args.workers,
                lead_steps=args.lead_steps,
                engine_window=args.engine_window,
            ) as s:
                for c in args.workers_concurrency or [max(args.concurrency)]:
                    points.append(run_point(f"gateway-w{args.workers}", s, c, args, tmp))
    results["ratios"] = ratios(points, args.workers)
    results["verdicts"] = check_targets(results)
    return results


def chunk_capacity(by: dict[tuple[str, int], dict[str, Any]], concurrency: int) -> float:
    """The paced run's reference capacity at ``concurrency``: the lower of the bare app's and
    the gateway's unpaced rates in chunks (events) per second, NaN without a bare point.

    A paced step gives every stream one token, so paced, each chunk carries one token; the rate
    that matters is chunks per second. Unpaced, the gateway's chunks carry several tokens when
    its engine window fills (the engine merges steps), so its tokens per second overstate what it
    relays one token per chunk: a pace derived from them lands near saturation, not below it."""
    bare = by.get(("bare", concurrency))
    if bare is None:
        return math.nan
    rates = [bare["tok_s"] / max(bare["tokens_per_chunk"], 1.0)]
    gateway = by.get(("gateway", concurrency))
    if gateway is not None:
        rates.append(gateway["tok_s"] / max(gateway["tokens_per_chunk"], 1.0))
    return min(rates)


def ratios(points: list[dict[str, Any]], workers: int) -> dict[str, Any]:
    by = {(p["system"], p["concurrency"]): p for p in points}
    out: dict[str, Any] = {}
    for (system, c), g in by.items():
        b = by.get(("bare", c))
        if system != "gateway" or b is None:
            continue
        cpu = g["cpu_s_per_1k_tok"]
        out[str(c)] = {
            "tok_s": g["tok_s"] / b["tok_s"],
            "cpu_per_token": cpu["server"] / b["cpu_s_per_1k_tok"]["server"],
            "cpu_per_token_with_engine": (cpu["server"] + cpu["engine"])
            / b["cpu_s_per_1k_tok"]["server"],
        }
        w = by.get((f"gateway-w{workers}", c))
        if w is not None:
            out[str(c)][f"workers{workers}_vs_1"] = w["tok_s"] / g["tok_s"]
        for (other, oc), o in by.items():
            if oc == c and other.startswith("gateway-win"):
                out[str(c)][f"{other.removeprefix('gateway-')}_tok_s"] = o["tok_s"] / b["tok_s"]
    return out


def check_targets(results: dict[str, Any]) -> dict[str, Any]:
    """Each target's measured value and whether it was met."""
    out: dict[str, Any] = {}

    def at_least(name: str, value: float, floor: float) -> None:
        out[name] = {"value": value, "min": floor, "met": value >= floor}

    def at_most(name: str, value: float, cap: float) -> None:
        out[name] = {"value": value, "max": cap, "met": value <= cap}

    for c, r in results["ratios"].items():
        if int(c) in TOK_S_RATIO_MIN:
            at_least(f"tok_s_ratio_c{c}", r["tok_s"], TOK_S_RATIO_MIN[int(c)])
        at_most(f"cpu_per_token_ratio_c{c}", r["cpu_per_token"], CPU_PER_TOKEN_RATIO_MAX)
        for key, value in r.items():
            if key.startswith("workers"):
                at_least(f"{key}_c{c}", value, WORKERS_SPEEDUP_MIN)
    paced = results["paced"]
    name = f"paced_p99_added_over_bare_ms_c{paced['concurrency']}"
    at_most(name, paced["over_bare_ms"]["p99"], PACED_P99_ADDED_MS_MAX)
    return out


# ---------------------------------------------------------------------------------- report


def _header() -> str:
    return (
        f"{'system':<15}{'C':>5}{'tok/s':>9}{'CPU s/1k tok: server':>23}{'engine':>8}"
        f"{'client':>8}{'ITL p50 ms':>12}{'p99':>7}{'TTFT p50 ms':>13}{'tok/chunk':>10}"
        f"{'out/msg':>8}{'errors':>7}"
    )


def _row(p: dict[str, Any]) -> str:
    cpu = p["cpu_s_per_1k_tok"]
    engine = f"{cpu['engine']:.3f}" if "engine" in cpu else "-"
    out_per_msg = f"{p['engine_outputs_per_message']:.1f}" if "engine" in cpu else "-"
    return (
        f"{p['system']:<15}{p['concurrency']:>5}{p['tok_s']:>9.0f}{cpu['server']:>23.3f}"
        f"{engine:>8}{cpu['client']:>8.3f}{p['itl_ms']['p50']:>12.2f}{p['itl_ms']['p99']:>7.2f}"
        f"{p['ttft_ms']['p50']:>13.1f}{p['tokens_per_chunk']:>10.2f}{out_per_msg:>8}"
        f"{p['errors']:>7}"
    )


def report(results: dict[str, Any]) -> str:
    lines = ["", _header(), *(_row(p) for p in results["points"])]
    lines += [_row(results["paced"]), _row(results["paced_bare"])]
    for c, r in results["ratios"].items():
        extra = "".join(
            f", {k.replace('_', ' ')} {v:.2f}x"
            for k, v in r.items()
            if k.startswith(("workers", "win"))
        )
        lines.append(
            f"gateway/bare at C={c}: tok/s {r['tok_s']:.2f}x, CPU per token "
            f"{r['cpu_per_token']:.2f}x ({r['cpu_per_token_with_engine']:.2f}x with the stand-in "
            f"engine){extra}"
        )
    paced, lat = results["paced"], results["paced"]["added_latency"]
    lines.append(
        f"paced: {paced['concurrency']} streams, a step every {paced['step_ms']:.1f} ms "
        f"(offered {paced['offered_tok_s']:.0f} tok/s = {paced['offered_vs_bare_capacity']:.2f}x "
        f"bare capacity, {paced['offered_vs_chunk_capacity']:.2f}x the lower chunk "
        f"capacity), received {paced['tok_s']:.0f} tok/s; added latency per token "
        f"p50 {lat['p50_ms']:.2f} ms, p90 {lat['p90_ms']:.2f} ms, p99 {lat['p99_ms']:.2f} ms, "
        f"max {lat['max_ms']:.2f} ms ({lat['tokens']} tokens)"
    )
    floor, over = results["paced_bare"]["added_latency"], paced["over_bare_ms"]
    lines.append(
        f"paced bare (the floor: the same steps, HTTP and client, no gateway): p50 "
        f"{floor['p50_ms']:.2f} ms, p90 {floor['p90_ms']:.2f} ms, p99 {floor['p99_ms']:.2f} ms, "
        f"max {floor['max_ms']:.2f} ms; the gateway over it: p50 {over['p50']:.2f} ms, "
        f"p90 {over['p90']:.2f} ms, p99 {over['p99']:.2f} ms"
    )
    each = ", ".join(f"{r['p99']:.2f}" for r in paced.get("repeats_over_bare_ms", []))
    lines.append(f"paced p99 over bare in each repeat (the median one above): {each} ms")
    floor = results["grpc_read_floor"]
    versus = floor.get("vs_bare_c1_tok_s")
    lines.append(
        f"gRPC read floor (a grpc.aio client that only reads one-token messages): "
        f"{floor['msg_s']:.0f} msg/s, {floor['cpu_us_per_msg']:.1f} us CPU each"
        + (f" = {versus:.2f}x bare's C=1 tok/s" if versus is not None else "")
    )
    if not results["workers_flag"]:
        lines.append("gateway has no --workers flag: no multi-worker run")
    lines.append(
        "targets: "
        + "; ".join(
            f"{name} {t['value']:.2f} {'met' if t['met'] else 'MISSED'}"
            for name, t in results["verdicts"].items()
        )
    )
    return "\n".join(lines)


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for dist in (
        "grpcio",
        "protobuf",
        "starlette",
        "uvicorn",
        "h11",
        "uvloop",
        "httptools",
        "orjson",
        "tokenizers",
    ):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            out[dist] = importlib.metadata.version(dist)
    return out


def gateway_source() -> dict[str, str | None]:
    """Where ``python -m frontend_svc`` is imported from here, and that tree's git commit."""
    argv = [sys.executable, "-c", "import frontend_svc; print(frontend_svc.__file__)"]
    path = Path(subprocess.run(argv, capture_output=True, text=True, timeout=60).stdout.strip())
    git = ["git", "-C", str(path.parent), "rev-parse", "HEAD"]
    commit = subprocess.run(git, capture_output=True, text=True, timeout=60).stdout.strip()
    return {"frontend_svc": str(path.parent), "git_head": commit or None}


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--duration", type=float, default=10.0, help="seconds counted per point")
    ap.add_argument("--warmup", type=float, default=3.0, help="seconds before counting starts")
    ap.add_argument("--settle", type=float, default=1.0, help="pause between points")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--paced-concurrency", type=int, default=None, help="default: the largest C")
    ap.add_argument(
        "--paced-fraction",
        type=float,
        default=0.5,
        help="paced load as a fraction of min(bare, gateway) chunks/s at that C",
    )
    ap.add_argument("--step-ms", type=float, default=None, help="paced step (overrides fraction)")
    ap.add_argument(
        "--paced-repeats",
        type=int,
        default=3,
        help="paced gateway/bare pairs; the one with the median p99 over bare is reported",
    )
    ap.add_argument(
        "--lead-steps",
        type=int,
        default=4,
        help="unpaced stand-in engine: at most this many steps ahead of what the client has "
        "received (0: gRPC flow control only, which lets it run megabytes ahead)",
    )
    ap.add_argument(
        "--engine-window",
        type=int,
        default=None,
        help="the gateway's --engine-window (default: its own default)",
    )
    ap.add_argument(
        "--compare-window",
        type=int,
        default=None,
        help="also run the gateway points with this --engine-window (e.g. 0: no window)",
    )
    ap.add_argument("--workers", type=int, default=2, help="gateway --workers run (1: none)")
    ap.add_argument("--workers-concurrency", type=int, nargs="+", default=None)
    ap.add_argument("--note", default="", help="stored in the JSON (e.g. the gateway's commit)")
    ap.add_argument("--out", type=Path, default=None, help="write results JSON here")
    args = ap.parse_args()
    # SIGTERM unwinds like Ctrl-C, so every subprocess is stopped too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    results = run(args)
    print(report(results))
    if args.out:
        record = {
            **provenance(),
            "versions": versions(),
            "gateway_source": gateway_source(),
            "client": CLIENT,
            "args": {k: v for k, v in vars(args).items() if k != "out"},
            "targets": {
                "tok_s_ratio_min": TOK_S_RATIO_MIN,
                "cpu_per_token_ratio_max": CPU_PER_TOKEN_RATIO_MAX,
                "paced_p99_added_ms_max": PACED_P99_ADDED_MS_MAX,
                "workers_speedup_min": WORKERS_SPEEDUP_MIN,
            },
            "results": results,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=2, default=str))


if __name__ == "__main__":
    main()
