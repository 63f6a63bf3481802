"""The floor of the gateway's engine-stream reading, for benchmarks/gateway_relay.py::

    python benchmarks/relay_grpc_floor.py --engine HOST:PORT --duration S

One grpc.aio client on uvloop (the gateway's own setup) opens the Engine ``Stream`` of the
stand-in engine (run without ``--progress``: nothing holds it back), adds one request that never
ends, and does nothing with the one-token messages but count them. It prints, as JSON, how many
messages a second it read and its CPU time (all its threads: grpc's own too) per message.

At one stream the stand-in sends one message per token, so this is the most tokens a second any
Python gateway on grpcio could relay for one stream on this machine: if it is below half the
bare app's one-stream rate, the issue's 0.5x target at one stream cannot be met by work on the
gateway's own code; only fewer messages per token (or another transport) could.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import orjson
import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from protos.tandem.engine.v1 import engine_pb2 as pb  # noqa: E402
from protos.tandem.engine.v1 import engine_pb2_grpc as pb_grpc  # noqa: E402

WARMUP_MESSAGES = 2000


async def measure(address: str, duration: float) -> dict[str, float]:
    params = pb.SamplingParams(max_tokens=(1 << 32) - 1)
    add = pb.AddRequest(request_id="floor-0", prompt_token_ids=[5], sampling_params=params)
    forever = asyncio.Event()

    async def requests() -> AsyncIterator[pb.EngineCoreRequest]:
        yield pb.EngineCoreRequest(add=add)
        await forever.wait()  # keep the stream open: a half-close would end it

    async with grpc.aio.insecure_channel(address) as channel:
        call = pb_grpc.EngineStub(channel).Stream(requests())
        seen, counted = 0, 0
        t0 = cpu0 = 0.0
        async for _ in call:
            seen += 1
            if seen == WARMUP_MESSAGES:
                t0, cpu0 = time.perf_counter(), time.process_time()
            elif seen > WARMUP_MESSAGES:
                counted += 1
                if counted % 256 == 0 and time.perf_counter() - t0 >= duration:
                    break
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        call.cancel()
    if counted == 0:
        raise RuntimeError("the engine stream ended before the window")
    return {
        "messages": counted,
        "window_s": wall,
        "msg_s": counted / wall,
        "cpu_us_per_msg": 1e6 * cpu / counted,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", required=True, help="HOST:PORT of the stand-in engine")
    ap.add_argument("--duration", type=float, default=5.0, help="seconds counted")
    args = ap.parse_args()
    result = uvloop.run(measure(args.engine, args.duration))
    sys.stdout.write(orjson.dumps(result).decode() + "\n")


if __name__ == "__main__":
    main()
