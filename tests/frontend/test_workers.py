"""``--workers N``: N gateway processes on one port, each with its own engine stream; any worker's
/metrics covers them all; a worker that dies is replaced; SIGTERM drains streams and exits 0."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import values
from prometheus_client.parser import text_string_to_metric_families
from tokenizers import Tokenizer

from frontend_svc.config import (
    BackoffConfig,
    FrontendConfig,
    HttpsConfig,
    LimitsConfig,
    RoutingConfig,
    TlsClientConfig,
    config_from_args,
    config_from_json,
    config_to_json,
)
from frontend_svc.server.metrics import Metrics
from protos.tandem.engine.v1 import engine_pb2 as pb
from protos.types import EngineOutput, FinishReason, LoadFigures
from tests.frontend.fake_engine import MODEL_NAME, SCRIPT, FakeEngine
from tests.frontend.harness import free_port, wait_for
from tests.frontend.test_metrics_engines import GAUGES, INFO, Clock
from tests.integration.harness import Proc

pytestmark = pytest.mark.timeout(90)
linux_only = pytest.mark.skipif(sys.platform != "linux", reason="reads workers from /proc")

# ---- the flag ---------------------------------------------------------------------------------


def test_workers_flag_and_environment() -> None:
    assert config_from_args([], {}).workers == 1
    assert config_from_args([], {"TANDEM_WORKERS": "4"}).workers == 4
    assert config_from_args(["--workers", "2"], {"TANDEM_WORKERS": "4"}).workers == 2


@pytest.mark.parametrize(
    ("argv", "environ"),
    [(["--workers", "0"], {}), ([], {"TANDEM_WORKERS": "-1"}), ([], {"TANDEM_WORKERS": "two"})],
)
def test_workers_must_be_a_positive_integer(
    argv: list[str], environ: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        config_from_args(argv, environ)
    assert e.value.code == 2
    assert "--workers" in capsys.readouterr().err


def test_workers_get_the_config_the_supervisor_parsed() -> None:
    config = FrontendConfig(
        enable_runtime_lora_updating=True,
        enable_utility_endpoints=True,
        engine_address="dns:///engine:1",
        host="0.0.0.0",
        port=9,
        api_key="k",
        served_model_name="m",
        backoff=BackoffConfig(0.2, 1.0, 3.0),
        retry_after_s=3,
        engine_rpc_timeout_s=2.5,
        log_level="debug",
        uvicorn_log_level="warning",
        https=HttpsConfig("key.pem", "cert.pem", "clients.pem", 2),
        tls=TlsClientConfig("ca.pem", "cert.pem", "key.pem", "name"),
        routing=RoutingConfig(1.5, 0, 2),
        limits=LimitsConfig(1, 2, 3),
        workers=4,
        engine_window=3,
        tool_call_parser="hermes",
        enable_auto_tool_choice=True,
        reasoning_parser="qwen3",
        enable_prompt_tokens_details=True,
        enable_server_load_tracking=True,
        enable_tokenizer_info_endpoint=True,
        root_path="/llm",
        return_tokens_as_token_ids=True,
        enable_force_include_usage=True,
        responses_store_max_entries=5,
        responses_store_max_bytes=1000,
    )
    default = FrontendConfig()
    changed = [f.name for f in dataclasses.fields(config)]
    assert all(getattr(config, name) != getattr(default, name) for name in changed)
    assert config_from_json(config_to_json(config)) == config
    assert config_from_json(config_to_json(default)) == default


# ---- metrics of several workers, merged (in process: two workers played by two pids) --------


Exposition = dict[tuple[str, tuple[tuple[str, str], ...]], float]
CACHE_LABELS = {
    "block_size": "16",
    "num_gpu_blocks": "64",
    "enable_prefix_caching": "True",
    "cache_dtype": "bfloat16",
}


def parse(text: bytes) -> tuple[Exposition, dict[str, str]]:
    """Every sample but ``_created`` (multiprocess mode has none), and the type of each family
    that has samples (multiprocess mode leaves out the others)."""
    samples, types = {}, {}
    for family in text_string_to_metric_families(text.decode()):
        for s in family.samples:
            if not s.name.endswith("_created"):
                samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
                types[family.name] = family.type
    return samples, types


def worker_one(m: Metrics, clock: Clock) -> None:
    m.observe_engine_info("a:1", INFO)
    m.observe_engine_info("gone:2", INFO)
    m.observe_load("a:1", LoadFigures(num_running=3, prefix_cache_queries=20, prefix_cache_hits=9))
    m.observe_load("gone:2", LoadFigures(num_running=1, num_waiting=2, kv_cache_usage=0.5))
    m.observe_routed("a:1", 64)
    seq = m.sequence(5)
    clock.now += 0.25
    m.observe_step("a:1", 5, 1)
    seq.observe(EngineOutput("r", (7,), queued_time_s=0.5, prefill_time_s=0.25), None)
    clock.now += 0.125
    m.observe_step("a:1", 0, 1)
    seq.observe(_last(FinishReason.LENGTH, 8), "length")
    m.observe_routed("a:1", 0)
    seq = m.sequence(3)
    seq.observe(_last(FinishReason.STOP, 9), "stop")


def worker_two(m: Metrics, clock: Clock) -> None:
    m.observe_engine_info("a:1", INFO)
    m.observe_engine_info("gone:2", INFO)
    # The same engine totals reach every worker; they must not add up.
    m.observe_load("a:1", LoadFigures(num_running=4, prefix_cache_queries=20, prefix_cache_hits=9))
    m.observe_load("a:1", LoadFigures(num_running=5, prefix_cache_queries=30, prefix_cache_hits=12))
    m.observe_routed("a:1", 0)
    seq = m.sequence(7)
    clock.now += 2.0
    m.observe_step("a:1", 7, 3)
    seq.observe(_last(FinishReason.LENGTH, 1, 2, 3), "length")
    m.forget_engine("gone:2")  # the engine left: its gauges go, in every worker's report


def _last(finish: FinishReason, *tokens: int) -> EngineOutput:
    """A sequence's last output, with the engine's phase times."""
    return EngineOutput(
        "r",
        tokens,
        finish_reason=finish,
        num_prompt_tokens=5,
        queued_time_s=0.5,
        prefill_time_s=0.25,
        decode_time_s=1.0,
    )


def test_any_worker_reports_what_one_process_would(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = Clock()
    alone = Metrics("m", clock=clock)
    worker_one(alone, clock)
    worker_two(alone, clock)
    expected, expected_types = parse(alone.exposition())

    # Values are bound to the pid of values.ValueClass when a labelled child is first made.
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    workers = []
    for pid, work in ((1001, worker_one), (1002, worker_two)):
        monkeypatch.setattr(values, "ValueClass", values.MultiProcessValue(lambda pid=pid: pid))
        workers.append(Metrics("m", clock=clock))
        work(workers[-1], clock)

    for m in workers:
        samples, types = parse(m.exposition())
        assert samples == expected
        assert types == expected_types
    a = (("engine", "a:1"), ("model_name", "m"))
    assert expected[("vllm:prefix_cache_hits_total", a)] == 12
    assert expected_types["vllm:prefix_cache_hits"] == "counter"
    assert expected[("vllm:generation_tokens_total", a)] == 5
    assert expected[("vllm:iteration_tokens_total_count", a)] == 3
    assert expected[("vllm:request_queue_time_seconds_count", (("model_name", "m"),))] == 3
    itl = expected[("vllm:inter_token_latency_seconds_count", (("model_name", "m"),))]
    assert itl > 0  # and again under vLLM's older name, added at exposition:
    assert expected[("vllm:time_per_output_token_seconds_count", (("model_name", "m"),))] == itl
    assert expected[("vllm:num_requests_running", a)] == 5
    assert not [k for k in expected if ("engine", "gone:2") in k[1] and k[0] in GAUGES]
    assert [k for k in expected if k[0] == "vllm:cache_config_info"] == [
        ("vllm:cache_config_info", tuple(sorted({**dict(a), **CACHE_LABELS}.items())))
    ]


# ---- real worker processes ---------------------------------------------------------------------


class StreamsSeen(FakeEngine):
    """The fake engine, counting the requests that came on each Stream (one per gateway worker)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.per_stream: dict[asyncio.Queue[pb.EngineCoreOutputs], int] = {}

    def add(self, add: pb.AddRequest, sink: asyncio.Queue[pb.EngineCoreOutputs]) -> str | None:
        rid = super().add(add, sink)
        if rid is not None:
            self.per_stream[sink] = self.per_stream.get(sink, 0) + 1
        return rid


