"""The engine's host work in a decode step at a large batch, alone: the model forward and the
logits are replaced by preallocated tensors, so what is timed is scheduling, the persistent
batch and step inputs, sampling's bookkeeping, ``update_from_output`` and building the outputs
(the Python per request per step that a GPU waits for when nothing overlaps it).

    python benchmarks/host_step.py [--batch 256] [--steps 50] [--repeats 5]

Phases as step_anatomy.py names them (``other``: the rest of ``EngineCore.step``, building the
outputs among it), ms per step, median and min over ``--repeats`` runs of ``--steps`` steps with
the garbage collector off. CPU only: the figures are the host's whatever the device.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import step_anatomy  # noqa: E402
from step_anatomy import PHASES, Timer, wrap_phases  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    steps_needed = 10 + args.steps * args.repeats
    setup = argparse.Namespace(
        device="cpu", shape="llama-h512", dtype="float32", batches=[args.batch],
        contexts=[args.context], attention_backend="auto", max_num_batched_tokens=8192,
    )  # fmt: skip
    model_dir = step_anatomy.cached_model("llama-h512", torch.float32)
    core = step_anatomy.engine(model_dir, setup, steps_needed, graphs=False)
    runner = core.runner
    hidden = torch.zeros(setup.max_num_batched_tokens, runner.spec.hidden_size)
    logits = torch.zeros(args.batch, 64)
    runner._forward = lambda step, lora, pooling: hidden  # type: ignore[method-assign]
    runner.model.compute_logits = lambda selected: logits[: selected.shape[0]]  # type: ignore[method-assign]
    step_anatomy.prime(core, args.batch, args.context, steps_needed, 1000, "host")
    for _ in range(5):
        core.step()
    runs = []
    for _ in range(args.repeats):
        timer = Timer()
        patches, _ = wrap_phases(core, timer)
        gc.collect()
        gc.disable()
        start = time.perf_counter()
        for _ in range(args.steps):
            core.step()
        total = time.perf_counter() - start
        gc.enable()
        patches.restore()
        ms = {p: 1e3 * timer.seconds[p] / args.steps for p in PHASES if p not in ("other",)}
        ms["other"] = 1e3 * total / args.steps - sum(ms.values())
        ms["step"] = 1e3 * total / args.steps
        runs.append(ms)
    print(f"batch {args.batch}, context {args.context}: host ms per decode step")
    for name in [p for p in PHASES if p != "forward"] + ["step"]:
        values = [r[name] for r in runs]
        print(f"  {name:9s} median {statistics.median(values):6.3f}  min {min(values):6.3f}")


if __name__ == "__main__":
    main()
