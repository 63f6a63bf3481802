"""Decode CUDA graphs, with a fake capture standing in for CUDA (``engine_svc.worker.cuda_graphs``).

The fake replays a graph the way CUDA does as far as the model can tell: it runs the captured
forward again over the same static buffers, with the metadata it was captured with (host-side
fields at their bounds), and writes the result into the output tensor of the capture. So these
tests show on the CPU that decode steps padded to the graph sizes and replayed give the tokens of
unpadded eager steps, that a replay reads each step's inputs from the same tensors, that padding
rows write no KV, and that every way a capture can go wrong leaves the engine serving eagerly.
The bit-for-bit checks on real graphs are in tests/gpu/test_cuda_graphs.py.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from engine_svc import LLM, SamplingParams
from engine_svc.worker import cuda_graphs, model_runner
from engine_svc.worker.step_inputs import StepInputs, graph_sizes
from tests.parity.hf_reference import hf_greedy, load_hf


class FakeGraph:
    def __init__(self, fn: Callable[[], torch.Tensor], capture: FakeCapture) -> None:
        self.fn, self.capture = fn, capture
        self.output = fn()

    def replay(self) -> None:
        self.capture.replays += 1
        self.output.copy_(self.fn() + self.capture.replay_error)


class FakeCapture:
    """Captures by running the forward once; replays by running it again into the same output."""

    def __init__(self, fail_at: int | None = None, replay_error: float = 0.0) -> None:
        self.fail_at, self.replay_error = fail_at, replay_error
        self.captured: list[FakeGraph] = []
        self.replays = 0

    def capture(self, fn: Callable[[], torch.Tensor]) -> FakeGraph:
        if self.fail_at is not None and len(self.captured) == self.fail_at:
            raise RuntimeError("operation not permitted when stream is capturing")
        graph = FakeGraph(fn, self)
        self.captured.append(graph)
        return graph


@pytest.fixture
def fake_capture(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeCapture]:
    capture = FakeCapture()
    monkeypatch.setattr(cuda_graphs, "capture_backend", lambda device: capture)
    yield capture


def _prompts(lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 384) for _ in range(n)] for n in lengths]


def _llm(model_dir: Path, **kw: object) -> LLM:
    args: dict[str, object] = dict(
        dtype="float32", num_kv_blocks=40, max_num_seqs=6, max_num_batched_tokens=32
    )
    args.update(kw)
    return LLM(model_dir, **args)  # type: ignore[arg-type]


def _greedy(llm: LLM, prompts: list[list[int]], n: int = 12) -> list[list[int]]:
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_graph_sizes_follow_vllms_flag() -> None:
    assert graph_sizes(64, None) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert graph_sizes(1024, None)[-1] == 512  # the default stops at 512
    assert graph_sizes(64, (16,)) == [1, 2, 4, 8, 16]  # one value: the largest
    assert graph_sizes(64, (200,))[-1] == 64  # never above max_num_seqs
    assert graph_sizes(64, (32, 1, 8, 100)) == [1, 8, 32]  # several: exactly those


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_replayed_decodes_give_the_eager_tokens(
    tiny_models: dict[str, Path], fake_capture: FakeCapture, arch: str
) -> None:
    model_dir = tiny_models[arch]
    # 5 requests over 6 graph sizes (1, 2, 4, 6): batches of 5, 4, 3... padded as they finish;
    # a shared prefix (prefix cache), a small budget (chunked prefill), few blocks (preemption).
    shared = _prompts([20], 1)[0]
    prompts = [shared + p for p in _prompts([3, 9, 1], 2)] + _prompts([30, 2], 3)
    llm = _llm(model_dir, pad_decode_batches=True)
    graphs = llm.engine.runner.graphs
    assert graphs is not None and graphs.sizes == [1, 2, 4, 6]
    assert len(fake_capture.captured) == 4
    replays_at_start = fake_capture.replays  # the self-check's
    got = _greedy(llm, prompts, 20)
    assert fake_capture.replays - replays_at_start > 10  # decode steps replayed
    eager = _greedy(_llm(model_dir, pad_decode_batches=False), prompts, 20)
    assert got == eager
    hf = load_hf(model_dir)
    assert got == [hf_greedy(hf, p, 20, stop_at_eos=False) for p in prompts]


def test_a_replay_reads_the_step_from_the_buffers_it_was_captured_over(
    tiny_models: dict[str, Path], fake_capture: FakeCapture, monkeypatch: pytest.MonkeyPatch
) -> None:
    llm = _llm(tiny_models["qwen3"], pad_decode_batches=True)
    runner = llm.engine.runner
    steps: list[StepInputs] = []
    build = model_runner.build_step

    def spy(*args: object, **kwargs: object) -> StepInputs:
        step = build(*args, **kwargs)  # type: ignore[arg-type]
        steps.append(step)
        return step

    monkeypatch.setattr(model_runner, "build_step", spy)
    _greedy(llm, _prompts([5, 7, 11], 4), 6)
    decodes = [s for s in steps if s.decode_only]
    assert decodes and all(s.meta.num_reqs == 4 for s in decodes)  # 3 rows padded to 4
    graph = fake_capture.captured[runner.buckets[::-1].index(4)]
    captured_args = graph.fn.args  # type: ignore[attr-defined]
    ids, pos, meta = captured_args
    for step in decodes:
        assert step.input_ids.data_ptr() == ids.data_ptr()
        assert step.positions.data_ptr() == pos.data_ptr()
        for name in ("slot_mapping", "block_tables", "seq_lens", "query_start_loc"):
            assert getattr(step.meta, name).data_ptr() == getattr(meta, name).data_ptr(), name
        assert step.meta.block_tables.stride() == meta.block_tables.stride()
    # The capture's host-side fields are the bounds, not any step's lengths.
    assert meta.seq_lens_cpu == [runner.max_model_len] * 4


def test_padding_rows_write_no_kv(
    tiny_models: dict[str, Path], fake_capture: FakeCapture, monkeypatch: pytest.MonkeyPatch
) -> None:
    llm = _llm(tiny_models["llama"], pad_decode_batches=True)
    runner = llm.engine.runner
    checked = []
    forward = runner._forward

    def watched(step: StepInputs, lora: object, pooling: bool) -> torch.Tensor:
        before = [k.clone() for kv in runner.kv_caches for k in kv]
        hidden = forward(step, lora, pooling)  # type: ignore[arg-type]
        if step.num_padded_reqs:
            real = step.meta.slot_mapping[: step.meta.num_reqs - step.num_padded_reqs]
            for old, new in zip(before, (k for kv in runner.kv_caches for k in kv), strict=True):
                changed = (old != new).flatten(2).any(-1).flatten().nonzero().flatten()
                assert set(changed.tolist()) <= set(real.tolist())
            assert (step.meta.slot_mapping[-step.num_padded_reqs :] == -1).all()
            checked.append(step.num_padded_reqs)
        return hidden

    monkeypatch.setattr(runner, "_forward", watched)
    _greedy(llm, _prompts([5, 9, 3], 5), 5)
    assert checked and fake_capture.replays > 0


def test_a_capture_that_raises_leaves_the_engine_eager(
    tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    capture = FakeCapture(fail_at=2)
    monkeypatch.setattr(cuda_graphs, "capture_backend", lambda device: capture)
    with caplog.at_level(logging.WARNING, logger="engine_svc.worker.model_runner"):
        llm = _llm(tiny_models["llama"], pad_decode_batches=True)
    assert llm.engine.runner.graphs is None
    assert "CUDA graphs off (RuntimeError: operation not permitted" in caplog.text
    assert "serving eagerly" in caplog.text
    prompts = _prompts([4, 6], 6)
    assert _greedy(llm, prompts) == _greedy(_llm(tiny_models["llama"]), prompts)
    assert capture.replays == 0


def test_a_replay_that_differs_from_eager_leaves_the_engine_eager(
    tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    capture = FakeCapture(replay_error=0.5)
    monkeypatch.setattr(cuda_graphs, "capture_backend", lambda device: capture)
    with caplog.at_level(logging.WARNING, logger="engine_svc.worker.model_runner"):
        llm = _llm(tiny_models["qwen3"], pad_decode_batches=True)
    assert llm.engine.runner.graphs is None
    assert "GraphMismatch" in caplog.text and "differs from the eager forward" in caplog.text
    replays = capture.replays  # the self-check's one
    prompts = _prompts([4, 6], 7)
    assert _greedy(llm, prompts) == _greedy(_llm(tiny_models["qwen3"]), prompts)
    assert capture.replays == replays


def test_the_self_check_passes_an_exact_replay(
    tiny_models: dict[str, Path], fake_capture: FakeCapture, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="engine_svc.worker.cuda_graphs"):
        llm = _llm(tiny_models["qwen3"], pad_decode_batches=True)
    assert llm.engine.runner.graphs is not None
    assert "checked against the eager forward at 6, 2 rows: identical, identical" in caplog.text


def test_enforce_eager_and_unsafe_backends_capture_nothing(
    tiny_models: dict[str, Path], fake_capture: FakeCapture, caplog: pytest.LogCaptureFixture
) -> None:
    llm = _llm(tiny_models["llama"], pad_decode_batches=True, enforce_eager=True)
    assert llm.engine.runner.graphs is None and not fake_capture.captured
    with caplog.at_level(logging.WARNING, logger="engine_svc.worker.model_runner"):
        llm = _llm(tiny_models["llama"], pad_decode_batches=True, attention_backend="torch")
    assert llm.engine.runner.graphs is None and not fake_capture.captured
    assert "the torch attention backend cannot be captured" in caplog.text


def test_sizes_above_the_largest_graph_run_eagerly(
    tiny_models: dict[str, Path], fake_capture: FakeCapture
) -> None:
    llm = _llm(tiny_models["llama"], pad_decode_batches=True, cuda_graph_sizes=(2,))
    assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.sizes == [1, 2]
    prompts = _prompts([3, 5, 8, 2], 8)
    got = _greedy(llm, prompts)
    assert got == _greedy(_llm(tiny_models["llama"]), prompts)


def test_graphs_are_captured_again_after_sleep(
    tiny_models: dict[str, Path], fake_capture: FakeCapture
) -> None:
    llm = _llm(tiny_models["qwen3"], pad_decode_batches=True)
    prompts = _prompts([6, 3], 9)
    before = _greedy(llm, prompts)
    first = list(fake_capture.captured)
    llm.sleep(1)
    assert llm.engine.runner.graphs is None  # they held the freed KV cache
    llm.wake_up()
    graphs = llm.engine.runner.graphs
    assert graphs is not None and len(fake_capture.captured) == 2 * len(first)
    assert _greedy(llm, prompts) == before


def test_a_failed_cuda_capture_ends_its_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """An invalidated capture throws from capture_end before torch closes the pool's allocation;
    left open, the allocator would refuse empty_cache() (and the eager fallback) for good."""
    capture = object.__new__(cuda_graphs.CudaGraphCapture)  # no CUDA here: the logic only
    capture.device, capture.pool = torch.device("cuda", 0), (0, 7)
    ended: list[tuple[int | None, tuple[int, int]]] = []
    monkeypatch.setattr(
        torch._C, "_cuda_endAllocateToPool", lambda d, p: ended.append((d, p)), raising=False
    )

    class Invalidated:
        def capture_end(self) -> None:
            raise RuntimeError("operation failed due to a previous error during capture")

    capture._end_failed(Invalidated())  # type: ignore[arg-type]
    assert ended == [(0, (0, 7))]


def test_graph_sizes_all_above_max_num_seqs_capture_nothing_and_say_so(
    tiny_models: dict[str, Path], fake_capture: FakeCapture, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="engine_svc.worker.model_runner"):
        llm = _llm(tiny_models["llama"], pad_decode_batches=True, cuda_graph_sizes=(100, 200))
    assert llm.engine.runner.graphs is None and not fake_capture.captured
    assert "no --cuda-graph-sizes value is at most max_num_seqs (6)" in caplog.text
    prompts = _prompts([3, 5], 10)
    assert _greedy(llm, prompts) == _greedy(_llm(tiny_models["llama"]), prompts)


def test_verification_steps_are_decode_rows_and_replay_the_graphs(
    tiny_models: dict[str, Path], fake_capture: FakeCapture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With speculation, a step of decodes and verifications is attended one row per token (each
    over its request's block table, its context ending at itself), padded to a graph size and
    replayed; the tokens are those of eager steps without speculation, and transformers'."""
    model_dir = tiny_models["llama"]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    llm = _llm(model_dir, pad_decode_batches=True, speculative_config=spec, num_kv_blocks=80)
    runner = llm.engine.runner
    assert runner.buckets[-1] == 6 * 4  # max_num_seqs rows of 1 + 3 tokens
    steps: list[StepInputs] = []
    computed: list[list[int]] = []  # each step's requests' computed tokens, as it was built
    build = model_runner.build_step

    def spy(*args: object, **kwargs: object) -> StepInputs:
        steps.append(build(*args, **kwargs))  # type: ignore[arg-type]
        computed.append([r.request.num_computed_tokens for r in steps[-1].batch])
        return steps[-1]

    monkeypatch.setattr(model_runner, "build_step", spy)
    rng = random.Random(7)
    spans = [[rng.randrange(4, 300) for _ in range(rng.randint(3, 6))] for _ in range(4)]
    prompts = [s * 4 for s in spans]  # repeated spans: the n-gram proposer finds them
    replays_at_start = fake_capture.replays
    got = _greedy(llm, prompts, 20)
    verifying = [
        (s, c)
        for s, c in zip(steps, computed, strict=True)
        if any(r.spec_token_ids for r in s.batch)
    ]
    assert verifying and all(s.decode_only for s, _ in verifying)
    replayed = fake_capture.replays - replays_at_start
    assert replayed >= len(verifying)  # each (at most the largest graph's rows) replayed
    for step, starts in verifying:
        meta, num_tokens = step.meta, sum(r.num_tokens for r in step.batch)
        assert meta.num_reqs == meta.num_tokens >= num_tokens  # one row per token (padded)
        at = 0
        for r, last, start in zip(step.batch, step.last_index.tolist(), starts, strict=True):
            assert meta.seq_lens_cpu[at : at + r.num_tokens] == list(
                range(start + 1, start + r.num_tokens + 1)
            )
            assert last == at + r.num_tokens - 1
            at += r.num_tokens
    plain = _greedy(_llm(model_dir, pad_decode_batches=False, num_kv_blocks=80), prompts, 20)
    assert got == plain
    hf = load_hf(model_dir)
    assert got == [hf_greedy(hf, p, 20, stop_at_eos=False) for p in prompts]
