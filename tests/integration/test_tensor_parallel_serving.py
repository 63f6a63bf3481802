"""The gRPC engine at --tensor-parallel-size 2 behind the gateway (issue 33): the openai client's
greedy completions, whole and streamed, and a JSON-object completion equal the one-rank session
engine's; SIGTERM stops the engine and its worker process; a killed worker makes the engine
report NOT_SERVING, end its calls and exit 1, and the gateway's health follows."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.tandem.engine.v1 import engine_pb2 as pb
from protos.tandem.engine.v1.engine_pb2_grpc import EngineStub
from tests.conftest import SESSION_ENGINE_FLAGS
from tests.integration.grpc_util import add_request, tokens_of
from tests.integration.harness import API_KEY, Engine, Gateway

PROMPTS = ["Hello there, how", "The capital of France is", "1 2 3 4 5"]


@pytest.fixture(scope="module")
def tp_client(cache_dir: Path, log_dir: Path) -> Iterator[tuple[openai.OpenAI, Engine]]:
    engine = Engine(cache_dir, log_dir, *SESSION_ENGINE_FLAGS, "--tensor-parallel-size", "2")
    gateway = None
    try:
        engine.wait_ready(timeout=120)
        gateway = Gateway(engine.address, cache_dir, log_dir).wait_healthy()
        client = openai.OpenAI(
            base_url=f"{gateway.url}/v1", api_key=API_KEY, max_retries=0, timeout=60
        )
        yield client, engine
    finally:
        if gateway is not None:
            gateway.stop()
        engine.stop()


def _greedy(client: openai.OpenAI, stream: bool) -> list[str]:
    model = client.models.list().data[0].id
    out = []
    for prompt in PROMPTS:
        if stream:
            chunks = client.completions.create(
                model=model, prompt=prompt, max_tokens=12, temperature=0, stream=True
            )
            out.append("".join(c.choices[0].text for c in chunks if c.choices))
        else:
            r = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0)
            out.append(r.choices[0].text)
    return out


def test_greedy_completions_equal_the_one_rank_engine(
    tp_client: tuple[openai.OpenAI, Engine], client: openai.OpenAI
) -> None:
    tp, _ = tp_client
    want = _greedy(client, stream=False)
    assert _greedy(tp, stream=False) == want
    assert _greedy(tp, stream=True) == want


def test_model_info_and_metrics_report_the_parallel_engine(
    tp_client: tuple[openai.OpenAI, Engine],
) -> None:
    """GetModelInfo reports the layout; the gateway's metrics carry the engine's figures."""
    tp, engine = tp_client
    with grpc.insecure_channel(engine.address) as channel:
        info = EngineStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert info.tensor_parallel_size == 2 and info.num_kv_blocks > 0
    _greedy(tp, stream=False)
    metrics = httpx.get(str(tp.base_url).removesuffix("/v1/") + "/metrics", timeout=10).text
    generated = [
        line
        for line in metrics.splitlines()
        if line.startswith(f'vllm:generation_tokens_total{{engine="{engine.address}"')
    ]
    assert generated and float(generated[0].rsplit(" ", 1)[1]) >= 12, generated


def test_a_structured_output_request_gives_the_one_rank_engines_json(
    tp_client: tuple[openai.OpenAI, Engine], client: openai.OpenAI
) -> None:
    """Rank 0 masks and samples under tensor parallelism: the same JSON object as one rank's."""

    def json_object(c: openai.OpenAI) -> str:
        out = c.chat.completions.create(
            model=c.models.list().data[0].id,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=24,
            temperature=0.0,
            response_format={"type": "json_object"},
        )
        return out.choices[0].message.content or ""

    tp, _ = tp_client
    want = json_object(client)
    assert want.startswith("{")
    assert json_object(tp) == want


def test_sigterm_stops_the_engine_and_its_worker(cache_dir: Path, log_dir: Path) -> None:
    engine = Engine(cache_dir, log_dir, *SESSION_ENGINE_FLAGS, "-tp", "2").wait_ready(timeout=120)
    log = engine.log_tail(100_000)
    workers = [int(p) for line in log.splitlines() for p in _worker_pids(line)]
    assert workers, log
    engine.signal(signal.SIGTERM)
    assert engine.wait(timeout=30) == 0
    engine.kill()  # (already exited: closes its log)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(_alive(p) for p in workers):
        time.sleep(0.05)
    assert not any(_alive(p) for p in workers), "a tensor-parallel worker outlived the engine"


