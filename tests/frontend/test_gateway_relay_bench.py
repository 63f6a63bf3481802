"""benchmarks/gateway_relay.py: the stand-in engine's hand-encoded messages, and a tiny full run."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from protos.tandem.engine.v1 import engine_pb2 as pb

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
from relay_client import GENERATION, MESSAGES, OUTPUTS, RECEIVED, Progress  # type: ignore[import-not-found]  # noqa: E402, I001
from relay_standins import StandInEngine, Ticker, _ClientStream  # type: ignore[import-not-found]  # noqa: E402, I001
from gateway_relay import chunk_capacity  # type: ignore[import-not-found]  # noqa: E402, I001


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


def test_a_merged_message_says_each_steps_tokens_as_the_engine_does(tmp_path: Path) -> None:
    """Held steps go out as one message with ``step_tokens`` (the real engine's StreamOutbox
    sends them), so the bench's gateway pays for the per-step metric as it does in service."""
    engine = StandInEngine(tmp_path, token_id=42, vocab_size=100, step_s=0.0, record=False)
    s = _ClientStream(0)
    engine._add(s, _add("a-0", 10))
    engine._step(s)  # a's first step, sent on its own: no step_tokens in a one-step message
    engine._hold(s)
    engine._add(s, _add("b-0", 10))
    engine._hold(s)  # b's first step: its 3 prompt tokens count in it
    engine._hold(s)
    merged = pb.EngineCoreOutputs.FromString(engine._flush(s))
    assert list(merged.step_tokens) == [1, 2 + 3, 2]  # a; a, b and its prompt; a, b
    tokens = {o.request_id: len(o.new_token_ids) for o in merged.outputs}
    assert tokens == {"a-0": 3, "b-0": 2}
    prompts = 3  # b's prompt, with its first token (the gateway counts it so)
    assert sum(merged.step_tokens) == sum(tokens.values()) + prompts
    engine._hold(s)
    single = pb.EngineCoreOutputs.FromString(engine._flush(s))  # one held step: none
    assert list(single.step_tokens) == []
    long = pb.AddRequest(request_id="c-0", prompt_token_ids=list(range(300)))
    long.sampling_params.max_tokens = 10
    engine._add(s, long)
    engine._hold(s)  # a count past one varint byte
    engine._hold(s)
    merged = pb.EngineCoreOutputs.FromString(engine._flush(s))
    assert list(merged.step_tokens) == [3 + 300, 3]


def test_bare_ticker_gives_every_stream_a_token_each_step() -> None:
    async def scenario() -> tuple[list[list[int]], dict[str, tuple[int, int]], int]:
        ticker = Ticker(step_s=0.0)
        a, b = ticker.add("cmpl-a", 3), ticker.add("cmpl-b", 1)
        got: list[list[int]] = [[], []]

        async def read(i: int, r: object) -> None:
            async for step in ticker.tokens(r):  # type: ignore[arg-type]
                got[i].append(step)

        readers = [asyncio.create_task(read(0, a)), asyncio.create_task(read(1, b))]
        await asyncio.sleep(0)
        ticker.tick()
        ticker.tick()  # before a's reader ran again: it takes both steps at once
        await asyncio.sleep(0)
        c = ticker.add("cmpl-c", 1)
        readers.append(asyncio.create_task(read(1, c)))
        ticker.tick()
        await asyncio.wait_for(asyncio.gather(*readers), 5)
        return got, ticker.first_steps, len(ticker.step_times)

    got, first_steps, num_steps = asyncio.run(scenario())
    assert got == [[0, 1, 2], [0, 2]]  # a: one token per step; b: step 0; c: step 2
    assert first_steps == {"cmpl-a-0": (0, 0), "cmpl-b-0": (0, 0), "cmpl-c-0": (0, 2)}
    assert num_steps == 3


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


def test_unpaced_the_engine_takes_its_lead_at_once_while_the_window_is_full(
    tmp_path: Path,
) -> None:
    """An engine that is never the bottleneck spends no time per step: with the client's window
    full it holds its whole lead within a turn or two of its loop, not a step per turn."""

    async def scenario() -> tuple[int, int]:
        board = Progress(Progress.create(tmp_path / "progress.bin"))
        board.set(GENERATION, 1)
        engine = StandInEngine(
            tmp_path, 42, 100, step_s=0.0, record=False, progress=board, lead_steps=4
        )
        done = asyncio.Event()

        async def requests() -> Any:
            yield pb.EngineCoreRequest(flow=pb.FlowControl(window=1))
            yield pb.EngineCoreRequest(add=_add("r-0", 200))
            await done.wait()

        stream = engine.stream(requests(), None)
        first = pb.EngineCoreOutputs.FromString(await stream.__anext__())  # window now full
        pending = asyncio.ensure_future(stream.__anext__())
        for _ in range(5):
            await asyncio.sleep(0)
        outbox = engine.streams[0].outbox
        outbox.drop_window()  # what is held, merged, as the client would get it
        held = len(outbox.take().outputs[0].new_token_ids)
        assert outbox.empty
        pending.cancel()
        done.set()
        with contextlib.suppress(asyncio.CancelledError):
            await pending
        await stream.aclose()
        return len(first.outputs[0].new_token_ids), held

    sent, held = asyncio.run(scenario())
    assert sent == 1
    assert held == 4 * 8  # --lead-steps 4 x max(1 running, 8) tokens beyond the one received


