"""The load client of benchmarks/gateway_relay.py::

    python benchmarks/relay_client.py --url http://127.0.0.1:P --concurrency C --out R.json

``--concurrency`` keep-alive connections, each running streaming completions back to back (the
first request of each connection shortened by a different amount, so requests end spread out, not
in waves). Inside a window of ``--duration`` seconds after ``--warmup`` it counts tokens (each
decodes to one character, so they are counted from the chunk text even where a chunk carries
several) and the gaps between consecutive chunks of a response, and reads the CPU time of the
``--watch`` processes (and their children) at the window's edges. ``--record`` keeps every
chunk's receive time (CLOCK_MONOTONIC) by chunk id, to join with the stand-in engine's send times.
``--progress`` names the board shared with the stand-in engine (``Progress``): the client writes
how many tokens it has received, so the engine can stay a few steps ahead and no more.

It speaks HTTP/1.1 over asyncio streams itself (chunked decoding, SSE split on blank lines,
orjson per event): on a small machine the client competes with the server for the cores, and this
costs ~11 us of CPU per event where an httpx client (aiter_lines + json.loads) took 29 us.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import mmap
import os
import re
import struct
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson

# ------------------------------------------------------------------------------ load client


class Progress:
    """Counters shared through a small file mapped by the client and the stand-in engine.

    The client writes how many tokens it has received (and a new generation at its start); the
    engine reads that to stay at most a few steps ahead of what the client has received, and
    writes how many messages and outputs it has sent.

        slot 0: tokens received by the client    slot 1: the client's generation (its pid)
        slot 2: messages sent by the engine      slot 3: outputs (tokens) sent by the engine
    """

    SIZE = 32

    def __init__(self, path: Path) -> None:
        with path.open("r+b") as f:
            self._map = mmap.mmap(f.fileno(), self.SIZE)

    @staticmethod
    def create(path: Path) -> Path:
        path.write_bytes(bytes(Progress.SIZE))
        return path

    def get(self, slot: int) -> int:
        return int(struct.unpack_from("<q", self._map, 8 * slot)[0])

    def set(self, slot: int, value: int) -> None:
        struct.pack_into("<q", self._map, 8 * slot, value)


RECEIVED, GENERATION, MESSAGES, OUTPUTS = range(4)


class _Tally:
    """What the client counts. Chunks count only when received inside the window [t0, t1)."""

    def __init__(self, record: bool, progress: Progress | None) -> None:
        self.progress = progress
        self.received = 0  # every token, inside the window or not
        self.t0 = math.inf
        self.t1 = math.inf
        self.tokens = 0
        self.chunks = 0
        self.gaps: list[float] = []  # between consecutive chunks of one response, both inside
        self.ttfts: list[float] = []  # request sent -> first chunk with tokens, that one inside
        self.completed = 0
        self.errors: list[str] = []
        # chunk id -> [(receive time, tokens in the chunk), ...], every chunk (--record)
        self.records: dict[str, list[tuple[float, int]]] | None = {} if record else None

    def chunk(self, now: float, n: int, last: float | None) -> None:
        self.received += n
        if self.progress is not None:
            self.progress.set(RECEIVED, self.received)
        if self.t0 <= now < self.t1:
            self.tokens += n
            self.chunks += 1
            if last is not None and last >= self.t0:
                self.gaps.append(now - last)


_CONTENT_LENGTH = re.compile(rb"content-length:\s*(\d+)")


async def _read_chunked(reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
    """The chunks of a chunked HTTP/1.1 body, until the last (empty) one."""
    while True:
        size = int(await reader.readuntil(b"\r\n"), 16)
        data = await reader.readexactly(size + 2)
        if size == 0:
            return
        yield data[:size]


async def _stream_one(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes, tally: _Tally
) -> bool:
    """One streaming completion on an open connection. Returns whether to keep the connection."""
    start = time.monotonic()
    writer.write(request)
    head = (await reader.readuntil(b"\r\n\r\n")).lower()
    status = int(head[9:12])
    keep = b"connection: close" not in head
    if b"transfer-encoding: chunked" not in head:
        m = _CONTENT_LENGTH.search(head)
        body = await reader.readexactly(int(m[1]) if m else 0)
        tally.errors.append(f"HTTP {status}: {body[:200]!r}")
        await asyncio.sleep(0.05)  # e.g. 503 while a worker connects: no busy retry loop
        return keep
    if status != 200:
        body = b"".join([c async for c in _read_chunked(reader)])
        tally.errors.append(f"HTTP {status}: {body[:200]!r}")
        await asyncio.sleep(0.05)
        return keep
    buf = b""
    now = time.monotonic()
    last: float | None = None
    times: list[tuple[float, int]] | None = None
    done = False
    async for data in _read_chunked(reader):
        now = time.monotonic()
        buf += data
        n = 0
        while (end := buf.find(b"\n\n")) >= 0:
            event, buf = buf[:end], buf[end + 2 :]
            if event == b"data: [DONE]":
                done = True
                continue
            chunk = orjson.loads(event[6:])
            if "error" in chunk:
                tally.errors.append(str(chunk["error"])[:200])
                continue
            for choice in chunk["choices"]:
                n += len(choice["text"])
            if times is None and tally.records is not None:
                times = tally.records.setdefault(chunk["id"], [])
        if n:
            if last is None and tally.t0 <= now < tally.t1:
                tally.ttfts.append(now - start)
            tally.chunk(now, n, last)
            last = now
            if times is not None:
                times.append((now, n))
    if done and tally.t0 <= now < tally.t1:
        tally.completed += 1
    return keep


async def _worker(
    host: str, port: int, first: bytes, request: bytes, tally: _Tally, stagger_s: float
) -> None:
    """Streaming completions back to back on one keep-alive connection (reopened if lost)."""
    await asyncio.sleep(stagger_s)
    writer: asyncio.StreamWriter | None = None
    try:
        while True:
            if writer is None:
                reader, writer = await asyncio.open_connection(host, port)
            try:
                keep = await _stream_one(reader, writer, first, tally)
            except (ConnectionError, asyncio.IncompleteReadError) as e:
                tally.errors.append(repr(e))
                keep = False
                await asyncio.sleep(0.05)
            first = request
            if not keep:
                writer.close()
                writer = None
    finally:
        if writer is not None:
            writer.close()


def tree_cpu_seconds(root: int) -> float:
    """User + system CPU seconds of process ``root`` and every live descendant (plus the
    children it has already reaped)."""
    parent: dict[int, int] = {}
    cpu: dict[int, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            fields = Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        pid = int(name)
        parent[pid] = int(fields[1])
        own = int(fields[11]) + int(fields[12])
        reaped = int(fields[13]) + int(fields[14]) if pid == root else 0
        cpu[pid] = (own + reaped) / tick
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        total += cpu.get(pid, 0.0)
        todo += [child for child, ppid in parent.items() if ppid == pid]
    return total


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": math.nan, "p99": math.nan}
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"p50": pick(0.50), "p99": pick(0.99)}


async def run_client(args: argparse.Namespace) -> dict[str, Any]:
    m = re.fullmatch(r"http://([^:/]+):(\d+)/?", args.url)
    if m is None:
        raise SystemExit(f"--url must be http://HOST:PORT, got {args.url}")
    host, port = m[1], int(m[2])
    watch = {name: int(pid) for name, pid in (w.split("=", 1) for w in args.watch)}

    def request(max_tokens: int) -> bytes:
        body = orjson.dumps(
            {
                "model": args.model,
                "prompt": args.prompt,
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "ignore_eos": True,
                "stream": True,
            }
        )
        head = (
            f"POST /v1/completions HTTP/1.1\r\nhost: {host}:{port}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
        )
        return head.encode() + body

    progress = None
    if args.progress is not None:
        progress = Progress(args.progress)
        progress.set(RECEIVED, 0)
        progress.set(GENERATION, os.getpid())
    tally = _Tally(args.record, progress)

    def engine_counts() -> tuple[int, int]:
        return (progress.get(MESSAGES), progress.get(OUTPUTS)) if progress else (0, 0)

    c = args.concurrency
    # Each connection's first request is shorter by a different amount, so the requests of a
    # closed loop end at spread-out times instead of in waves.
    workers = [
        asyncio.create_task(
            _worker(
                host,
                port,
                request(1 + i * args.max_tokens // c),
                request(args.max_tokens),
                tally,
                stagger_s=i * min(args.warmup / 4, 0.5) / c,
            )
        )
        for i in range(c)
    ]
    await asyncio.sleep(args.warmup)
    for w in workers:
        if w.done():
            w.result()  # a worker that died before the window: raise its error
    cpu0 = {name: tree_cpu_seconds(pid) for name, pid in watch.items()}
    own0, sent0 = time.process_time(), engine_counts()
    tally.t0 = time.monotonic()
    await asyncio.sleep(args.duration)
    tally.t1 = time.monotonic()
    own1, sent1 = time.process_time(), engine_counts()
    cpu1 = {name: tree_cpu_seconds(pid) for name, pid in watch.items()}
    for w in workers:
        w.cancel()
    for r in await asyncio.gather(*workers, return_exceptions=True):
        if isinstance(r, Exception):
            raise r
    return {
        "t0": tally.t0,
        "t1": tally.t1,
        "window_s": tally.t1 - tally.t0,
        "tokens": tally.tokens,
        "chunks": tally.chunks,
        "completed": tally.completed,
        "errors": len(tally.errors),
        "first_errors": tally.errors[:5],
        "gap_s": _percentiles(tally.gaps),
        "ttft_s": _percentiles(tally.ttfts),
        "cpu_s": {name: cpu1[name] - cpu0[name] for name in watch},
        "client_cpu_s": own1 - own0,
        "engine_messages": sent1[0] - sent0[0],
        "engine_outputs": sent1[1] - sent0[1],
        "records": tally.records,
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--url", required=True)
    ap.add_argument("--concurrency", type=int, required=True)
    ap.add_argument("--warmup", type=float, default=3.0)
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--model", default="relay-bench")
    ap.add_argument("--prompt", default="Hello world")
    ap.add_argument("--watch", action="append", default=[], metavar="NAME=PID")
    ap.add_argument("--record", action="store_true", help="keep every chunk's receive time")
    ap.add_argument("--progress", type=Path, default=None, help="the board shared with the engine")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    args.out.write_bytes(orjson.dumps(asyncio.run(run_client(args))))


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
