"""Where an engine step's time goes: schedule / prepare / forward / sample / update, in ms and %,
for decode steps at batch 1, 32, 256 and contexts 64, 512, 2048.

    python benchmarks/step_anatomy.py [--shape llama-h512] [--steps 8] [--out results.json]

The engine (EngineCore, the real step) serves the random-weight model of ``--shape``. Each case
puts ``batch`` requests at ``context`` tokens without running their prefill: the scheduler
admits them and the model runner's persistent batch takes them in as usual, but the forward is
skipped (the KV cache holds zeros, which cost attention the same as real values). Then
``--steps`` real decode steps are timed, each phase by wrapping the function that does it:

    schedule   Scheduler.schedule
    prepare    ModelRunner._update_batch + step_inputs.build_step (the persistent batch's work)
    forward    the model's forward
    sample     compute_logits + sampling_inputs.sampling_metadata + sampler.sample (+ host sync)
    update     Scheduler.update_from_output
    other      the rest of EngineCore.step (outputs, prompt logprobs, bookkeeping)
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from provenance import provenance  # noqa: E402
from throughput import SHAPES, build_model  # noqa: E402

from engine_svc.config import CacheConfig, EngineConfig, ModelConfig  # noqa: E402
from engine_svc.core.engine_core import EngineCore  # noqa: E402
from engine_svc.core.sampling_params import SamplingParams  # noqa: E402
from engine_svc.core.scheduler import SchedulerConfig  # noqa: E402
from engine_svc.worker import model_runner  # noqa: E402

PHASES = ("schedule", "prepare", "forward", "sample", "update", "other")


class Timer:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def wrap(self, phase: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[phase] += time.perf_counter() - start

        return timed


def engine(model_dir: Path, batch: int, context: int, steps: int) -> EngineCore:
    blocks = batch * (-(-(context + steps + 2) // 16)) + 16
    return EngineCore(
        EngineConfig(
            model=ModelConfig(str(model_dir), dtype="float32", max_model_len=context + steps + 8),
            cache=CacheConfig(num_kv_blocks=blocks),
            scheduler=SchedulerConfig(
                max_num_seqs=max(batch, 1),
                max_num_batched_tokens=max(batch * context, 2048),
                max_model_len=context + steps + 8,
            ),
        )
    )


def prime(core: EngineCore, batch: int, context: int, steps: int, vocab: int) -> None:
    """``batch`` requests with ``context - 1`` prompt tokens, admitted and marked computed
    without a forward, so the next step is a decode at ``context``."""
    rng = random.Random(0)
    params = SamplingParams(max_tokens=steps + 4, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        prompt = [rng.randrange(10, vocab) for _ in range(context - 1)]
        core.add_request(f"r{i}", prompt, params)
    scheduled = core.scheduler.schedule()
    assert all(s.num_tokens == context - 1 for s in scheduled.scheduled), "priming must fit"
    core.runner._update_batch(scheduled)
    sampled = {s.request.request_id: rng.randrange(10, vocab) for s in scheduled.scheduled}
    rows = [core.runner.input_batch.row_of[rid] for rid in sampled]
    tokens = list(sampled.values())
    core.runner.input_batch.append_sampled(rows, tokens, torch.tensor(tokens))
    core.scheduler.update_from_output(scheduled, sampled)


def measure(model_dir: Path, vocab: int, batch: int, context: int, steps: int) -> dict[str, Any]:
    core = engine(model_dir, batch, context, steps)
    prime(core, batch, context, steps, vocab)
    core.step()  # warm-up: first decode step
    timer = Timer()
    runner = core.runner
    sched = core.scheduler
    saved = (model_runner.build_step, model_runner.sampling_metadata, model_runner.sample)
    sched.schedule = timer.wrap("schedule", sched.schedule)  # type: ignore[method-assign]
    sched.update_from_output = timer.wrap("update", sched.update_from_output)  # type: ignore[method-assign]
    runner._update_batch = timer.wrap("prepare", runner._update_batch)  # type: ignore[method-assign]
    runner.model.forward = timer.wrap("forward", runner.model.forward)  # type: ignore[method-assign]
    runner.model.compute_logits = timer.wrap("sample", runner.model.compute_logits)  # type: ignore[method-assign]
    model_runner.build_step = timer.wrap("prepare", saved[0])  # type: ignore[assignment]
    model_runner.sampling_metadata = timer.wrap("sample", saved[1])  # type: ignore[assignment]
    model_runner.sample = timer.wrap("sample", saved[2])  # type: ignore[assignment]
    try:
        start = time.perf_counter()
        for _ in range(steps):
            core.step()
        total = time.perf_counter() - start
    finally:
        model_runner.build_step, model_runner.sampling_metadata, model_runner.sample = saved
    ms = {p: 1e3 * timer.seconds[p] / steps for p in PHASES if p != "other"}
    ms["other"] = max(0.0, 1e3 * total / steps - sum(ms.values()))
    step_ms = 1e3 * total / steps
    return {
        "batch": batch,
        "context": context,
        "step_ms": step_ms,
        "ms": ms,
        "share": {p: ms[p] / step_ms for p in PHASES},
        "tok_s": batch / (step_ms / 1e3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama-h512")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32, 256])
    ap.add_argument("--contexts", type=int, nargs="+", default=[64, 512, 2048])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(args.shape, Path(tmp) / args.shape, torch.float32)
        vocab = SHAPES[args.shape]["vocab_size"]
        for batch in args.batches:
            for context in args.contexts:
                row = measure(model_dir, vocab, batch, context, args.steps)
                rows.append(row)
                cells = "  ".join(
                    f"{p} {row['ms'][p]:7.2f} ({100 * row['share'][p]:4.1f}%)" for p in PHASES
                )
                print(
                    f"batch {batch:4d} ctx {context:5d}  step {row['step_ms']:8.2f} ms  "
                    f"{row['tok_s']:8.0f} tok/s  {cells}",
                    flush=True,
                )
    if args.out:
        record = {
            **provenance(),
            "torch": torch.__version__,
            "shape": args.shape,
            "rows": rows,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
