"""CUDA graphs for decode-only steps: one per batch size, captured at start, replayed per step.

Run eagerly, a decode step of a 28-layer model launches ~680 kernels from Python, and on an H200
that host work (22.5 ms) took 3x the GPU's (2026-11-27). Captured once per batch size, the whole
model forward replays as one graph launch that reads the step's inputs from the static buffers
(``step_inputs.StepBuffers``: the same device memory every step)::

    at start, after every kernel is compiled and loaded (kernels.attention_backends):
        for size in sizes, largest first, into one shared memory pool:
            fill the buffers with a dummy batch, run the forward eagerly once on the capture
            stream (warm-up), capture the forward over the buffers' views for size
        self-check: a dummy batch of real contexts, eager vs replay, compared
    per decode step of n rows: pad to the next size, copy inputs, replay, read hidden[:n]

What a graph holds: the model forward, with the attention metadata's host-side fields set to
their bounds (every context max_model_len long): a backend may capture only if its decode reads
lengths and block tables from the device alone (``graph_safe``). Not in a graph: steps with a
prompt chunk, LoRA or pooling rows, decode steps above the largest size, logits and sampling.

A capture that fails, or a replay that differs from the eager forward, is logged and the engine
serves eagerly (the caller, ``ModelRunner``, decides; this module raises).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from engine_svc.worker.step_inputs import StepBuffers
from kernels.attention_metadata import AttentionMetadata

logger = logging.getLogger(__name__)

# (input_ids, positions, meta) -> hidden states [num_tokens, hidden]
Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]

# Replay vs eager forward: the same kernels in the same order give the same bits. Allowed
# anyway, as the reduction order of a library GEMM may differ under capture: about one rounding
# step of the dtype, relative to the hidden state's scale.
_TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 2e-2}
# The self-check's K/V lives in at most this many blocks (random values written there at start:
# a bounded temporary per layer).
_CHECK_BLOCKS = 4096


class GraphMismatch(RuntimeError):
    """A replayed graph gave other hidden states than the eager forward."""


class Graph(Protocol):
    output: torch.Tensor  # written by every replay, at the same address

    def replay(self) -> None: ...


class GraphCapture(Protocol):
    """How a forward is captured: CUDA graphs on a GPU; a fake in CPU tests."""

    def capture(self, fn: Callable[[], torch.Tensor]) -> Graph:
        """Run ``fn`` eagerly once (a warm-up), then capture it."""
        ...


@dataclass
class _CudaGraph:
    graph: torch.cuda.CUDAGraph
    output: torch.Tensor

    def replay(self) -> None:
        self.graph.replay()


class CudaGraphCapture:
    """torch's CUDA graphs, all captured into one memory pool (one graph replays at a time, and
    its output is read before the next replays, so they may share memory)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device)

    def capture(self, fn: Callable[[], torch.Tensor]) -> Graph:
        # capture_begin/end rather than torch.cuda.graph, which synchronizes and may collect
        # garbage and empty the cache for every graph (seconds over dozens of sizes).
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize(self.device)  # the inputs, copied on the default stream
        with torch.cuda.stream(self.stream):
            # One eager run on the capture stream first: library handles and workspaces of
            # this stream, lazily loaded kernels, all set up outside the capture.
            fn()
            torch.cuda.synchronize(self.device)
            graph.capture_begin(pool=self.pool)
            try:
                output = fn()
            except BaseException:
                self._end_failed(graph)  # report the first error, not the invalid capture's
                raise
            try:
                graph.capture_end()
            except BaseException:
                self._close_pool()
                raise
        torch.cuda.synchronize(self.device)
        return _CudaGraph(graph, output)

    def _end_failed(self, graph: torch.cuda.CUDAGraph) -> None:
        try:
            graph.capture_end()
        except RuntimeError:
            self._close_pool()

    def _close_pool(self) -> None:
        """A capture_end that fails (an invalidated capture) throws before torch tells its
        allocator the capture is over; left so, the allocator refuses empty_cache() for good.
        Tell it here (best effort: a private binding torch.cuda.memory uses too)."""
        end = getattr(torch._C, "_cuda_endAllocateToPool", None)
        if end is None:
            return
        try:
            end(self.device.index, self.pool)
        except RuntimeError as e:
            logger.warning("could not end the failed capture's allocation to its pool: %s", e)


