"""Decode attention on a GPU: the CUDA kernel (paged_decode.cu) against the measured
device-to-device copy bandwidth and against the torch reference, in one run on the same inputs.

    python benchmarks/kernels_decode.py [--dtype bfloat16] [--out benchmarks/results/x.json]

Shapes are Llama-3-8B's attention (32 query heads, 8 KV heads, head_dim 128), block size 16,
batch 64 and 256, every request with the same context length (512 .. 8192). The kernel runs as
the engine runs it: int32 block tables, the split-K partition count from
``cuda_ops.decode_partitions`` (for the batch and its context; reported as P) and a preallocated
``DecodeWorkspace``. Achieved bandwidth counts the bytes the kernel must move (K and V of every
context token, the query, the output); the copy bandwidth is read + write of a 1 GiB
tensor.copy_(). CUDA only: exits otherwise.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels import cuda_ops, reference  # noqa: E402
from tests.gpu.helpers import AttentionCase, make_case  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
I32 = torch.int32  # the engine's block tables and lengths


def _time_ms(fn: Callable[[], object], iters: int = 20) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def copy_bandwidth() -> float:
    """Bytes per second of a device-to-device copy, counting read + write."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = _time_ms(lambda: dst.copy_(src))
    return 2 * src.numel() / (ms / 1e3)


def _measure(case: AttentionCase, batch: int, ctx: int, esize: int, copy_bw: float) -> dict:
    q, kc, vc, meta, scale = case.query, case.key_cache, case.value_cache, case.meta, case.scale
    moved = batch * ctx * KV_HEADS * HEAD_DIM * esize * 2 + 2 * q.numel() * esize
    parts = cuda_ops.decode_partitions(batch, HEADS, KV_HEADS, ctx, cuda_ops.num_sms(q.device))
    ws = cuda_ops.DecodeWorkspace(batch, HEADS, HEAD_DIM, parts, q.device)
    out = torch.empty_like(q)
    ms = _time_ms(
        lambda: cuda_ops.paged_attention(
            q, kc, vc, meta, scale, out=out, partitions=parts, workspace=ws
        )
    )
    ref_ms: float | None
    try:
        ref_ms = _time_ms(lambda: reference.paged_attention(q, kc, vc, meta, scale), iters=3)
    except torch.OutOfMemoryError:
        ref_ms = None
    bw = moved / (ms / 1e3)
    ref_txt = f"{ref_ms:9.3f} {ref_ms / ms:6.1f}x" if ref_ms else f"{'oom':>9} {'-':>7}"
    print(f"{batch:5d} {ctx:5d} {parts:3d} {ms:9.3f} {bw / 1e9:6.0f} {bw / copy_bw:7.0%} {ref_txt}")
    return dict(batch=batch, context=ctx, partitions=parts, kernel_ms=ms, kernel_bytes_per_s=bw,
                fraction_of_copy=bw / copy_bw, torch_ms=ref_ms)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16"])
    ap.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--context", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/kernels_decode.json"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("kernels_decode.py needs a CUDA device")
    dtype = getattr(torch, args.dtype)
    esize = torch.empty((), dtype=dtype).element_size()
    copy_bw = copy_bandwidth()
    device = torch.cuda.get_device_name()
    print(f"{device}; copy bandwidth {copy_bw / 1e9:.0f} GB/s (read + write); {args.dtype}")
    print(f"{'batch':>5} {'ctx':>5} {'P':>3} {'kernel ms':>9} {'GB/s':>6} {'of copy':>7} "
          f"{'torch ms':>9} {'speedup':>7}")  # fmt: skip
    rows = []
    for batch in args.batch:
        for ctx in args.context:
            lens = [ctx] * batch
            case = make_case([1] * batch, lens, HEADS, KV_HEADS, HEAD_DIM, dtype, index_dtype=I32)
            row = _measure(case, batch, ctx, esize, copy_bw)
            del case
            torch.cuda.empty_cache()
            rows.append(row)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(
        device=device, date=datetime.date.today().isoformat(), dtype=args.dtype,
        heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, block_size=16,
        copy_bytes_per_s=copy_bw, rows=rows,
    ), indent=2))  # fmt: skip
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
