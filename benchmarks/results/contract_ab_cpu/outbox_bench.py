"""The engine Stream's cost per step for one client: the step's outputs into the outbox and out
as the message gRPC writes, before (engine_svc/rpc/stream_outbox.py, converted at take) and
after (protos/stream_outbox.py, converted at add) issue 30's contract package. Run from a tree's
root: python benchmarks/results/contract_ab_cpu/outbox_bench.py"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from engine_svc.core.outputs import EngineCoreOutput
from engine_svc.loop.clients import ClientBatch
from engine_svc.rpc import servicer

if not Path("engine_svc/rpc/stream_outbox.py").exists():  # after: the contract's outbox
    from protos.stream_outbox import StreamOutbox

    def add(box, batch):  # noqa: ANN001, ANN201
        box.add(*servicer._batch_to_pb(batch))

    def take(box):  # noqa: ANN001, ANN201
        return box.take()

    tree = "after"
else:  # before: the engine's outbox, converted when taken
    from engine_svc.rpc.stream_outbox import StreamOutbox  # type: ignore[no-redef]

    def add(box, batch):  # noqa: ANN001, ANN201
        box.add(batch)

    def take(box):  # noqa: ANN001, ANN201
        return servicer._batch_to_pb(box.take())

    tree = "before"

try:
    from protos.types import LoadFigures
except ImportError:
    from engine_svc.loop.clients import LoadFigures  # type: ignore[no-redef]


def batches(n: int, steps: int) -> list[ClientBatch]:
    return [
        ClientBatch(
            [EngineCoreOutput(f"r{i}", [s], num_prompt_tokens=32) for i in range(n)],
            load=LoadFigures(num_running=n),
        )
        for s in range(steps)
    ]


def run(n: int, merged: int, reps: int) -> float:
    """Seconds per step: ``merged`` steps held behind a full window, then sent as one."""
    best = float("inf")
    for _ in range(5):
        work = [batches(n, merged) for _ in range(reps)]
        box = StreamOutbox()
        t0 = time.perf_counter()
        for steps in work:
            for b in steps:
                add(box, b)
            take(box)
        best = min(best, (time.perf_counter() - t0) / (reps * merged))
    return best


out = {"tree": tree}
for n in (1, 64, 256):
    for merged in (1, 4):
        out[f"n{n}_merged{merged}_us_per_step"] = round(run(n, merged, max(20, 2000 // n)) * 1e6, 1)
json.dump(out, sys.stdout)
print()