def capture_backend(device: torch.device) -> GraphCapture | None:
    """The capture for ``device``: CUDA graphs on CUDA, None elsewhere (CPU tests replace this
    function with a fake)."""
    return CudaGraphCapture(device) if device.type == "cuda" else None


class DecodeGraphs:
    """The captured graphs, by batch size."""

    def __init__(self, graphs: dict[int, Graph]) -> None:
        self._graphs = graphs
        self.sizes = sorted(graphs)

    def __contains__(self, size: object) -> bool:
        return size in self._graphs

    def replay(self, size: int) -> torch.Tensor:
        """Replay the graph of ``size`` rows over the buffers as they are; its hidden states
        (valid until the next replay)."""
        graph = self._graphs[size]
        graph.replay()
        return graph.output


def decode_metadata(
    buffers: StepBuffers, size: int, seq_lens: list[int] | None, max_context: int
) -> AttentionMetadata:
    """Metadata of a decode batch of ``size`` rows over the static buffers. ``seq_lens`` None:
    the bounds a graph is captured with (every context ``max_context`` long); the device-side
    buffers hold the real values either way."""
    lens = [max_context] * size if seq_lens is None else seq_lens
    return buffers.views(size, size).metadata(size, lens, list(range(size + 1)))


@dataclass(frozen=True)
class DummyBatch:
    """A decode batch written straight into the buffers: rows past ``len(seq_lens)`` are
    padding (position 0, one-token context, slot -1)."""

    input_ids: np.ndarray  # [n]
    seq_lens: np.ndarray  # [n] context including the new token
    block_tables: np.ndarray  # [n, blocks] int32


