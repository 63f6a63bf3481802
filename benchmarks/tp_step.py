"""What the tensor-parallel executor adds to a decode step, on the CPU: the same engine as the
in-process runner (TP=1), through the multi-process executor with one rank (TP=1 mp: a group of
one, no worker) and with two (TP=2: rank 0 in process, one worker process, gloo), decode steps
timed at several batch sizes in the same run. One process joins one group at a time, so the
engines are built one after another, and the whole comparison runs ``--rounds`` times.

    python benchmarks/tp_step.py [--shape llama-h512] [--batch 1 16 64] [--steps 20] [--rounds 2]

Reported per batch (medians over rounds): ms per decode step for each engine, and the TP=2 step
channel alone (encoding the scheduler output and sending it to the worker, ``StepEncoder`` over
the pipe), µs. Rank 0 samples in process, so nothing is gathered back. On a 2-core machine the
two ranks share the cores, so TP=2's forward is no faster than TP=1's: the figures that matter
here are the executor's own costs, which a real multi-GPU step pays on top.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from provenance import provenance  # noqa: E402
from step_anatomy import cached_model  # noqa: E402

from engine_svc.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig  # noqa: E402
from engine_svc.core.sampling_params import SamplingParams  # noqa: E402
from engine_svc.engine_core import EngineCore  # noqa: E402


def decode_ms(core: EngineCore, batch: int, steps: int) -> tuple[float, list[float]]:
    """Median ms per decode step of ``batch`` requests (after their prefill), and the executor's
    per-step send times in µs when it has them."""
    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    ids = [f"b{batch}-{i}" for i in range(batch)]
    for rid in ids:
        core.add_request(rid, [5 + i for i in range(32)], params)
    while any(r.num_output_tokens == 0 for r in core.scheduler.running) or core.scheduler.waiting:
        core.step()
    times: list[float] = []
    sends: list[float] = []
    rank0 = getattr(core.runner, "rank0", None)
    marks: dict[str, float] = {}
    if rank0 is not None:  # the executor: time from its execute to rank 0's (encode + send)
        outer, inner = core.runner.execute, rank0.execute

        def timed_outer(so: Any) -> Any:
            marks["outer"] = time.perf_counter()
            return outer(so)

        def timed_inner(so: Any) -> Any:
            marks["inner"] = time.perf_counter()
            return inner(so)

        core.runner.execute, rank0.execute = timed_outer, timed_inner  # type: ignore[method-assign]
    try:
        for _ in range(steps):
            marks.clear()
            start = time.perf_counter()
            core.step()
            times.append(1e3 * (time.perf_counter() - start))
            if "inner" in marks:
                sends.append(1e6 * (marks["inner"] - marks["outer"]))
    finally:
        if rank0 is not None:
            del core.runner.execute, rank0.execute  # the class's methods again
    core.abort_requests(ids)
    core.step()
    return statistics.median(times), sends


ENGINES = {"tp1": (1, None), "tp1_mp": (1, "mp"), "tp2": (2, None)}


def measure(model: Path, name: str, batches: list[int], steps: int) -> dict[int, tuple]:
    """{batch: (ms per step, channel µs or None)} of one engine, built and shut down here."""
    tp, backend = ENGINES[name]
    core = EngineCore(
        EngineConfig(
            model=ModelConfig(str(model), dtype="float32", max_model_len=512),
            cache=CacheConfig(num_kv_blocks=max(batches) * 8 + 16),
            scheduler=SchedulerConfig(max_num_seqs=max(batches)),
            tensor_parallel_size=tp,
            distributed_executor_backend=backend,
        )
    )
    threads = torch.get_num_threads()  # the executor gives its ranks their share of the CPUs
    try:
        out = {}
        for b in batches:
            ms, sends = decode_ms(core, b, steps)
            out[b] = (ms, statistics.median(sends) if sends else None)
        return out
    finally:
        shutdown = getattr(core.runner, "shutdown", None)
        if shutdown is not None:
            shutdown()
        torch.set_num_threads(threads)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--shape", default="llama-h512")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    model = cached_model(args.shape, torch.float32)
    runs: dict[str, list[dict[int, tuple]]] = {name: [] for name in ENGINES}
    for r in range(args.rounds):
        order = list(ENGINES) if r % 2 == 0 else list(reversed(ENGINES))
        for name in order:
            runs[name].append(measure(model, name, args.batch, args.steps))
    rows: list[dict[str, Any]] = []
    print(f"{'batch':>5} {'TP=1 ms':>8} {'TP=1 mp':>8} {'TP=2 ms':>8} {'channel us':>10}")
    for b in args.batch:
        med = {n: statistics.median(run[b][0] for run in runs[n]) for n in ENGINES}
        sends = [run[b][1] for run in runs["tp2"] if run[b][1] is not None]
        channel = statistics.median(sends) if sends else None
        rows.append(
            dict(batch=b, tp1_ms=med["tp1"], tp1_mp_ms=med["tp1_mp"], tp2_ms=med["tp2"],
                 channel_us=channel, rounds=args.rounds)
        )  # fmt: skip
        ch = "-" if channel is None else f"{channel:.0f}"
        print(f"{b:>5} {med['tp1']:8.2f} {med['tp1_mp']:8.2f} {med['tp2']:8.2f} {ch:>10}")
    if args.out:
        args.out.write_text(json.dumps(dict(**provenance(), rows=rows), indent=2))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
