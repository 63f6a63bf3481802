"""Decode attention on a GPU: the CUDA kernel (paged_decode.cu) against the device-to-device copy
bandwidth measured in the same run.

    python benchmarks/kernels_decode.py [--dtype bfloat16] [--out benchmarks/results/x.json]

Head shapes: Qwen3-0.6B (16 query heads, 8 KV heads) and Llama-3-8B (32/8), head_dim 128,
block size 16; batch 1, 64 and 256 with every request at the same context (512 .. 8192), and a
batch of 256 mixed lengths (uniform in 64 .. 4096). The kernel runs as the engine runs it: int32
block tables, the split-K partition count from ``cuda_ops.decode_partitions`` (for the batch and
its longest context; reported as P), a preallocated ``DecodeWorkspace``; the kernel and its tiled
variant (``tiled_decode``) on the same inputs, each timed as a CUDA graph of
20 launches replayed (``benchmarks.gpu_timing.graph_ms``: no Python wrapper in the figure).
Achieved bandwidth counts the bytes the kernel must move (K and V of every context token, the
query, the output); the copy bandwidth is read + write of a 1 GiB ``tensor.copy_()``. The
issue's target: >= 80 % of it at contexts >= 2048 (batch 64 and 256), >= 60 % at 512. CUDA only.

    python benchmarks/kernels_decode.py --sweep [--out x.json]

times every split-K partition count (1, 2, 4, 8, and the rule's) and every query heads per
thread block (``queries_per_block``: 1, 2, 4, 8 dividing the GQA group) for each case instead,
and prints the rule's choice beside the fastest: the data behind ``decode_partitions`` and
``_queries_per_block`` (a tuning choice: every combination gives the same result).
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu_timing import copy_bandwidth, graph_ms  # noqa: E402
from kernels import cuda_ops  # noqa: E402
from tests.gpu.helpers import make_case  # noqa: E402

HEAD_SHAPES = {"qwen3-0.6b": (16, 8), "llama-3-8b": (32, 8)}
HEAD_DIM = 128
I32 = torch.int32  # the engine's block tables and lengths


def decode_case(heads: tuple[int, int], lens: list[int], dtype: torch.dtype) -> tuple:
    """(query, key cache, value cache, metadata, scale, bytes the kernel must move) of one
    decode batch with contexts ``lens``."""
    h, hkv = heads
    case = make_case([1] * len(lens), lens, h, hkv, HEAD_DIM, dtype, index_dtype=I32)
    esize = case.query.element_size()
    moved = sum(lens) * hkv * HEAD_DIM * esize * 2 + 2 * case.query.numel() * esize
    return case.query, case.key_cache, case.value_cache, case.meta, case.scale, moved


def measure(heads: tuple[int, int], lens: list[int], dtype: torch.dtype, copy_bw: float) -> dict:
    h, hkv = heads
    batch = len(lens)
    q, kc, vc, meta, scale, moved = decode_case(heads, lens, dtype)
    parts = cuda_ops.decode_partitions(batch, h, hkv, max(lens), cuda_ops.num_sms(q.device))
    ws = cuda_ops.DecodeWorkspace(batch, h, HEAD_DIM, parts, q.device)
    out = torch.empty_like(q)
    row: dict = dict(heads=h, kv_heads=hkv, batch=batch, context=max(lens),
                     mean_context=sum(lens) / batch, partitions=parts)  # fmt: skip
    for name, tiled in (("kernel", False), ("tiled", True)):
        ms = graph_ms(
            lambda tiled=tiled: cuda_ops.paged_attention(
                q, kc, vc, meta, scale, out=out, partitions=parts, workspace=ws,
                tiled_decode=tiled,
            )
        )  # fmt: skip
        bw = moved / (ms / 1e3)
        row[f"{name}_ms"] = ms
        row[f"{name}_bytes_per_s"] = bw
        row[f"{name}_fraction_of_copy"] = bw / copy_bw
    return row


def sweep(heads: tuple[int, int], lens: list[int], dtype: torch.dtype, copy_bw: float) -> dict:
    """Every partition count x queries per block on one case (see the module's docstring)."""
    h, hkv = heads
    batch = len(lens)
    q, kc, vc, meta, scale, moved = decode_case(heads, lens, dtype)
    rule_p = cuda_ops.decode_partitions(batch, h, hkv, max(lens), cuda_ops.num_sms(q.device))
    rule_q = cuda_ops._queries_per_block(h // hkv)
    counts = sorted({1, 2, 4, 8, rule_p})
    ws = cuda_ops.DecodeWorkspace(batch, h, HEAD_DIM, max(counts), q.device)
    out = torch.empty_like(q)
    grid = []
    for qpb in (n for n in (1, 2, 4, 8) if (h // hkv) % n == 0):
        for parts in counts:
            ms = graph_ms(
                lambda p=parts, n=qpb: cuda_ops.paged_attention(
                    q, kc, vc, meta, scale, out=out, partitions=p, workspace=ws,
                    queries_per_block=n,
                )
            )  # fmt: skip
            grid.append(dict(partitions=parts, queries_per_block=qpb, ms=ms,
                             fraction_of_copy=moved / (ms / 1e3) / copy_bw))  # fmt: skip
    rule = next(g for g in grid if g["partitions"] == rule_p and g["queries_per_block"] == rule_q)
    best = min(grid, key=lambda g: g["ms"])
    return dict(heads=h, kv_heads=hkv, batch=batch, context=max(lens),
                mean_context=sum(lens) / batch, rule=rule, best=best, grid=grid)  # fmt: skip


def main_sweep(args: argparse.Namespace, dtype: torch.dtype, copy_bw: float) -> list[dict]:
    print(f"{'heads':>6} {'batch':>5} {'ctx':>6} {'rule P/q':>9} {'ms':>7} {'of copy':>7} "
          f"{'best P/q':>9} {'ms':>7} {'of copy':>7}")  # fmt: skip
    rows = []
    mixed = [random.Random(0).randint(64, 4096) for _ in range(256)]
    for shape in args.shapes:
        heads = HEAD_SHAPES[shape]
        for lens in [[ctx] * b for b in args.batch for ctx in args.context] + [mixed]:
            row = sweep(heads, lens, dtype, copy_bw)
            row["shape"], row["mixed"] = shape, lens is mixed
            r, b = row["rule"], row["best"]
            ctx = "mixed" if lens is mixed else str(max(lens))
            print(f"{heads[0]:>3}/{heads[1]:<2} {len(lens):5d} {ctx:>6} "
                  f"{r['partitions']:>5}/{r['queries_per_block']:<3} {r['ms']:7.3f} "
                  f"{r['fraction_of_copy']:7.0%} {b['partitions']:>5}/{b['queries_per_block']:<3} "
                  f"{b['ms']:7.3f} {b['fraction_of_copy']:7.0%}")  # fmt: skip
            rows.append(row)
            torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16"])
    ap.add_argument("--shapes", nargs="+", default=list(HEAD_SHAPES), choices=list(HEAD_SHAPES))
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--context", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/kernels_decode.json"))
    ap.add_argument("--sweep", action="store_true", help="every partition count x queries/block")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("kernels_decode.py needs a CUDA device")
    dtype = getattr(torch, args.dtype)
    copy_bw = copy_bandwidth()
    device = torch.cuda.get_device_name()
    print(f"{device}; copy bandwidth {copy_bw / 1e9:.0f} GB/s (read + write); {args.dtype}")

    def write(**results: list[dict]) -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(dict(
            device=device, date=datetime.date.today().isoformat(), dtype=args.dtype,
            head_dim=HEAD_DIM, block_size=16, copy_bytes_per_s=copy_bw,
            command=" ".join(sys.argv), **results,
        ), indent=2))  # fmt: skip
        print(f"wrote {args.out}")

    if args.sweep:
        write(sweep=main_sweep(args, dtype, copy_bw))
        return
    print(f"{'heads':>6} {'batch':>5} {'ctx':>6} {'P':>3} {'kernel ms':>9} {'of copy':>7} "
          f"{'tiled ms':>9} {'of copy':>7}")  # fmt: skip
    rows = []
    mixed = [random.Random(0).randint(64, 4096) for _ in range(256)]
    for shape in args.shapes:
        heads = HEAD_SHAPES[shape]
        cases = [[ctx] * b for b in args.batch for ctx in args.context] + [mixed]
        for lens in cases:
            row = measure(heads, lens, dtype, copy_bw)
            row["shape"] = shape
            row["mixed"] = lens is mixed
            ctx = "mixed" if lens is mixed else str(max(lens))
            print(f"{heads[0]:>3}/{heads[1]:<2} {len(lens):5d} {ctx:>6} {row['partitions']:3d} "
                  f"{row['kernel_ms']:9.3f} {row['kernel_fraction_of_copy']:7.0%} "
                  f"{row['tiled_ms']:9.3f} {row['tiled_fraction_of_copy']:7.0%}")  # fmt: skip
            rows.append(row)
            torch.cuda.empty_cache()
    write(rows=rows)


if __name__ == "__main__":
    main()
