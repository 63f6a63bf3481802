"""Where a decode step's time goes: schedule / prepare / forward / sample / update, in ms and %,
for decode steps at several batch sizes and contexts; on CUDA also with CUDA graphs on and off,
and how many host-side CUDA calls and host syncs a step makes.

    python benchmarks/step_anatomy.py [--shape llama-h512] [--steps 8] [--out results.json]
    python benchmarks/step_anatomy.py --device cuda --shape qwen3-0.6b --out step_anatomy.json
        # batches 1 32 128 256 x contexts 512 1024 2048 x graphs on/off, bf16: ~1.5 min (H200)

The engine (EngineCore, the real step) serves the random-weight model of ``--shape`` (built once
with throughput.py's ``build_model`` and kept in the temp dir). One engine per graphs mode
(``--graphs``: on is the engine's default on CUDA, off is ``enforce_eager``; the CPU has no
graphs) is sized for the largest case and serves every case in turn. A case puts ``batch``
requests at ``context`` tokens without running their prefill: the scheduler admits them and the
model runner's persistent batch takes them in as usual, but the forward is skipped (the KV cache
holds zeros, which cost attention the same as real values). After ``--warmup`` decode steps,
``--steps`` real decode steps are timed, each phase by wrapping the function that does it:

    schedule   Scheduler.schedule
    prepare    ModelRunner._update_batch + step_inputs.build_step (the persistent batch's work)
    forward    ModelRunner._forward (the model's eager forward, or its CUDA graph's replay)
    sample     compute_logits + sampling_inputs.sampling_metadata + sampler.sample (+ host sync)
    update     Scheduler.update_from_output
    other      the rest of EngineCore.step (outputs, prompt logprobs, bookkeeping)

``execute_rest`` (in the JSON) is ModelRunner.execute less prepare, forward and sample. On CUDA
the device is synchronized before each clock is read; a step ends with the device->host copy of
its sampled ids, so device time the host waits for shows in ``sample``. Then
``--profile-steps`` more steps run under torch.profiler, which counts the step's CUDA runtime
and driver calls by name (cuda_calls.py): calls per step are kernel launches, graph launches
and copies; syncs per step the synchronizing calls. The raw count of every CUDA API name seen
is kept in the JSON. Between cases every request is aborted and one empty step lets the runner
drop their rows.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import shutil
import sys
import tempfile
import time
import zlib
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from cuda_calls import CUDA_CALLS, count_cuda_calls, per_step, sync  # noqa: E402
from provenance import provenance  # noqa: E402
from step_timeline import Patches  # noqa: E402
from throughput import SHAPES, build_model  # noqa: E402

from engine_svc.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig  # noqa: E402
from engine_svc.core.sampling_params import SamplingParams  # noqa: E402
from engine_svc.core.scheduler import ScheduledRequest, SchedulerOutput  # noqa: E402
from engine_svc.engine_core import EngineCore  # noqa: E402
from engine_svc.worker import model_runner  # noqa: E402
from kernels.attention_backends import BACKENDS  # noqa: E402

PHASES = ("schedule", "prepare", "forward", "sample", "update", "other")

CUDA_DEFAULTS = {"batches": [1, 32, 128, 256], "contexts": [512, 1024, 2048], "graphs": "both"}
CPU_DEFAULTS = {"batches": [1, 32, 256], "contexts": [64, 512, 2048], "graphs": "off"}


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


def wrap_phases(core: EngineCore, timer: Timer) -> tuple[Patches, list[str]]:
    """Time each phase's functions (on this engine's instances, and the runner module's helpers
    while the patches last); also returns the names not found (their time goes to other)."""
    runner, sched = core.runner, core.scheduler
    # the eager forward or a graph's replay; the model's forward in a runner without _forward
    forward = runner if hasattr(runner, "_forward") else runner.model
    targets = [
        (sched, "schedule", "schedule"),
        (sched, "update_from_output", "update"),
        (runner, "execute", "execute"),
        (runner, "_update_batch", "prepare"),
        (model_runner, "build_step", "prepare"),
        (forward, "_forward" if forward is runner else "forward", "forward"),
        (runner.model, "compute_logits", "sample"),
        (model_runner, "sampling_metadata", "sample"),
        (model_runner, "sample", "sample"),
    ]
    patches = Patches()
    missing = [
        name
        for owner, name, phase in targets
        if not patches.wrap(owner, name, functools.partial(timer.wrap, phase))
    ]
    return patches, missing


def engine(model_dir: Path, args: argparse.Namespace, steps: int, graphs: bool) -> EngineCore:
    """One engine for every case: room for the largest batch at the largest context, plus the
    ``steps`` decode steps a case runs."""
    batch, context = max(args.batches), max(args.contexts)
    max_len = context + steps + 8
    blocks = batch * (-(-(context + steps + 2) // 16)) + 16
    return EngineCore(
        EngineConfig(
            model=ModelConfig(str(model_dir), dtype=args.dtype, max_model_len=max_len),
            cache=CacheConfig(num_kv_blocks=blocks),
            scheduler=SchedulerConfig(
                max_num_seqs=batch,
                # the step's fixed input regions (copied to the device every step) scale with it
                max_num_batched_tokens=args.max_num_batched_tokens,
            ),
            device=args.device,
            attention_backend=args.attention_backend,
            enforce_eager=not graphs,
            # the batch sizes measured: captured (a short start), and padded to in both modes
            cuda_graph_sizes=tuple(sorted(set(args.batches))),
        )
    )


def prime(
    core: EngineCore, batch: int, context: int, steps: int, vocab: int, case: str
) -> list[str]:
    """``batch`` requests with ``context - 1`` prompt tokens, so the next step is a decode at
    ``context``. Returns their ids.

    The scheduler admits them and the runner's persistent batch takes them in as usual, chunk
    by chunk under the token budget, but no forward runs: each chunk is marked computed with
    nothing sampled. A request whose prompt is all computed waits for its token (the scheduler
    skips it), so no request decodes before every prompt is in; then each gets its first token,
    through ``update_from_output`` as from a step that computed nothing more."""
    rng = np.random.default_rng(zlib.crc32(case.encode()))  # each case its own prompts
    prompts = rng.integers(10, vocab, size=(batch, context - 1)).tolist()
    params = SamplingParams(max_tokens=steps + 4, temperature=0.0, ignore_eos=True)
    ids = [f"{case}-r{i}" for i in range(batch)]
    requests = [core.add_request(rid, p, params) for rid, p in zip(ids, prompts, strict=True)]
    while any(r.num_computed_tokens < context - 1 for r in requests):
        chunks = core.scheduler.schedule()
        assert chunks.scheduled and not chunks.preempted_ids, "priming must fit the cache"
        core.runner._update_batch(chunks)
        core.scheduler.update_from_output(chunks, {})  # a prompt chunk samples nothing
    tokens = rng.integers(10, vocab, size=batch).tolist()
    rows = [core.runner.input_batch.row_of[rid] for rid in ids]
    core.runner.input_batch.append_sampled(
        rows, tokens, torch.tensor(tokens, device=core.runner.device)
    )
    first = SchedulerOutput([ScheduledRequest(r, 0, False, []) for r in requests], 0)
    core.scheduler.update_from_output(first, dict(zip(ids, tokens, strict=True)))
    assert all(r.num_tokens == context for r in requests)
    return ids


def release(core: EngineCore, ids: list[str]) -> None:
    """Abort a case's requests; the next step's SchedulerOutput carries them as finished_ids,
    so one (empty) step makes the runner drop their rows."""
    core.abort_requests(ids)
    core.step()
    core.reset_prefix_cache()
    assert not core.scheduler.has_unfinished(), "a case left requests behind"
    assert not core.runner.input_batch.row_of, "the runner kept rows of aborted requests"


def measure(
    core: EngineCore, vocab: int, batch: int, context: int, args: argparse.Namespace, case: str
) -> dict[str, Any]:
    per_case = args.warmup + args.steps + args.profile_steps
    ids = prime(core, batch, context, per_case, vocab, case)
    for _ in range(args.warmup):  # the first decode steps (a graph's first replay among them)
        core.step()
    gc.collect()
    timer = Timer()
    patches, missing = wrap_phases(core, timer)
    try:
        sync(args.device)
        start = time.perf_counter()
        for _ in range(args.steps):
            core.step()
        sync(args.device)
        total = time.perf_counter() - start
    finally:
        patches.restore()
    counts: dict[str, int] = {}
    if args.profile_steps:
        counts = count_cuda_calls(
            lambda: [core.step() for _ in range(args.profile_steps)], args.device
        )
    release(core, ids)

    steps = args.steps
    ms = {p: 1e3 * timer.seconds[p] / steps for p in PHASES if p != "other"}
    ms["other"] = max(0.0, 1e3 * total / steps - sum(ms.values()))
    execute = 1e3 * timer.seconds["execute"] / steps
    step_ms = 1e3 * total / steps
    return {
        "batch": batch,
        "context": context,
        "step_ms": step_ms,
        "ms": ms,
        "share": {p: ms[p] / step_ms for p in PHASES},
        "execute_ms": execute,
        "execute_rest_ms": max(0.0, execute - ms["prepare"] - ms["forward"] - ms["sample"]),
        "tok_s": batch / (step_ms / 1e3),
        "unwrapped": missing,
        "profiled_steps": args.profile_steps,
        "cuda_calls_per_step": per_step(counts, args.profile_steps) if args.profile_steps else {},
        "cuda_api_counts": counts,
    }


def cached_model(shape: str, dtype: torch.dtype) -> Path:
    """The random-weight checkpoint of ``shape``, built once into the temp dir and reused."""
    root = Path(tempfile.gettempdir()) / "tandem-bench-models"
    target = root / f"{shape}-{str(dtype).removeprefix('torch.')}"
    if not (target / "config.json").is_file():
        root.mkdir(parents=True, exist_ok=True)
        building = Path(tempfile.mkdtemp(dir=root))
        build_model(shape, building, dtype)
        try:
            building.rename(target)  # whole or not at all
        except OSError:  # another run got there first
            shutil.rmtree(building, ignore_errors=True)
    return target


def device_facts(device: str) -> dict[str, Any]:
    facts: dict[str, Any] = {"device": device, "torch": torch.__version__}
    if device == "cuda":
        facts.update(gpu=torch.cuda.get_device_name(), cuda=torch.version.cuda)
        try:
            import cupy

            facts["cupy"] = cupy.__version__
        except ImportError:
            facts["cupy"] = None
    return facts


def print_row(mode: str, row: dict[str, Any]) -> None:
    cells = "  ".join(f"{p} {row['ms'][p]:7.2f} ({100 * row['share'][p]:4.1f}%)" for p in PHASES)
    calls = row["cuda_calls_per_step"]
    cuda = f"  calls/step {calls['calls']:6.1f}  syncs/step {calls['syncs']:4.1f}" if calls else ""
    print(
        f"graphs {mode:3s} batch {row['batch']:4d} ctx {row['context']:5d}  "
        f"step {row['step_ms']:8.2f} ms  {row['tok_s']:8.0f} tok/s{cuda}  {cells}",
        flush=True,
    )


def print_table(rows: list[dict[str, Any]], modes: list[str]) -> None:
    """batch x context, one group of columns per graphs mode."""
    by = {(r["graphs"], r["batch"], r["context"]): r for r in rows}
    head = "".join(f"{f'graphs {m}: step ms  calls  syncs':>36}" for m in modes)
    print(f"\n{'batch':>6}{'ctx':>6}{head}" + ("   off/on" if len(modes) == 2 else ""))
    for batch, context in dict.fromkeys((r["batch"], r["context"]) for r in rows):
        line = f"{batch:>6}{context:>6}"
        for m in modes:
            r = by[(m, batch, context)]
            c = r["cuda_calls_per_step"]
            calls, syncs = (f"{c['calls']:.1f}", f"{c['syncs']:.1f}") if c else ("-", "-")
            line += f"{r['step_ms']:>23.2f}{calls:>7}{syncs:>6}"
        if len(modes) == 2:
            off, on = by[("off", batch, context)], by[("on", batch, context)]
            line += f"{off['step_ms'] / on['step_ms']:>8.2f}x"
        print(line)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--shape", choices=sorted(SHAPES), default=None, help="default llama-h512")
    ap.add_argument("--dtype", default=None, help="default float32 on cpu, bfloat16 on cuda")
    ap.add_argument("--batches", type=int, nargs="+", default=None, help="cpu 1 32 256")
    ap.add_argument("--contexts", type=int, nargs="+", default=None, help="cpu 64 512 2048")
    ap.add_argument(
        "--graphs", choices=["on", "off", "both"], default=None, help="cuda both, cpu off"
    )
    ap.add_argument("--attention-backend", choices=BACKENDS, default="auto")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192, help="the token budget")
    ap.add_argument("--steps", type=int, default=None, help="timed steps: cpu 8, cuda 32")
    ap.add_argument("--warmup", type=int, default=None, help="steps before timing: cpu 1, cuda 3")
    ap.add_argument(
        "--profile-steps",
        type=int,
        default=None,
        help="steps under torch.profiler counting CUDA calls: cpu 0 (none), cuda 4",
    )
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    cuda = args.device == "cuda"
    defaults = CUDA_DEFAULTS if cuda else CPU_DEFAULTS
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.shape = args.shape or "llama-h512"
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    args.steps = args.steps if args.steps is not None else (32 if cuda else 8)
    args.warmup = args.warmup if args.warmup is not None else (3 if cuda else 1)
    if args.profile_steps is None:
        args.profile_steps = 4 if cuda else 0
    if args.steps < 1 or min(args.batches) < 1 or min(args.contexts) < 2:
        ap.error("--steps and --batches must be at least 1, --contexts at least 2")
    if not cuda and args.graphs != "off":
        print("note: the CPU has no CUDA graphs; 'on' rows run eagerly too", flush=True)
    return args


def main() -> None:
    args = parse_args()
    modes = ["on", "off"] if args.graphs == "both" else [args.graphs]
    model_dir = cached_model(args.shape, getattr(torch, args.dtype))
    vocab = SHAPES[args.shape]["vocab_size"]
    per_case = args.warmup + args.steps + args.profile_steps
    rows: list[dict[str, Any]] = []
    engines: dict[str, dict[str, Any]] = {}
    for mode in modes:
        start = time.perf_counter()
        core = engine(model_dir, args, per_case, graphs=mode == "on")
        built_s = time.perf_counter() - start
        for batch in args.batches:
            for context in args.contexts:
                row = measure(core, vocab, batch, context, args, f"{mode}-b{batch}-c{context}")
                row["graphs"] = mode
                rows.append(row)
                print_row(mode, row)
        graphs = getattr(core.runner, "graphs", None)  # None when the runner runs eagerly
        engines[mode] = {
            "enforce_eager": mode == "off",
            "graphs_in_use": graphs is not None,
            "graphs": None if graphs is None else type(graphs).__name__,
            "attention_backend": core.runner.kernels.attention.name,
            "start_s": built_s,
        }
        if mode == "on" and graphs is None and args.device == "cuda":
            print("warning: graphs asked for, but core.runner.graphs is None: ran eagerly")
        del core
        gc.collect()
        if args.device == "cuda":
            engines[mode]["peak_cuda_gib"] = torch.cuda.max_memory_allocated() / 2**30
            engines[mode]["left_allocated_gib"] = torch.cuda.memory_allocated() / 2**30
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
    print_table(rows, modes)
    for mode, facts in engines.items():
        print(f"graphs {mode}: {facts}")
    if args.out:
        record = {
            **provenance(),
            **device_facts(args.device),
            "shape": args.shape,
            "dtype": args.dtype,
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "cuda_calls": {k: list(v) for k, v in CUDA_CALLS.items()},
            "engines": engines,
            "rows": rows,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=2))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