class WorkersGateway(Proc):
    """``python -m frontend_svc --workers N`` on a free port."""

    def __init__(self, engine_address: str, log_dir: Path, workers: int = 2) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [sys.executable, "-m", "frontend_svc", "--engine", engine_address]
        argv += ["--port", str(self.port), "--workers", str(workers), "--log-level", "warning"]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
        super().__init__("gateway-workers", argv, env, log_dir)

    @property
    def workers(self) -> set[int]:
        """The worker processes: children of the gateway that multiprocessing spawned."""
        found = set()
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
                command = (stat.parent / "cmdline").read_bytes()
            except (OSError, IndexError, ValueError):
                continue  # gone meanwhile
            if ppid == self.popen.pid and b"spawn_main" in command:
                found.add(int(stat.parent.name))
        return found

    def live(self) -> bool:
        try:
            return httpx.get(f"{self.url}/live", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def complete(self) -> int:
        """One small completion on a new connection (so any worker may take it): the status."""
        body = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 2}
        return httpx.post(f"{self.url}/v1/completions", json=body, timeout=10).status_code

    def finished(self) -> float:
        """Finished sequences, as the /metrics of whichever worker answers counts them."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).content
        samples, _ = parse(text)
        return sum(v for (name, _), v in samples.items() if name == "vllm:request_success_total")


@pytest.fixture()
def streams_engine(tokenizer_dir: Path, hf_tokenizer: Tokenizer) -> Iterator[StreamsSeen]:
    script = hf_tokenizer.encode(SCRIPT, add_special_tokens=False).ids
    e = StreamsSeen(tokenizer_dir, script, vocab_size=hf_tokenizer.get_vocab_size())
    e.start()
    yield e
    e.stop()


@pytest.fixture()
def gateway(streams_engine: StreamsSeen, log_dir: Path) -> Iterator[WorkersGateway]:
    g = WorkersGateway(streams_engine.address, log_dir)
    try:
        # The parent binds the port; the first worker to start makes it listen.
        wait_for(lambda: (len(g.workers) == 2 and g.live()) or not g.alive(), 30, "workers")
        assert g.alive(), g.log_tail()
        yield g
    finally:
        g.stop()  # SIGTERM (then SIGKILL, which the workers follow: PR_SET_PDEATHSIG)


def serve_on_both(gateway: WorkersGateway, engine: StreamsSeen, at_least: int = 4) -> int:
    """Completions until both workers have sent some to the engine; how many succeeded. A 503
    comes from a worker not connected to the engine yet."""
    served, deadline = 0, time.monotonic() + 30
    while len(engine.per_stream) < 2 or served < at_least:
        assert time.monotonic() < deadline, (engine.per_stream, gateway.log_tail())
        status = gateway.complete()
        assert status in (200, 503), status
        served += status == 200
    return served


@linux_only
def test_workers_have_their_own_engine_streams_and_any_reports_all(
    gateway: WorkersGateway, streams_engine: StreamsSeen
) -> None:
    served = serve_on_both(gateway, streams_engine)
    assert len(streams_engine.per_stream) == 2  # one Stream per worker, both used
    assert sum(streams_engine.per_stream.values()) == served
    for _ in range(8):  # new connections: both workers answer some of these
        assert gateway.finished() == served


@linux_only
def test_a_worker_that_dies_is_replaced_and_its_counts_kept(
    gateway: WorkersGateway, streams_engine: StreamsSeen
) -> None:
    served = serve_on_both(gateway, streams_engine)
    before = gateway.workers
    victim = min(before)
    os.kill(victim, signal.SIGKILL)
    wait_for(
        lambda: len(gateway.workers - before) == 1 and victim not in gateway.workers,
        30,
        "a new worker",
    )
    assert len(gateway.workers) == 2
    assert gateway.finished() == served  # what the dead worker counted is still there
    streams_engine.per_stream.clear()
    served += serve_on_both(gateway, streams_engine, at_least=2)  # the new one serves too
    assert gateway.finished() == served


@linux_only
def test_sigterm_lets_streams_finish_then_stops_every_worker(
    gateway: WorkersGateway, streams_engine: StreamsSeen
) -> None:
    serve_on_both(gateway, streams_engine)  # both workers are connected
    workers, pid = gateway.workers, gateway.popen.pid
    metrics_dirs = f"tandem-gateway-metrics-{pid}-*"
    assert list(Path(tempfile.gettempdir()).glob(metrics_dirs))
    body = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 200, "stream": True}  # ~1 s
    with httpx.stream("POST", f"{gateway.url}/v1/completions", json=body, timeout=15) as r:
        lines = (line for line in r.iter_lines() if line)
        assert next(lines).startswith("data: {")
        gateway.signal(signal.SIGTERM)
        rest = list(lines)
    assert rest[-1] == "data: [DONE]"
    events = [json.loads(line.removeprefix("data: ")) for line in rest[:-1]]
    assert not [e for e in events if "error" in e]
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert gateway.wait(20) == 0, gateway.log_tail()
    assert not [w for w in workers if Path(f"/proc/{w}").exists()]
    assert not list(Path(tempfile.gettempdir()).glob(metrics_dirs))


@linux_only
def test_workers_stop_when_the_supervisor_is_killed(gateway: WorkersGateway) -> None:
    workers, pid = gateway.workers, gateway.popen.pid
    gateway.kill()  # SIGKILL: no chance to stop its workers itself
    try:
        wait_for(lambda: not [w for w in workers if Path(f"/proc/{w}").exists()], 15, "workers")
    finally:  # what only a graceful stop removes
        for leftover in Path(tempfile.gettempdir()).glob(f"tandem-gateway-metrics-{pid}-*"):
            shutil.rmtree(leftover)


def run_gateway(*flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "frontend_svc", "--workers", "3", *flags],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("workers", ["1", "3"])
def test_a_taken_port_is_one_error_and_no_worker(workers: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = run_gateway("--port", str(port), "--engine", "127.0.0.1:1", "--workers", workers)
    assert r.returncode == 1
    assert r.stderr.count("Address already in use") == 1, r.stderr
    assert r.stderr.strip().count("\n") == 0, r.stderr  # one line
    assert r.stderr.rstrip().endswith(
        f"ERROR frontend_svc: cannot serve on 127.0.0.1:{port}: Address already in use: another "
        "process listens there (stop it or choose another --port)"
    )
    assert "Traceback" not in r.stderr and "Started server process" not in r.stderr


def test_a_bad_engine_address_fails_once_before_any_worker() -> None:
    r = run_gateway("--port", str(free_port()), "--engine", "no-port-here")
    assert r.returncode == 1  # as with one worker
    assert r.stderr.count("Traceback") == 1, r.stderr
    assert r.stderr.rstrip().endswith("engine address 'no-port-here' is not HOST:PORT")
    assert "Started server process" not in r.stderr
