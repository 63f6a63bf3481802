"""benchmarks/gateway_relay.py: the stand-in engine's hand-encoded messages, and a tiny full run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from protos.tandem.engine.v1 import engine_pb2 as pb

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
from relay_client import GENERATION, MESSAGES, OUTPUTS, RECEIVED, Progress  # type: ignore[import-not-found]  # noqa: E402, I001
from relay_standins import StandInEngine, _ClientStream  # type: ignore[import-not-found]  # noqa: E402, I001


def _add(request_id: str, max_tokens: int) -> pb.AddRequest:
    params = pb.SamplingParams(max_tokens=max_tokens)
    return pb.AddRequest(request_id=request_id, prompt_token_ids=[5, 6, 7], sampling_params=params)


def test_stand_in_steps_are_valid_engine_core_outputs(tmp_path: Path) -> None:
    engine = StandInEngine(tmp_path, token_id=42, vocab_size=100, step_s=0.0, record=True)
    s = _ClientStream(0)
    engine._add(s, _add("a-0", 2))
    engine._add(s, _add("b-0", 1))
    first = pb.EngineCoreOutputs.FromString(engine._step(s))
    assert [(o.request_id, list(o.new_token_ids), o.finish_reason) for o in first.outputs] == [
        ("a-0", [42], pb.FINISH_REASON_UNSPECIFIED),
        ("b-0", [42], pb.FINISH_REASON_LENGTH),
    ]
    assert first.outputs[0].num_prompt_tokens == 3
    assert first.load.num_running_requests == 1 and first.timestamp > 0
    engine._add(s, _add("c-0", 5))
    second = pb.EngineCoreOutputs.FromString(engine._step(s))
    assert [(o.request_id, o.finish_reason) for o in second.outputs] == [
        ("a-0", pb.FINISH_REASON_LENGTH),
        ("c-0", pb.FINISH_REASON_UNSPECIFIED),
    ]
    engine._abort(s, ["c-0", "unknown"])
    third = pb.EngineCoreOutputs.FromString(engine._step(s))
    assert [(o.request_id, list(o.new_token_ids), o.finish_reason) for o in third.outputs] == [
        ("c-0", [], pb.FINISH_REASON_ABORT)
    ]
    assert engine.first_steps == {"a-0": (0, 0), "b-0": (0, 0), "c-0": (0, 1)}
    assert len(s.step_times) == 3


def test_lead_bound_follows_what_the_client_received(tmp_path: Path) -> None:
    board = Progress(Progress.create(tmp_path / "progress.bin"))
    engine = StandInEngine(
        tmp_path, 42, 100, step_s=0.0, record=False, progress=board, lead_steps=2
    )
    s = _ClientStream(0)
    engine.streams.append(s)
    for i in range(10):
        engine._add(s, _add(f"r{i}-0", 100))
    board.set(GENERATION, 7)
    assert not engine._ahead()
    engine._step(s)
    engine._step(s)
    assert not engine._ahead()  # 20 sent, 0 received: not more than 2 steps of 10
    engine._step(s)
    assert engine._ahead()
    board.set(RECEIVED, 15)
    assert not engine._ahead()
    assert (board.get(MESSAGES), board.get(OUTPUTS)) == (3, 30)
    board.set(GENERATION, 8)  # a new client: what the last one left unreceived is forgotten
    board.set(RECEIVED, 0)
    assert not engine._ahead()


def test_tiny_run_measures_every_system(tmp_path: Path) -> None:
    out = tmp_path / "relay.json"
    argv = [sys.executable, str(BENCHMARKS / "gateway_relay.py"), "--concurrency", "4"]
    argv += ["--duration", "0.6", "--warmup", "0.4", "--settle", "0", "--max-tokens", "16"]
    argv += ["--workers", "1", "--out", str(out)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    results = json.loads(out.read_text())["results"]
    points = {p["system"]: p for p in results["points"]}
    assert set(points) == {"bare", "gateway"}
    for p in points.values():
        assert p["tok_s"] > 0 and p["errors"] == 0, p
        assert p["cpu_s_per_1k_tok"]["server"] > 0
    assert points["gateway"]["cpu_s_per_1k_tok"]["engine"] > 0
    latency = results["paced"]["added_latency"]
    assert latency["tokens"] > 0 and latency["requests_joined"] > 0
    assert 0 < latency["min_ms"] <= latency["p50_ms"] <= latency["p99_ms"]  # received after sent
    assert results["ratios"]["4"]["tok_s"] > 0
