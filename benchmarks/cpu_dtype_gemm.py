"""torch's GEMM FLOP/s on the CPU per dtype, on one decoder layer's matmuls of a model shape.

The dtypes take turns within each repeat (float32, bfloat16, float16, then again), so a busy
machine slows them alike; each figure is the median over the repeats of ``gemm_flops_per_s``
(benchmarks/flops.py: every matmul its own weight, the median pass of a timed loop).

    python benchmarks/cpu_dtype_gemm.py --out benchmarks/results/cpu_dtype_gemm.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from flops import gemm_flops_per_s, layer_linears  # noqa: E402
from provenance import provenance  # noqa: E402
from throughput import SHAPES  # noqa: E402

DTYPES = ("float32", "bfloat16", "float16")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["qwen3-0.6b"])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256, 2048])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--min-seconds", type=float, default=0.3, help="per dtype, row count, repeat")
    ap.add_argument("--out", type=Path, default=None, help="write results JSON here")
    args = ap.parse_args()

    results = []
    print(
        f"{'shape':<12} {'rows':>5}  " + "  ".join(f"{d:>9}" for d in DTYPES) + "  fp16/bf16 time"
    )
    for shape in args.shapes:
        linears = layer_linears(SHAPES[shape])
        for rows in args.rows:
            samples: dict[str, list[float]] = {d: [] for d in DTYPES}
            for _ in range(args.repeats):
                for d in DTYPES:
                    rate = gemm_flops_per_s(
                        linears, rows, getattr(torch, d), min_seconds=args.min_seconds
                    )
                    samples[d].append(rate)
            gflops = {d: statistics.median(s) / 1e9 for d, s in samples.items()}
            ratio = gflops["bfloat16"] / gflops["float16"]
            results.append(
                {"shape": shape, "rows": rows, "gflop_s": gflops, "fp16_over_bf16_time": ratio}
            )
            print(
                f"{shape:<12} {rows:>5}  "
                + "  ".join(f"{gflops[d]:>9.1f}" for d in DTYPES)
                + f"  {ratio:>14.2f}"
            )
    if args.out:
        record = {
            **provenance(),
            "versions": {"torch": torch.__version__},
            "threads": torch.get_num_threads(),
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "results": results,
        }
        args.out.write_text(json.dumps(record, indent=2))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
