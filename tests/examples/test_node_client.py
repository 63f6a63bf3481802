"""The Node.js example client (examples/node) against a real engine process.

The client is installed with ``npm ci`` from its lockfile and run as a subprocess with ``--json``
(one event per line). Its answers are checked against the Python gRPC client's on the same
engine: model info field by field, greedy tokens token by token, abort and error statuses.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest

from protos.tandem.engine.v1 import engine_pb2 as pb
from protos.tandem.engine.v1 import engine_pb2_grpc as pb_grpc
from tests.external_tools import require
from tests.integration.grpc_util import add_request, generate, tokens_of
from tests.integration.harness import Engine

pytestmark = pytest.mark.timeout(400)  # generous: the first test to run pays for npm ci

NODE_DIR = Path(__file__).resolve().parents[2] / "examples" / "node"
PROMPT = [300, 301, 302, 303, 304]
PROMPT_FLAG = ",".join(map(str, PROMPT))
LONG = 1900  # max_tokens of requests that are meant to be aborted (prompt + LONG < 2048)
Events = list[dict[str, Any]]


@pytest.fixture(scope="module")
def node_client() -> list[str]:
    """``npm ci`` from the committed lockfile; the argv that runs the client."""
    node = require("node", "the Node.js example client runs on node")
    npm = require("npm", "npm ci installs the Node.js example client's pinned dependencies")
    start = time.monotonic()
    done = subprocess.run(
        [npm, "ci", "--no-audit", "--no-fund", "--ignore-scripts"],
        cwd=NODE_DIR,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    print(f"npm ci took {time.monotonic() - start:.1f}s")
    return [node, str(NODE_DIR / "client.js")]


@pytest.fixture()
def stub(channel: grpc.Channel) -> pb_grpc.EngineStub:
    return pb_grpc.EngineStub(channel)


def run_client(
    node_client: list[str], address: str, *args: str, timeout: float = 60.0
) -> tuple[int, Events, str]:
    """Run the client with ``--json``: (exit status, its events, its stderr)."""
    done = subprocess.run(
        [*node_client, "--address", address, "--json", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return done.returncode, [json.loads(line) for line in done.stdout.splitlines()], done.stderr


def start_client(node_client: list[str], address: str, *args: str) -> subprocess.Popen[str]:
    """Start the client with ``--json``, its stdout to be read line by line as it prints."""
    argv = [*node_client, "--address", address, "--json", *args]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def read_token_lines(proc: subprocess.Popen[str], n: int) -> Events:
    """Block until the client has printed ``n`` token lines; those lines."""
    assert proc.stdout is not None
    steps: Events = []
    while len(steps) < n:
        line = proc.stdout.readline()
        assert line, f"the client ended before printing {n} token lines"
        if (event := json.loads(line))["event"] == "tokens":
            steps.append(event)
    return steps


def of_kind(events: Events, kind: str) -> Events:
    return [e for e in events if e["event"] == kind]


def long_greedy_flags() -> list[str]:
    return [f"--prompt={PROMPT_FLAG}", f"--max-tokens={LONG}", "--temperature=0", "--ignore-eos"]


def test_info_matches_python_client(
    node_client: list[str],
    engine: Engine,
    stub: pb_grpc.EngineStub,
) -> None:
    code, events, stderr = run_client(node_client, engine.address, "info")
    assert code == 0, stderr
    [got] = of_kind(events, "info")
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    want: dict[str, Any] = {}
    for field in info.DESCRIPTOR.fields:
        if field.has_presence and not info.HasField(field.name):
            continue  # an unset `optional` (bos_token_id of the default model) stays absent
        value = getattr(info, field.name)
        want[field.name] = list(value) if field.is_repeated else value
    assert {k: v for k, v in got.items() if k not in ("event", "t_ms")} == want


def test_generate_matches_python_greedy(
    node_client: list[str],
    engine: Engine,
    stub: pb_grpc.EngineStub,
) -> None:
    want = tokens_of(generate(stub, add_request("", PROMPT, 16)))
    code, events, stderr = run_client(
        node_client,
        engine.address,
        "generate",
        f"--prompt={PROMPT_FLAG}",
        "--max-tokens=16",
        "--temperature=0",
        "--ignore-eos",
    )
    assert code == 0, stderr
    steps = of_kind(events, "tokens")
    [done] = of_kind(events, "done")
    assert done["token_ids"] == want and done["num_tokens"] == len(want) == 16
    assert [t for s in steps for t in s["new_token_ids"]] == want
    assert len(steps) > 1  # one line per engine step, not one at the end
    assert [s["finish_reason"] for s in steps[:-1]] == ["FINISH_REASON_UNSPECIFIED"] * (
        len(steps) - 1
    )
    assert steps[-1]["finish_reason"] == done["finish_reason"] == "FINISH_REASON_LENGTH"
    assert done["num_prompt_tokens"] == len(PROMPT)
    assert len({s["request_id"] for s in steps} | {done["request_id"]}) == 1  # engine-assigned
    assert done["request_id"]


def test_tokens_are_printed_while_the_request_runs(
    node_client: list[str],
    engine: Engine,
    stub: pb_grpc.EngineStub,
) -> None:
    """Read the client's lines as they come; abort from Python once three token lines are out.

    The abort finding the request unfinished proves those lines were printed mid-stream.
    """
    proc = start_client(node_client, engine.address, "generate", *long_greedy_flags())
    try:
        steps = read_token_lines(proc, 3)
        reply = stub.Abort(pb.AbortRequest(request_ids=[steps[0]["request_id"]]), timeout=10)
        assert reply.num_aborted == 1
        stdout, stderr = proc.communicate(timeout=30)
        assert proc.returncode == 0, stderr
    finally:
        proc.kill()
        proc.wait()
    rest = [json.loads(line) for line in stdout.splitlines()]
    [done] = of_kind(rest, "done")
    assert done["finish_reason"] == "FINISH_REASON_ABORT"
    assert 3 <= done["num_tokens"] < LONG


def test_abort_ends_the_stream_and_frees_the_engine(
    node_client: list[str],
    engine: Engine,
    stub: pb_grpc.EngineStub,
) -> None:
    code, events, stderr = run_client(
        node_client, engine.address, "abort", *long_greedy_flags(), "--after=3"
    )
    assert code == 0, stderr
    [sent] = of_kind(events, "abort_sent")
    [done] = of_kind(events, "done")
    steps = of_kind(events, "tokens")
    assert sent["num_aborted"] == 1 and sent["request_id"] == done["request_id"]
    assert sent["after_tokens"] >= 3
    assert done["finish_reason"] == steps[-1]["finish_reason"] == "FINISH_REASON_ABORT"
    assert 3 <= done["num_tokens"] < LONG
    # The engine has dropped the request: the load the client saw after the abort says so, and
    # so does the load after the next request (greedy up to the abort point, as in Python).
    assert steps[-1]["load"]["num_running_requests"] == 0
    after = generate(stub, add_request("", PROMPT, done["num_tokens"]))
    assert tokens_of(after) == done["token_ids"]
    assert after[-1].load.num_running_requests == 0
    assert after[-1].load.num_waiting_requests == 0


def test_ctrl_c_cancels_the_call_and_the_engine_drops_the_request(
    node_client: list[str],
    engine: Engine,
    stub: pb_grpc.EngineStub,
) -> None:
    proc = start_client(node_client, engine.address, "generate", *long_greedy_flags())
    try:
        [step] = read_token_lines(proc, 1)
        proc.send_signal(signal.SIGINT)
        stdout, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 130
    assert json.loads(stdout.splitlines()[-1])["event"] == "cancelled"
    # Once the engine has seen the cancellation the id names no unfinished request.
    deadline = time.monotonic() + 10
    while stub.Abort(pb.AbortRequest(request_ids=[step["request_id"]])).num_aborted:
        assert time.monotonic() < deadline, "the cancelled request is still running"
        time.sleep(0.05)
    after = generate(stub, add_request("", PROMPT, 1))
    assert after[-1].load.num_running_requests == 0


def test_rpc_error_exits_non_zero_with_the_status(
    node_client: list[str],
    engine: Engine,
) -> None:
    code, events, stderr = run_client(
        node_client, engine.address, "generate", "--prompt=300,99999", "--max-tokens=4"
    )
    assert code == 1
    [error] = of_kind(events, "error")
    assert error["status"] == "INVALID_ARGUMENT"
    assert error["code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "99999" in error["message"]
    assert "INVALID_ARGUMENT" in stderr
    assert not of_kind(events, "done")


def _python_embedding(stub: pb_grpc.EngineStub, **params: object) -> list[float]:
    pooling = pb.PoolingParams(task=pb.POOLING_TASK_EMBED, **params)  # type: ignore[arg-type]
    request = pb.AddRequest(prompt_token_ids=PROMPT, pooling_params=pooling)
    [response] = generate(stub, request)
    assert response.output.finish_reason == pb.FINISH_REASON_STOP
    return list(response.output.pooled.data)


def test_embed_matches_python(
    node_client: list[str],
    engine: Engine,
    stub: pb_grpc.EngineStub,
) -> None:
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert "embed" in info.supported_tasks  # the default model is a causal LM: it embeds too
    for flags, params in (([], {}), (["--no-normalize"], {"normalize": False})):
        want = _python_embedding(stub, **params)
        code, events, stderr = run_client(
            node_client, engine.address, "embed", f"--prompt={PROMPT_FLAG}", *flags
        )
        assert code == 0, stderr
        [got] = of_kind(events, "embedding")
        assert got["dimensions"] == len(got["embedding"]) == info.embedding_size
        # the same engine, the same prompt: the same float32 values (last bits aside, should a
        # batch or the prefix cache differ)
        assert got["embedding"] == pytest.approx(want, rel=1e-5, abs=1e-6)
        assert got["finish_reason"] == "FINISH_REASON_STOP"
        assert got["num_prompt_tokens"] == len(PROMPT) and got["request_id"]
    norm = sum(x * x for x in _python_embedding(stub)) ** 0.5
    assert norm == pytest.approx(1.0, rel=1e-4)
    # Text mode: the length and the first values.
    done = subprocess.run(
        [*node_client, "--address", engine.address, "embed", f"--prompt={PROMPT_FLAG}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert f"embedding of {info.embedding_size} values" in done.stdout
    assert f"[{_python_embedding(stub)[0]:.6f}, " in done.stdout


def test_embed_error_exits_non_zero(node_client: list[str], engine: Engine) -> None:
    """The default model is not a Matryoshka model: --dimensions is refused, naming the field."""
    code, events, stderr = run_client(
        node_client, engine.address, "embed", f"--prompt={PROMPT_FLAG}", "--dimensions=8"
    )
    assert code == 1
    [error] = of_kind(events, "error")
    assert error["status"] == "INVALID_ARGUMENT" and "dimensions" in error["message"]
    assert not of_kind(events, "embedding")


def test_usage_error_exits_2(node_client: list[str]) -> None:
    code, events, stderr = run_client(node_client, "127.0.0.1:1", "generate")
    assert (code, events) == (2, [])
    assert "--prompt" in stderr


# ------------------------------------------------------------------------------ TLS


class _InfoOnly(pb_grpc.EngineServicer):
    def GetModelInfo(  # noqa: N802 - gRPC method name
        self, request: pb.GetModelInfoRequest, context: grpc.ServicerContext
    ) -> pb.GetModelInfoResponse:
        return pb.GetModelInfoResponse(served_model_name="tls-model", vocab_size=7)


def _self_signed(openssl: str, out: Path, name: str) -> tuple[Path, Path]:
    key, cert = out / f"{name}.key", out / f"{name}.pem"
    subprocess.run(
        [
            openssl,
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-days",
            "1",
            "-subj",
            f"/CN={name}",
            "-addext",
            "subjectAltName=DNS:localhost,IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return key, cert


@pytest.fixture()
def mtls_server(tmp_path: Path) -> Iterator[tuple[str, Path, Path, Path]]:
    """A TLS server that wants a client certificate: (address, CA, client cert, client key)."""
    openssl = require("openssl", "makes the certificates of the Node.js client's TLS test")
    server_key, server_cert = _self_signed(openssl, tmp_path, "server")
    client_key, client_cert = _self_signed(openssl, tmp_path, "client")
    credentials = grpc.ssl_server_credentials(
        [(server_key.read_bytes(), server_cert.read_bytes())],
        root_certificates=client_cert.read_bytes(),
        require_client_auth=True,
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_EngineServicer_to_server(_InfoOnly(), server)
    port = server.add_secure_port("127.0.0.1:0", credentials)
    server.start()
    try:
        yield f"127.0.0.1:{port}", server_cert, client_cert, client_key
    finally:
        server.stop(None)


def test_mutual_tls(node_client: list[str], mtls_server: tuple[str, Path, Path, Path]) -> None:
    address, ca, cert, key = mtls_server
    code, events, stderr = run_client(
        node_client,
        address,
        "--tls-ca",
        str(ca),
        "--tls-cert",
        str(cert),
        "--tls-key",
        str(key),
        "info",
    )
    assert code == 0, stderr
    [info] = of_kind(events, "info")
    assert (info["served_model_name"], info["vocab_size"]) == ("tls-model", 7)
    # Without a client certificate the server refuses the handshake.
    code, events, stderr = run_client(node_client, address, "--tls-ca", str(ca), "info")
    assert code == 1
    assert of_kind(events, "error")[0]["status"] == "UNAVAILABLE"
