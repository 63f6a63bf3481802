"""Timing on a CUDA device for the kernel benchmarks, and the limits they are compared against,
measured in the same run: device-to-device copy bandwidth and the dense GEMM rate.

``graph_ms`` captures ``iters`` calls in one CUDA graph and times its replay, so the Python
wrapper and the launch calls are not in the figure (the kernel's own time, as the engine's
graph replay sees it); ``events_ms`` times eager calls between two CUDA events (for what cannot
be captured: a call that syncs or allocates from the host).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def events_ms(fn: Callable[[], object], iters: int = 20, warmup: int = 3) -> float:
    """Mean milliseconds per call of ``fn`` run eagerly ``iters`` times."""
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def graph_ms(fn: Callable[[], object], iters: int = 20, replays: int = 5) -> float:
    """Mean milliseconds per call of ``fn``, ``iters`` calls captured in one CUDA graph and the
    graph replayed ``replays`` times (the first replay is a warm-up)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compile/load outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    graph.replay()
    ms = events_ms(graph.replay, iters=replays, warmup=1)
    del graph
    return ms / iters


def copy_bandwidth() -> float:
    """Bytes per second of a device-to-device copy of 1 GiB, counting read + write."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = events_ms(lambda: dst.copy_(src))
    return 2 * src.numel() / (ms / 1e3)


def gemm_flops(dtype: torch.dtype = torch.bfloat16, n: int = 8192) -> float:
    """FLOP/s of an n x n x n matmul in ``dtype`` (cuBLAS, tensor cores)."""
    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn(n, n, device="cuda", dtype=dtype)
    ms = events_ms(lambda: a @ b, iters=10)
    return 2 * n**3 / (ms / 1e3)