def write_decode_batch(
    buffers: StepBuffers, batch: DummyBatch, size: int, block_size: int
) -> list[int]:
    """Fill the buffers with ``batch`` padded to ``size`` rows and copy them to the device;
    returns the host-side sequence lengths of the ``size`` rows."""
    n = len(batch.seq_lens)
    pos = batch.seq_lens.astype(np.int64) - 1
    h = buffers.host(size, size)
    h["input_ids"][:size] = 0
    h["input_ids"][:n] = batch.input_ids
    h["positions"][:size] = 0
    h["positions"][:n] = pos
    h["slot_mapping"][:size] = -1
    h["slot_mapping"][:n] = batch.block_tables[np.arange(n), pos // block_size] * block_size
    h["slot_mapping"][:n] += pos % block_size
    h["seq_lens"][:size] = 1
    h["seq_lens"][:n] = batch.seq_lens
    h["query_start_loc"][: size + 1] = np.arange(size + 1)
    h["block_tables"][:size, 0] = 0
    h["block_tables"][:n, : batch.block_tables.shape[1]] = batch.block_tables
    buffers.commit(size, size)
    return [int(x) for x in batch.seq_lens] + [1] * (size - n)


def capture_decode_graphs(
    sizes: list[int],
    forward: Forward,
    buffers: StepBuffers,
    capture: GraphCapture,
    max_context: int,
    block_size: int,
) -> DecodeGraphs:
    """One graph per size, largest first (the smaller ones then fit in the memory the largest
    left in the pool), over a dummy batch of padding rows (nothing written to the KV cache)."""
    start = time.perf_counter()
    graphs: dict[int, Graph] = {}
    empty = np.zeros((0, 1), np.int32)
    for size in sorted(sizes, reverse=True):
        write_decode_batch(buffers, DummyBatch(empty[:, 0], empty[:, 0], empty), size, block_size)
        meta = decode_metadata(buffers, size, None, max_context)
        views = buffers.views(size, size)
        ids, pos = views.input_ids, views.positions
        graphs[size] = capture.capture(functools.partial(forward, ids, pos, meta))
    logger.info(
        "captured %d CUDA graphs for decode batches of %s rows in %.2f s",
        len(graphs),
        _ranges(sorted(graphs)),
        time.perf_counter() - start,
    )
    return DecodeGraphs(graphs)


def check_against_eager(
    graphs: DecodeGraphs,
    forward: Forward,
    buffers: StepBuffers,
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    size: int,
    max_context: int,
    vocab_size: int,
) -> float:
    """Replay the graph of ``size`` rows on a padded dummy batch of real contexts (crossing
    blocks and split-K partitions, over random K/V in blocks nobody holds yet: this runs at
    start) and compare with the eager forward of the same batch. Returns the largest difference
    relative to the hidden states' scale; GraphMismatch when it is over the tolerance."""
    block_size = kv_caches[0][0].shape[1]
    num_blocks = min(kv_caches[0][0].shape[0], _CHECK_BLOCKS)
    batch = _dummy_batch(max(size - 1, 1), max_context, block_size, num_blocks, vocab_size)
    used = torch.from_numpy(np.unique(batch.block_tables).astype(np.int64)).to(
        kv_caches[0][0].device
    )
    gen = torch.Generator(device=used.device).manual_seed(0)
    for key, value in kv_caches:
        for cache in (key, value):
            noise = torch.randn(
                (len(used), *cache.shape[1:]), generator=gen, device=used.device, dtype=cache.dtype
            )
            cache.index_copy_(0, used, noise)
    lens = write_decode_batch(buffers, batch, size, block_size)
    n = len(batch.seq_lens)
    meta = decode_metadata(buffers, size, lens, max_context)
    views = buffers.views(size, size)
    eager = forward(views.input_ids, views.positions, meta)[:n].clone()
    replayed = graphs.replay(size)[:n]
    diff = (replayed.float() - eager.float()).abs().max().item()
    scale = max(eager.float().abs().max().item(), 1.0)
    tolerance = _TOLERANCE.get(eager.dtype, 1e-4)
    if not diff / scale <= tolerance:  # NaN fails too
        raise GraphMismatch(
            f"the graph of {size} rows differs from the eager forward by {diff:.3g} "
            f"(hidden states up to {scale:.3g}; tolerance {tolerance:g} of that)"
        )
    return diff / scale


def capture_checked(
    sizes: list[int],
    forward: Forward,
    buffers: StepBuffers,
    capture: GraphCapture,
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    max_context: int,
    vocab_size: int,
) -> DecodeGraphs:
    """Capture every size, then check two against the eager forward: the largest, and the
    smallest padded one (its row splits into several partitions); raises what fails."""
    block_size = kv_caches[0][0].shape[1]
    graphs = capture_decode_graphs(sizes, forward, buffers, capture, max_context, block_size)
    checks = [sizes[-1], *[b for b in sizes if 1 < b < sizes[-1]][:1]]
    errors = [
        check_against_eager(graphs, forward, buffers, kv_caches, size, max_context, vocab_size)
        for size in checks
    ]
    logger.info(
        "CUDA graphs checked against the eager forward at %s rows: %s",
        ", ".join(map(str, checks)),
        ", ".join("identical" if err == 0 else f"within {err:.2g}" for err in errors),
    )
    return graphs


def _dummy_batch(
    n: int, max_context: int, block_size: int, num_blocks: int, vocab_size: int
) -> DummyBatch:
    """``n`` rows with contexts of 1 to ~2,100 tokens, the first the longest (so a batch of
    one row splits into several partitions of the split-K decode, and crosses blocks),
    fitting the blocks there are (distinct blocks per row)."""
    rng = np.random.default_rng(0)
    longest = min(max_context, 2113, max(1, (num_blocks * block_size) // n))
    seq_lens = longest - (np.arange(n) * 977) % longest  # the first row: the longest
    need = -(-seq_lens // block_size)
    while need.sum() > num_blocks:  # too few blocks for this many rows: shorter contexts
        seq_lens = np.maximum(seq_lens // 2, 1)
        need = -(-seq_lens // block_size)
    ids = rng.permutation(num_blocks)[: need.sum()].astype(np.int32)
    tables = np.zeros((n, int(need.max())), np.int32)
    at = 0
    for row, k in enumerate(need):
        tables[row, :k] = ids[at : at + k]
        at += int(k)
    return DummyBatch(rng.integers(0, vocab_size, n), seq_lens.astype(np.int32), tables)


def _ranges(sizes: list[int]) -> str:
    return f"{sizes[0]}..{sizes[-1]}" if len(sizes) > 3 else ", ".join(map(str, sizes))
