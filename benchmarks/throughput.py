"""Offline throughput: Tandem's LLM against transformers, same model, same requests, one run.

Peers: transformers' generate() with static batching (one row per --hf-batch-size) and
transformers' own continuous batching (``init_continuous_batching``: a paged cache and a scheduler
in a background thread). Every request is greedy, ignores EOS and asks for its own output length;
warm-up runs on other prompts and is not timed.

    python benchmarks/throughput.py                       # CPU defaults, a few minutes
    python benchmarks/throughput.py --shape llama-h512 --num-requests 64 256 \\
        --input-len 16 256 --output-len 16 128 --out benchmarks/results/x.json   # issue 10
    python benchmarks/throughput.py --num-requests 256 --input-len 100 1024 --output-len 100 1024 \\
        --shape qwen3-0.6b --device cuda                   # GPU (issue 4)

Prints one table per request count (elapsed, output tok/s, model FLOP/s as a fraction of torch's
GEMM FLOP/s on the model's shapes, Tandem's ratio to each peer; see benchmarks/flops.py for the
counting) and writes JSON with date, machine, command and arguments to --out.

With ``--timeline FILE`` each timed Tandem run also records one row per engine step (wall time;
schedule / execute / update; rows, decode rows, prefill tokens, context) and writes them to FILE
with a summary (decode step time by batch band, prefill steps, GC time) and the same provenance
as --out; see benchmarks/step_timeline.py. Its counting costs a few microseconds per step, inside
the timed run. ``--enforce-eager`` runs Tandem without CUDA graphs (no effect on the CPU).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from flops import GemmRates, measure_gemm_rates, median_rates, run_flops  # noqa: E402
from hf_peers import Request, blocks_to_hold, run_continuous, run_static  # noqa: E402
from provenance import provenance  # noqa: E402
from step_timeline import StepTimeline, print_summary  # noqa: E402

SHAPES: dict[str, dict[str, Any]] = {
    # ~25M parameters: fits a 2-core CPU run in minutes.
    "llama-25m": dict(
        arch="LlamaForCausalLM",
        vocab_size=32000,
        hidden_size=384,
        intermediate_size=1024,
        num_hidden_layers=6,
        num_attention_heads=6,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
    ),
    # The shape issue 10 measures with: ~25M parameters, hidden 512, 6 layers, 8/4 heads.
    "llama-h512": dict(
        arch="LlamaForCausalLM",
        vocab_size=8192,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=4,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
    ),
    "qwen3-0.6b": dict(
        arch="Qwen3ForCausalLM",
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
        max_position_embeddings=40960,
    ),
    "qwen2.5-0.5b": dict(
        arch="Qwen2ForCausalLM",
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        max_position_embeddings=32768,
    ),
}


SYSTEMS = ("tandem", "hf-static", "hf-cb")


def build_model(shape: str, out_dir: Path, dtype: torch.dtype) -> Path:
    import transformers

    cfg = dict(SHAPES[shape])
    arch = cfg.pop("arch")
    config = getattr(transformers, arch.replace("ForCausalLM", "Config"))(**cfg)
    torch.manual_seed(0)
    model = getattr(transformers, arch)(config).to(dtype)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def make_requests(
    n: int, input_len: tuple[int, int], output_len: tuple[int, int], vocab: int, seed: int
) -> list[Request]:
    rng = random.Random(seed)
    return [
        (
            [rng.randrange(10, vocab) for _ in range(rng.randint(*input_len))],
            rng.randint(*output_len),
        )
        for _ in range(n)
    ]


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _result(elapsed: float, out_tokens: int) -> dict[str, float]:
    return {"elapsed_s": elapsed, "output_tokens": out_tokens, "output_tok_s": out_tokens / elapsed}


def _torch_dtype(args: argparse.Namespace) -> torch.dtype:
    if args.dtype == "auto":
        return torch.bfloat16 if args.device == "cuda" else torch.float32
    return getattr(torch, args.dtype)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run_tandem(
    model_dir: Path,
    reqs: list[Request],
    warm: list[Request],
    args: argparse.Namespace,
    max_num_seqs: int,
    timelines: list[dict[str, Any]],
) -> dict[str, float]:
    """Tandem's LLM on ``reqs`` after a warm-up on ``warm``; with --timeline the timed run's
    steps are appended to ``timelines``."""
    from engine_svc import LLM, SamplingParams

    llm = LLM(
        model_dir,
        dtype=args.dtype,
        device=args.device,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory=args.kv_cache_memory,
        num_kv_blocks=(
            None
            if args.kv_cache_memory
            else blocks_to_hold(reqs + warm, args.block_size) + 2 * max_num_seqs
        ),
        block_size=args.block_size,
        enforce_eager=args.enforce_eager,
    )

    def generate(batch: list[Request], use_tqdm: bool) -> int:
        prompts = [{"prompt_token_ids": p} for p, _ in batch]
        params = [SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True) for _, o in batch]
        outs = llm.generate(prompts, params, use_tqdm=use_tqdm)
        return sum(len(o.outputs[0].token_ids) for o in outs)

    generate(warm, use_tqdm=False)
    timeline = StepTimeline(llm.engine) if args.timeline else None
    _sync(args.device)
    start = time.perf_counter()
    if timeline is None:
        out_tokens = generate(reqs, use_tqdm=args.progress)
    else:
        with timeline:
            out_tokens = generate(reqs, use_tqdm=args.progress)
    _sync(args.device)
    elapsed = time.perf_counter() - start
    assert out_tokens == sum(o for _, o in reqs), "ignore_eos requests must produce max_tokens"
    if timeline is not None:
        summary = timeline.summary(max_num_seqs)
        print_summary(summary)
        timelines.append(
            {
                "num_requests": len(reqs),
                "max_num_seqs": max_num_seqs,
                "attention_backend": llm.engine.runner.kernels.attention.name,
                # the runner's CUDA graphs; None (or no attribute) when it runs eagerly
                "graphs_in_use": getattr(llm.engine.runner, "graphs", None) is not None,
                "elapsed_s": elapsed,
                "output_tokens": out_tokens,
                "summary": summary,
                "rows": timeline.rows,
            }
        )
    return _result(elapsed, out_tokens)


def run_count(
    n: int,
    model_dir: Path,
    vocab: int,
    args: argparse.Namespace,
    timelines: list[dict[str, Any]],
) -> dict[str, Any]:
    """Every system on the same ``n`` requests, with torch's GEMM rates measured before the
    first and after each (the machine's speed drifts: the median is used)."""
    cfg = SHAPES[args.shape]
    reqs = make_requests(n, tuple(args.input_len), tuple(args.output_len), vocab, args.seed)
    # warm-up on other prompts: nothing the timed run could find in a prefix cache
    warm = make_requests(2, tuple(args.input_len), (8, 8), vocab, args.seed + 1)
    max_num_seqs = args.max_num_seqs or n
    dtype = _torch_dtype(args)
    out_tokens = sum(o for _, o in reqs)

    def gemm() -> GemmRates:
        return measure_gemm_rates(
            cfg, args.max_num_batched_tokens, min(n, max_num_seqs), dtype, args.device
        )

    gemm_samples = [gemm()]
    rounds: list[dict[str, dict[str, float]]] = []

    def record(name: str, result: dict[str, float]) -> None:
        gc.collect()  # the system's model and cache go before the next one loads
        result["peak_rss_mib"] = peak_rss_mib()
        rounds[-1][name] = result
        print(f"{name}: {result}", flush=True)
        gemm_samples.append(gemm())

    # With --rounds R the systems run R times in turn, so every ratio can be taken within a
    # round (the machine drifts over minutes) and the median over rounds reported.
    for _ in range(args.rounds):
        rounds.append({})
        if "tandem" in args.systems:
            record("tandem LLM", run_tandem(model_dir, reqs, warm, args, max_num_seqs, timelines))
        if "hf-static" in args.systems:
            for b in args.hf_batch_size:
                elapsed = run_static(
                    model_dir, reqs, warm, dtype=dtype, device=args.device, batch_size=b
                )
                record(f"transformers static b{b}", _result(elapsed, out_tokens))
        if "hf-cb" in args.systems:
            elapsed = run_continuous(
                model_dir,
                reqs,
                warm,
                dtype=dtype,
                device=args.device,
                max_num_seqs=max_num_seqs,
                max_batch_tokens=args.max_num_batched_tokens,
            )
            record("transformers CB", _result(elapsed, out_tokens))
    # Each system's median round by elapsed time stands for it in the table.
    systems = {
        name: sorted((r[name] for r in rounds), key=lambda x: x["elapsed_s"])[len(rounds) // 2]
        for name in rounds[0]
    }

    flops = run_flops(cfg, [len(p) for p, _ in reqs], [o for _, o in reqs])
    rates = median_rates(gemm_samples)
    bound_s = rates.bound_seconds(flops)
    for r in (result for one_round in rounds for result in one_round.values()):
        r["model_flops_per_s"] = flops.total / r["elapsed_s"]
        r["fraction_of_gemm"] = bound_s / r["elapsed_s"]
    tandem = systems.get("tandem LLM")
    return {
        "num_requests": n,
        "max_num_seqs": max_num_seqs,
        "input_tokens": sum(len(p) for p, _ in reqs),
        "output_tokens": sum(o for _, o in reqs),
        "systems": systems,
        "tandem_ratio": {
            name: tandem["output_tok_s"] / r["output_tok_s"]
            for name, r in systems.items()
            if tandem and r is not tandem
        },
        # Tandem over each peer within each round, and their median.
        "tandem_ratio_by_round": {
            name: [r["tandem LLM"]["output_tok_s"] / r[name]["output_tok_s"] for r in rounds]
            for name in systems
            if tandem and name != "tandem LLM"
        },
        "rounds": rounds,
        "model_flops": {**vars(flops), "total": flops.total},
        "gemm": {
            "samples": [vars(s) for s in gemm_samples],
            "median": vars(rates),
            "run_mix_flops_per_s": rates.effective_flops_per_s(flops),
            "bound_s": bound_s,
        },
    }


def print_table(run: dict[str, Any], args: argparse.Namespace) -> None:
    f, g = run["model_flops"], run["gemm"]
    print()
    print(
        f"shape={args.shape} requests={run['num_requests']} input={list(args.input_len)} "
        f"output={list(args.output_len)} device={args.device} dtype={args.dtype} "
        f"threads={torch.get_num_threads()} max_num_seqs={run['max_num_seqs']} "
        f"token_budget={args.max_num_batched_tokens}"
    )
    print(
        f"{'system':<26}{'elapsed s':>11}{'out tokens':>12}{'out tok/s':>11}"
        f"{'GFLOP/s':>10}{'of GEMM':>9}{'tandem x':>10}"
    )
    for name, r in run["systems"].items():
        ratio = run["tandem_ratio"].get(name)
        print(
            f"{name:<26}{r['elapsed_s']:>11.2f}{r['output_tokens']:>12}{r['output_tok_s']:>11.1f}"
            f"{r['model_flops_per_s'] / 1e9:>10.1f}{r['fraction_of_gemm']:>9.1%}"
            f"{'-' if ratio is None else f'{ratio:.2f}x':>10}"
        )
    if len(run["rounds"]) > 1:
        print(f"median round of {len(run['rounds'])} above; within each round:")
        for name, ratios in run["tandem_ratio_by_round"].items():
            listed = ", ".join(f"{x:.2f}x" for x in ratios)
            print(f"  tandem / {name}: {listed} (median {statistics.median(ratios):.2f}x)")
        fractions = ", ".join(f"{r['tandem LLM']['fraction_of_gemm']:.1%}" for r in run["rounds"])
        print(f"  tandem of GEMM: {fractions}")
    m = g["median"]
    print(
        f"model FLOPs {f['total'] / 1e9:.1f} G = 2 x {f['body_params'] / 1e6:.2f}M body params x "
        f"{f['prompt_rows'] + f['decode_rows']} rows + 2 x {f['lm_head_params'] / 1e6:.2f}M "
        f"lm_head x {f['logit_rows']} logit rows"
    )
    print(
        f"torch GEMM GFLOP/s (median of {len(g['samples'])}): "
        f"{m['prefill_flops_per_s'] / 1e9:.1f} at "
        f"{m['prefill_tokens']} prefill rows, {m['decode_flops_per_s'] / 1e9:.1f} at "
        f"{m['decode_batch']} decode rows; {g['run_mix_flops_per_s'] / 1e9:.1f} for this run's mix "
        f"(GEMM-only time {g['bound_s']:.2f} s)"
    )
    spread = [s["decode_flops_per_s"] / 1e9 for s in g["samples"]]
    print(
        f"decode GEMM samples {min(spread):.1f}..{max(spread):.1f} GFLOP/s"
        + (
            "  (> 20 % apart: the machine was busy; run again)"
            if max(spread) > 1.2 * min(spread)
            else ""
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama-25m")
    ap.add_argument("--num-requests", type=int, nargs="+", default=[64], help="one table each")
    ap.add_argument("--input-len", type=int, nargs=2, default=(32, 256))
    ap.add_argument("--output-len", type=int, nargs=2, default=(32, 128))
    ap.add_argument(
        "--max-num-seqs", type=int, default=None, help="default: the number of requests"
    )
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument(
        "--kv-cache-memory", default=None, help="default: a cache that holds every request"
    )
    ap.add_argument("--hf-batch-size", type=int, nargs="+", default=[16, 64])
    ap.add_argument(
        "--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS), help="what to run"
    )
    ap.add_argument("--skip-hf", action="store_true", help="same as --systems tandem")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=1, help="run the systems this many times in turn")
    ap.add_argument("--progress", action="store_true", help="Tandem's progress bar")
    ap.add_argument("--out", type=Path, default=None, help="write results JSON here")
    ap.add_argument(
        "--timeline",
        type=Path,
        default=None,
        metavar="FILE",
        help="record each timed Tandem run step by step; write the rows and a summary here",
    )
    ap.add_argument(
        "--enforce-eager", action="store_true", help="Tandem without CUDA graphs (GPU runs)"
    )
    args = ap.parse_args()
    if args.skip_hf:
        args.systems = ["tandem"]

    runs = []
    timelines: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(args.shape, Path(tmp) / args.shape, torch.float32)
        vocab = SHAPES[args.shape]["vocab_size"]
        for n in args.num_requests:
            runs.append(run_count(n, model_dir, vocab, args, timelines))
    for run in runs:
        print_table(run, args)
    if args.device == "cuda":
        print(f"peak CUDA memory GiB: {torch.cuda.max_memory_allocated() / 2**30:.2f}")
    head = header(args)  # one provenance for both files
    if args.out:
        write_json(args.out, {**head, "runs": runs})
    if args.timeline:
        write_json(args.timeline, {**head, "timelines": timelines})


def header(args: argparse.Namespace) -> dict[str, Any]:
    """What every JSON this script writes starts with: provenance, versions, arguments."""
    import transformers

    cuda = args.device == "cuda"
    return {
        **provenance(),
        **({"gpu": torch.cuda.get_device_name(), "cuda": torch.version.cuda} if cuda else {}),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "threads": torch.get_num_threads(),
        "args": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(args).items()},
    }


def write_json(path: Path, record: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2, default=str))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