def _worker_pids(line: str) -> list[str]:
    marker = "tensor parallelism: 2 ranks (workers ["
    if marker not in line:
        return []
    return line.split(marker, 1)[1].split("]", 1)[0].split(",")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_killed_worker_reports_not_serving_ends_the_calls_and_the_engine(
    cache_dir: Path, log_dir: Path
) -> None:
    """A dead worker: the engine's health watchers get NOT_SERVING, an in-flight completion
    ends with an error naming the worker (no hang), the engine exits 1, and the gateway's
    health follows (503)."""
    engine = Engine(cache_dir, log_dir, *SESSION_ENGINE_FLAGS, "-tp", "2").wait_ready(timeout=120)
    gateway = None
    try:
        log = engine.log_tail(100_000).splitlines()
        worker = int(next(p for line in log for p in _worker_pids(line)))
        gateway = Gateway(engine.address, cache_dir, log_dir).wait_healthy()
        statuses: list[int] = []
        channel = grpc.insecure_channel(engine.address)
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())

        def follow() -> None:
            with contextlib.suppress(grpc.RpcError):  # the engine is gone: the channel breaks
                statuses.extend(r.status for r in watch)

        watcher = threading.Thread(target=follow)
        watcher.start()
        client = openai.OpenAI(
            base_url=f"{gateway.url}/v1", api_key=API_KEY, max_retries=0, timeout=30
        )
        stream = client.completions.create(
            model=client.models.list().data[0].id,
            prompt="Hello",
            max_tokens=2000,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        next(iter(stream))  # generating
        os.kill(worker, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(openai.APIError) as failed:
            for _ in stream:
                pass
        assert time.monotonic() - start < 10
        assert engine.wait(timeout=15) == 1
        watcher.join(5)
        channel.close()
        log = engine.log_tail(100_000)
        assert f"tensor-parallel worker rank 1 (pid {worker}) exited" in log, log
        assert statuses[0] == health_pb2.HealthCheckResponse.SERVING
        assert statuses[-1] == health_pb2.HealthCheckResponse.NOT_SERVING, statuses
        assert f"worker rank 1 (pid {worker}) exited" in str(failed.value), failed.value
        deadline = time.monotonic() + 10
        while httpx.get(f"{gateway.url}/health", timeout=2).status_code != 503:
            assert time.monotonic() < deadline, "the gateway still reports healthy"
            time.sleep(0.1)
    finally:
        if gateway is not None:
            gateway.stop()
        engine.kill()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_signal_to_the_whole_process_group_is_a_graceful_stop(
    cache_dir: Path, log_dir: Path, sig: signal.Signals
) -> None:
    """Ctrl-C, systemd's KillMode=control-group, ``kill -- -PGID``: the signal reaches the
    workers too (they share the engine's process group). They ignore it and the engine drains
    (a generation in flight finishes whole) and stops them: exit code 0, no worker's death,
    and nothing of the group is left."""
    engine = Engine(
        cache_dir, log_dir, *SESSION_ENGINE_FLAGS, "-tp", "2", new_session=True
    ).wait_ready(timeout=120)
    pgid = engine.popen.pid
    log = engine.log_tail(100_000)
    workers = [int(p) for line in log.splitlines() for p in _worker_pids(line)]
    assert workers and all(os.getpgid(w) == pgid for w in workers), log
    with grpc.insecure_channel(engine.address) as channel:
        request = add_request("in-flight", [5, 6, 7, 8, 9], 400)
        call = EngineStub(channel).Generate(pb.GenerateRequest(request=request), timeout=60)
        responses = [next(call)]  # generating
        os.killpg(pgid, sig)
        responses.extend(call)
    assert len(tokens_of(responses)) == 400, engine.log_tail()
    assert responses[-1].output.finish_reason == pb.FINISH_REASON_LENGTH
    assert engine.wait(timeout=30) == 0, engine.log_tail()
    engine.kill()  # (already exited: closes its log)
    assert "exited with code" not in engine.log_tail(100_000)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and _group_members(pgid):
        time.sleep(0.05)
    assert not _group_members(pgid), "a process of the engine's group outlived it"


def _group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group ``pgid``."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        if int(fields[2]) == pgid and fields[0] != "Z":  # state, ppid, pgrp, ...
            members.append(int(stat.parent.name))
    return members
