"""Decode attention on the CPU: the engine's CPU attention backend (the C kernel) and the torch
reference backend against the memory-read bound, in one run on the same inputs.

    python benchmarks/attention_cpu.py [--batch 128] [--context 2048] \\
        [--dtype float32 bfloat16] [--rounds 7] [--out benchmarks/results/x.json]

Shape llama-h512's attention: 8 query heads, 4 KV heads, head_dim 64, block size 16; every
request one query token over the same context, its blocks scattered at random over the pool
(tests/gpu/helpers.make_case). One call is ``Kernels.attention.forward(query, key_cache,
value_cache, meta, scale)`` of ``kernels.attention_backends.select_kernels`` ("cpu", "torch").

Bound: the bytes of K and V the call must read (batch x context x kv_heads x head_dim x 2 x
element size; query, output and block tables are left out, they are < 1 %) divided by the read
bandwidth measured in the same run (``sum()`` of a large float32 tensor with torch's threads).
The machine's bandwidth drifts (+-20 % over minutes), so measurements interleave: bandwidth,
cpu, bandwidth, torch, bandwidth, cpu, ... Each call time is set against the mean of the two
bandwidth readings beside it, and the medians over the rounds are reported.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from provenance import provenance  # noqa: E402

from engine_svc import envs  # noqa: E402
from kernels.attention_backends import Kernels, select_kernels  # noqa: E402
from tests.gpu.helpers import ATTN_TOL, AttentionCase, make_case  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 8, 4, 64, 16
BACKENDS = ("cpu", "torch")


def read_bandwidth(buf: torch.Tensor, reads: int = 3) -> float:
    """Bytes per second of ``buf.sum()`` (a read of the whole tensor): the median of ``reads``."""
    times = []
    for _ in range(reads):
        start = time.perf_counter()
        buf.sum()
        times.append(time.perf_counter() - start)
    return buf.numel() * buf.element_size() / statistics.median(times)


def call_seconds(fn: Callable[[], object], calls: int) -> float:
    """The median of ``calls`` timed calls (the caller warms up)."""
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(
    case: AttentionCase,
    kernels: dict[str, Kernels],
    kv_bytes: int,
    buf: torch.Tensor,
    rounds: int,
    calls: int,
) -> dict[str, Any]:
    q, kc, vc, meta, scale = case.query, case.key_cache, case.value_cache, case.meta, case.scale
    fns = {
        name: (lambda k=k: k.attention.forward(q, kc, vc, meta, scale))
        for name, k in kernels.items()
    }
    with torch.inference_mode():
        outs = {name: fn() for name, fn in fns.items()}  # warm-up, and the same answer
        tol = ATTN_TOL[q.dtype]
        torch.testing.assert_close(outs["cpu"], outs["torch"], atol=tol["atol"], rtol=tol["rtol"])
        bw = [read_bandwidth(buf)]
        samples: dict[str, list[tuple[float, float]]] = {name: [] for name in fns}
        for _ in range(rounds):
            for name, fn in fns.items():
                seconds = call_seconds(fn, calls)
                bw.append(read_bandwidth(buf))
                bound = kv_bytes / statistics.fmean(bw[-2:])
                samples[name].append((seconds, seconds / bound))
    result: dict[str, Any] = {"read_bytes_per_s": statistics.median(bw), "bandwidth_samples": bw}
    for name, s in samples.items():
        seconds = statistics.median(t for t, _ in s)
        result[name] = {
            "ms": seconds * 1e3,
            "of_bound": statistics.median(r for _, r in s),
            "kv_bytes_per_s": kv_bytes / seconds,
            "samples_ms": [t * 1e3 for t, _ in s],
            "samples_of_bound": [r for _, r in s],
        }
    return result


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--rounds", type=int, default=11, help="interleaved measurements of each")
    ap.add_argument("--calls", type=int, default=3, help="timed calls per measurement")
    ap.add_argument("--bandwidth-mib", type=int, default=1024, help="size of the summed tensor")
    ap.add_argument("--out", type=Path, default=None, help="write results JSON here")
    args = ap.parse_args()

    buf = torch.ones(args.bandwidth_mib * 2**20 // 4, dtype=torch.float32)
    rows = {}
    print(
        f"decode attention, batch {args.batch}, context {args.context}, {HEADS}/{KV_HEADS} heads, "
        f"head_dim {HEAD_DIM}, block {BLOCK_SIZE}, {torch.get_num_threads()} threads; "
        f"medians of {args.rounds} interleaved rounds"
    )
    print(
        f"{'dtype':<9}{'K/V MiB':>8}{'read GB/s':>10}{'bound ms':>9}"
        f"{'cpu ms':>8}{'x bound':>8}{'torch ms':>9}{'x bound':>8}"
    )
    for dtype_name in args.dtype:
        dtype = getattr(torch, dtype_name)
        cache_dir = envs.cache_dir() / "kernels"
        kernels = {
            name: select_kernels(name, torch.device("cpu"), dtype, HEAD_DIM, BLOCK_SIZE, cache_dir)
            for name in BACKENDS
        }
        case = make_case(
            [1] * args.batch,
            [args.context] * args.batch,
            HEADS,
            KV_HEADS,
            HEAD_DIM,
            dtype,
            BLOCK_SIZE,
            device="cpu",
        )
        esize = torch.empty((), dtype=dtype).element_size()
        kv_bytes = args.batch * args.context * KV_HEADS * HEAD_DIM * esize * 2
        r = measure(case, kernels, kv_bytes, buf, args.rounds, args.calls)
        del case
        r["kv_bytes"] = kv_bytes
        rows[dtype_name] = r
        bw = r["read_bytes_per_s"]
        print(
            f"{dtype_name:<9}{kv_bytes / 2**20:>8.0f}{bw / 1e9:>10.1f}{kv_bytes / bw * 1e3:>9.1f}"
            f"{r['cpu']['ms']:>8.1f}{r['cpu']['of_bound']:>7.2f}x"
            f"{r['torch']['ms']:>9.1f}{r['torch']['of_bound']:>7.2f}x",
            flush=True,
        )
    if args.out:
        record = {
            **provenance(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "shape": dict(heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, block=BLOCK_SIZE),
            "results": rows,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=2))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
