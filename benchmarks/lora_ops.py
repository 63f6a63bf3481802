"""The batched LoRA op on the CPU: which grouping is fastest for decode and for prefill.

    python benchmarks/lora_ops.py [--shape llama-h512] [--rank 16] [--max-loras 4] [--repeat 50]

For the fused q/k/v, gate/up and down linears of ``--shape`` (see throughput.py), the time of the
base linear, then of adding the LoRA delta of ``--max-loras`` adapters by:

    runs      engine_svc.lora.ops.add_lora on consecutive tokens per adapter (slices, no copies)
    sorted    the same op when adapters are interleaved token by token (one sort, a gather, one
              index_add_)
    gather    every token gathers its own A and B (Punica's BGMV; add_lora_gather)
    dense     one matmul pair over all slots, the other slots' columns masked to zero

at decode (T = batch rows, one token each) and prefill (T = chunk tokens) sizes, with 1 and
``--max-loras`` adapters active. Prints milliseconds per call and the delta's cost relative to
the base linear.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from throughput import SHAPES  # noqa: E402

from engine_svc.lora.ops import LoRAMapping, add_lora, add_lora_gather  # noqa: E402


def timed(fn: Callable[[], object], repeat: int) -> float:
    """Milliseconds per call: the best of 5 rounds of ``repeat`` calls (a shared machine's noise
    only ever adds time)."""
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(repeat):
            fn()
        best = min(best, (time.perf_counter() - start) / repeat * 1e3)
    return best


def linears(shape: dict) -> dict[str, tuple[int, tuple[int, ...]]]:
    """name -> (in, shard widths)."""
    hidden, inter = shape["hidden_size"], shape["intermediate_size"]
    heads, kv = shape["num_attention_heads"], shape["num_key_value_heads"]
    hd = shape.get("head_dim") or hidden // heads
    return {
        "qkv_proj": (hidden, (heads * hd, kv * hd, kv * hd)),
        "gate_up_proj": (hidden, (inter, inter)),
        "down_proj": (inter, (hidden,)),
    }


def block_diagonal(b: torch.Tensor, sizes: tuple[int, ...]) -> torch.Tensor:
    """[S, R, out] side by side -> [S, n * R, out] block-diagonal (the dense variant's B)."""
    s, r, out = b.shape
    bd = torch.zeros(s, len(sizes) * r, out)
    offset = 0
    for i, width in enumerate(sizes):
        bd[:, i * r : (i + 1) * r, offset : offset + width] = b[:, :, offset : offset + width]
        offset += width
    return bd


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="llama-h512", choices=sorted(SHAPES))
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--max-loras", type=int, default=4)
    p.add_argument("--repeat", type=int, default=50)
    p.add_argument("--sizes", type=int, nargs="*", default=[64, 512, 2048])
    args = p.parse_args()
    torch.manual_seed(0)
    s = args.max_loras
    print(
        f"torch threads {torch.get_num_threads()}, shape {args.shape}, rank {args.rank}, "
        f"{s} slots; ms per call (delta cost / base linear)"
    )
    print(
        f"{'linear':<13}{'T':>6}{'act':>4}{'base':>9}{'runs':>16}{'sorted':>16}"
        f"{'gather':>16}{'dense':>16}"
    )
    with torch.inference_mode():
        for name, (fin, sizes) in linears(SHAPES[args.shape]).items():
            fout, k = sum(sizes), len(sizes) * args.rank
            w = torch.randn(fout, fin) * 0.02
            a = torch.randn(s, fin, k) * 0.02
            b = torch.randn(s, args.rank, fout) * 0.02
            a_all = a.permute(1, 0, 2).reshape(fin, s * k).contiguous()
            b_all = block_diagonal(b, sizes).reshape(s * k, fout).contiguous()
            for t in args.sizes:
                x = torch.randn(t, fin)
                y = x @ w.t()
                base = timed(partial(torch.mm, x, w.t()), args.repeat)
                for active in sorted({1, s}):
                    grouped = np.repeat(np.arange(active), -(-t // active))[:t]
                    interleaved = np.arange(t) % active
                    runs = LoRAMapping.build(grouped, x.device)
                    mixed = LoRAMapping.build(interleaved, x.device)
                    assert runs is not None and mixed is not None
                    slots_t = torch.from_numpy(interleaved)
                    onehot = torch.zeros(t, s, k)
                    onehot[torch.arange(t), slots_t] = 1.0
                    mask = onehot.reshape(t, s * k)
                    cells = [
                        timed(partial(add_lora, y, x, runs, a, b, sizes), args.repeat),
                        timed(partial(add_lora, y, x, mixed, a, b, sizes), args.repeat),
                        timed(partial(add_lora_gather, y, x, slots_t, a, b, sizes), args.repeat),
                        timed(partial(dense, y, x, mask, a_all, b_all), args.repeat),
                    ]
                    row = "".join(f"{c:>8.3f} ({c / base:>4.0%})" for c in cells)
                    print(f"{name:<13}{t:>6}{active:>4}{base:>9.3f}{row}", flush=True)


def dense(
    y: torch.Tensor, x: torch.Tensor, mask: torch.Tensor, a_all: torch.Tensor, b_all: torch.Tensor
) -> None:
    """Every slot's delta for every token, the other slots' rank columns masked to zero."""
    y.addmm_(torch.mm(x, a_all).mul_(mask), b_all)


if __name__ == "__main__":
    main()