def test_a_held_step_counts_its_hold_in_the_added_latency(tmp_path: Path) -> None:
    """With the window full, steps are held and sent merged; each keeps the time it was taken,
    so a token's added latency (receive - step time) includes the wait in the engine."""
    from gateway_relay import added_latency  # type: ignore[import-not-found]

    engine = StandInEngine(tmp_path, 42, 100, step_s=0.001, record=True)
    s = _ClientStream(0)
    engine.streams.append(s)
    engine._add(s, _add("cmpl-a-0", 3))
    s.window = 1
    engine._step(s)  # sent: the window is now full
    engine._hold(s)
    time.sleep(0.05)
    engine._hold(s)  # the request's last token
    merged = pb.EngineCoreOutputs.FromString(engine._flush(s))
    assert [len(o.new_token_ids) for o in merged.outputs] == [2]
    assert merged.outputs[0].finish_reason == pb.FINISH_REASON_LENGTH
    times = s.step_times
    assert times == sorted(times) and times[2] - times[1] >= 0.05  # kept when taken, not sent
    now = time.monotonic()
    raw = {"records": {"cmpl-a": [(times[0], 1), (now, 2)]}, "t0": 0.0, "t1": now + 1}
    record = {"step_times": [times], "first_steps": {"cmpl-a-0": (0, 0)}}
    lat = added_latency(raw, record)
    assert lat["tokens"] == 3
    assert lat["max_ms"] >= 50  # the second step waited 50 ms in the engine, and it counts
    raw["records"]["cmpl-a"].append((now, 1))  # a token no step produced: a misjoin
    with pytest.raises(RuntimeError, match="before its step"):
        added_latency(raw, record)


def test_the_pace_comes_from_chunks_per_second_not_tokens() -> None:
    """Paced, each chunk carries one token; unpaced, the gateway's carry several when steps
    merge, so its tok/s would put the pace near its one-token-per-chunk saturation."""
    bare = {"tok_s": 88_800.0, "tokens_per_chunk": 1.0}
    merged = {"tok_s": 76_800.0, "tokens_per_chunk": 2.6}  # 29.5k chunks/s
    by = {("bare", 256): bare, ("gateway", 256): merged}
    assert chunk_capacity(by, 256) == pytest.approx(76_800.0 / 2.6)
    one_per_chunk = {"tok_s": 50_000.0, "tokens_per_chunk": 1.0}  # as before the window
    assert chunk_capacity({("bare", 1): bare, ("gateway", 1): one_per_chunk}, 1) == 50_000.0
    slow_bare = {"tok_s": 20_000.0, "tokens_per_chunk": 1.0}
    assert chunk_capacity({("bare", 8): slow_bare, ("gateway", 8): merged}, 8) == 20_000.0
    assert chunk_capacity({("bare", 8): bare}, 8) == 88_800.0  # no gateway point: bare's
    assert chunk_capacity(by, 64) != chunk_capacity(by, 64)  # NaN: no points at that C


def test_tiny_run_measures_every_system(tmp_path: Path) -> None:
    out = tmp_path / "relay.json"
    argv = [sys.executable, str(BENCHMARKS / "gateway_relay.py"), "--concurrency", "4"]
    argv += ["--duration", "0.6", "--warmup", "0.4", "--settle", "0", "--max-tokens", "16"]
    argv += ["--workers", "1", "--paced-repeats", "3", "--out", str(out)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=180)
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
    floor = results["paced_bare"]["added_latency"]  # the bare app on the same steps
    assert floor["tokens"] > 0 and floor["requests_joined"] > 0
    assert 0 < floor["min_ms"] <= floor["p50_ms"] <= floor["p99_ms"]
    over = results["paced"]["over_bare_ms"]
    assert over["p99"] == latency["p99_ms"] - floor["p99_ms"]
    # Three paced pairs; the one reported is the median by p99 over bare.
    each = [r["p99"] for r in results["paced"]["repeats_over_bare_ms"]]
    assert len(each) == 3 and each == sorted(each) and over["p99"] == each[1]
    assert "raw" not in results["paced"] and "raw" not in results["paced_bare"]  # joined, not kept
    assert "paced_p99_added_over_bare_ms_c4" in results["verdicts"]
    assert results["ratios"]["4"]["tok_s"] > 0
    floor = results["grpc_read_floor"]  # one-token messages read and dropped: a gateway's ceiling
    assert floor["messages"] > 0 and floor["msg_s"] > 0 and floor["cpu_us_per_msg"] > 0
    assert "vs_bare_c1_tok_s" not in floor  # no one-stream point in this run to compare with
