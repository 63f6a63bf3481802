"""The CUDA graph flags, as vLLM names them: ``--enforce-eager``, ``--cuda-graph-sizes`` (one value:
the largest; several: the list) and ``--max-cuda-graph-batch-size``; bad values are refused
before anything loads, naming the flag."""

from __future__ import annotations

import pytest

from engine_svc.__main__ import _cuda_graph_sizes, main, parse_args
from engine_svc.config import EngineConfig, ModelConfig


def test_flags_reach_the_config() -> None:
    args = parse_args(["--enforce-eager", "--cuda-graph-sizes", "1", "8", "32"])
    assert args.enforce_eager and _cuda_graph_sizes(args) == (1, 8, 32)
    args = parse_args(["--max-cuda-graph-batch-size", "64"])
    assert not args.enforce_eager and _cuda_graph_sizes(args) == (64,)
    assert _cuda_graph_sizes(parse_args([])) is None


def test_tensor_parallel_size_reaches_the_config() -> None:
    assert parse_args([]).tensor_parallel_size == 1
    assert parse_args(["-tp", "2"]).tensor_parallel_size == 2  # vLLM's short form
    assert parse_args(["--tensor-parallel-size", "4"]).tensor_parallel_size == 4


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--cuda-graph-sizes", "8", "--max-cuda-graph-batch-size", "8"], "not both"),
        (["--cuda-graph-sizes", "0"], "at least 1"),
        (["--max-cuda-graph-batch-size", "-4"], "at least 1"),
        (["--tensor-parallel-size", "0"], "--tensor-parallel-size must be at least 1"),
    ],
)
def test_bad_graph_flags_exit_with_a_message(argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit, match=message):
        main(argv)


def test_the_config_refuses_bad_sizes() -> None:
    model = ModelConfig("unused")
    assert EngineConfig(model, cuda_graph_sizes=(4,)).cuda_graph_sizes == (4,)
    for sizes in [(), (0,), (4, -1)]:
        with pytest.raises(ValueError, match="cuda_graph_sizes must be positive"):
            EngineConfig(model, cuda_graph_sizes=sizes)
