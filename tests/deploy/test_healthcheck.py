"""``python -m engine_svc.healthcheck``, the engine image's HEALTHCHECK: exit 0 iff SERVING.

Run as the container runs it (a subprocess, exit code and stderr) against small in-test health
servers (SERVING, NOT_SERVING, unknown service, nothing listening, a peer that never answers,
mutual TLS) and against real engine processes on the embedded default model.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from engine_svc import healthcheck
from tests.deploy.conftest import REPO
from tests.external_tools import require
from tests.integration.harness import Engine, free_port

pytestmark = pytest.mark.timeout(300)

ENGINE_SERVICE = "tandem.engine.v1.Engine"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def run_check(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "engine_svc.healthcheck", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )


class HealthServer:
    """A grpc.health.v1 server on loopback whose statuses the test sets."""

    def __init__(self, credentials: grpc.ServerCredentials | None = None) -> None:
        self.servicer = health.HealthServicer()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, self.server)
        if credentials is None:
            port = self.server.add_insecure_port("127.0.0.1:0")
        else:
            port = self.server.add_secure_port("127.0.0.1:0", credentials)
        self.address = f"127.0.0.1:{port}"
        self.server.start()

    def set(self, service: str, status: int) -> None:
        self.servicer.set(service, status)

    def stop(self) -> None:
        self.server.stop(grace=None)


@pytest.fixture()
def health_server() -> Iterator[HealthServer]:
    s = HealthServer()
    yield s
    s.stop()


# ------------------------------------------------------------------ plaintext, in-test server


def test_serving_exits_0(health_server: HealthServer) -> None:
    health_server.set("", SERVING)
    done = run_check("--address", health_server.address)
    assert (done.returncode, done.stderr) == (0, "")


def test_not_serving_exits_1_with_the_reason(health_server: HealthServer) -> None:
    health_server.set("", NOT_SERVING)
    done = run_check("--address", health_server.address)
    assert done.returncode == 1
    assert "NOT_SERVING" in done.stderr and health_server.address in done.stderr


def test_service_flag_checks_that_service(health_server: HealthServer) -> None:
    health_server.set("", NOT_SERVING)
    health_server.set(ENGINE_SERVICE, SERVING)
    assert (
        run_check("--address", health_server.address, "--service", ENGINE_SERVICE).returncode == 0
    )
    assert run_check("--address", health_server.address).returncode == 1


def test_unknown_service_exits_1(health_server: HealthServer) -> None:
    health_server.set("", SERVING)
    done = run_check("--address", health_server.address, "--service", "no.such.Service")
    assert done.returncode == 1
    assert "does not know service 'no.such.Service'" in done.stderr


def test_nothing_listening_exits_1() -> None:
    address = f"127.0.0.1:{free_port()}"
    done = run_check("--address", address, "--timeout", "2")
    assert done.returncode == 1
    assert "UNAVAILABLE" in done.stderr and address in done.stderr


def test_silent_peer_times_out_within_timeout() -> None:
    """A TCP listener that never speaks HTTP/2: the check gives up after --timeout seconds."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        address = f"127.0.0.1:{listener.getsockname()[1]}"
        start = time.monotonic()
        done = run_check("--address", address, "--timeout", "1")
        elapsed = time.monotonic() - start
    assert done.returncode == 1
    assert "DEADLINE_EXCEEDED" in done.stderr
    assert elapsed < 6, elapsed  # 1s timeout + interpreter start, far below Docker's 5s budget


@pytest.mark.parametrize(
    "args",
    [["--tls-cert", "client.crt"], ["--timeout", "0"], ["--no-such-flag"]],
    ids=["cert-without-key", "zero-timeout", "unknown-flag"],
)
def test_usage_errors_exit_1_not_2(args: list[str]) -> None:
    """Docker reserves exit code 2 for health checks; a bad command line is plainly unhealthy."""
    done = run_check(*args)
    assert done.returncode == 1, done
    assert "usage:" in done.stderr


def test_check_returns_none_only_when_serving(health_server: HealthServer) -> None:
    health_server.set("", SERVING)
    assert healthcheck.check(health_server.address) is None
    health_server.set("", NOT_SERVING)
    assert healthcheck.check(health_server.address) == (
        f"{health_server.address}: service '' is NOT_SERVING"
    )


# ------------------------------------------------------------------ TLS, in-test server


def _openssl(d: Path, *args: str) -> None:
    subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)


def _ca(d: Path, name: str) -> None:
    _openssl(d, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
             "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.crt", "-days", "2",
             "-subj", f"/CN={name}")  # fmt: skip


def _issue(d: Path, name: str, ca: str, ext: str) -> None:
    (d / f"{name}.ext").write_text(ext)
    _openssl(d, "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}")  # fmt: skip
    _openssl(d, "x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key",
             "-CAcreateserial", "-days", "2", "-out", f"{name}.crt", "-extfile",
             f"{name}.ext")  # fmt: skip


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA, an engine certificate for the name ``tandem-engine`` only (not 127.0.0.1, so the
    name override is needed on loopback), a client pair, and an unrelated CA."""
    require("openssl", "the TLS health-check tests make their certificates with it")
    d = tmp_path_factory.mktemp("certs")
    _ca(d, "ca")
    _ca(d, "rogue-ca")
    _issue(d, "engine", "ca", "subjectAltName=DNS:tandem-engine\nextendedKeyUsage=serverAuth\n")
    _issue(d, "client", "ca", "extendedKeyUsage=clientAuth\n")
    return d


@pytest.fixture()
def mtls_server(certs: Path) -> Iterator[HealthServer]:
    credentials = grpc.ssl_server_credentials(
        [((certs / "engine.key").read_bytes(), (certs / "engine.crt").read_bytes())],
        root_certificates=(certs / "ca.crt").read_bytes(),
        require_client_auth=True,
    )
    s = HealthServer(credentials)
    s.set("", SERVING)
    yield s
    s.stop()


def _tls(certs: Path, ca: str = "ca", client: bool = True, name: bool = True) -> list[str]:
    args = ["--tls-ca", str(certs / f"{ca}.crt")]
    if client:
        args += ["--tls-cert", str(certs / "client.crt"), "--tls-key", str(certs / "client.key")]
    if name:
        args += ["--tls-server-name", "tandem-engine"]
    return args


def test_mutual_tls_serving(mtls_server: HealthServer, certs: Path) -> None:
    done = run_check("--address", mtls_server.address, *_tls(certs))
    assert (done.returncode, done.stderr) == (0, "")


@pytest.mark.parametrize(
    "case",
    ["plaintext", "no-client-cert", "untrusted-server", "wrong-server-name", "missing-file"],
)
def test_tls_failures_exit_1(mtls_server: HealthServer, certs: Path, case: str) -> None:
    args = {
        "plaintext": [],
        "no-client-cert": _tls(certs, client=False),
        "untrusted-server": _tls(certs, ca="rogue-ca"),
        "wrong-server-name": _tls(certs, name=False),  # the cert names tandem-engine, not an IP
        "missing-file": ["--tls-ca", str(certs / "absent.crt")],
    }[case]
    done = run_check("--address", mtls_server.address, "--timeout", "2", *args)
    assert done.returncode == 1, done
    assert done.stderr.startswith("unhealthy: "), done.stderr


# ------------------------------------------------------------------ real engines


def test_real_engine_is_serving(engine: Engine) -> None:
    for service in ("", ENGINE_SERVICE):
        done = run_check("--address", engine.address, "--service", service)
        assert (done.returncode, done.stderr) == (0, ""), service
    assert run_check("--address", engine.address, "--service", "nope").returncode == 1


def test_runs_without_torch(engine: Engine) -> None:
    """With torch (and the other engine extras) made unimportable the check still passes, so it
    never pays torch's import time inside the HEALTHCHECK timeout."""
    code = (
        "import runpy, sys\n"
        "for name in ('torch', 'transformers', 'safetensors', 'cupy', 'numpy'):\n"
        "    sys.modules[name] = None\n"
        f"sys.argv = ['healthcheck', '--address', {engine.address!r}]\n"
        "runpy.run_module('engine_svc.healthcheck', run_name='__main__', alter_sys=True)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=30, cwd=REPO
    )
    assert (done.returncode, done.stderr) == (0, "")


def test_engine_turns_unhealthy_on_shutdown(cache_dir: Path, log_dir: Path) -> None:
    engine = Engine(cache_dir, log_dir, "--device", "cpu", "--kv-cache-memory", "8MiB")
    try:
        engine.wait_ready(timeout=180)
        assert run_check("--address", engine.address).returncode == 0
        engine.signal(15)  # SIGTERM: the engine says NOT_SERVING, drains, stops
        deadline = time.monotonic() + 30
        done = run_check("--address", engine.address, "--timeout", "1")
        while done.returncode == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
            done = run_check("--address", engine.address, "--timeout", "1")
        assert done.returncode == 1
        assert "NOT_SERVING" in done.stderr or "UNAVAILABLE" in done.stderr, done.stderr
    finally:
        engine.stop()


def test_real_engine_with_mutual_tls_and_health_port(
    certs: Path, cache_dir: Path, log_dir: Path
) -> None:
    """The engine's --tls-* flags and plaintext --health-port, checked the two ways a container
    can: mTLS on the main port, plaintext on the health port."""
    from engine_svc.__main__ import parse_args

    if not hasattr(parse_args([]), "health_port"):
        pytest.skip("this engine has no --tls-cert/--health-port yet")
    health_port = free_port()
    engine = Engine(
        cache_dir, log_dir, "--device", "cpu", "--kv-cache-memory", "8MiB",
        "--tls-cert", str(certs / "engine.crt"), "--tls-key", str(certs / "engine.key"),
        "--tls-ca", str(certs / "ca.crt"), "--health-port", str(health_port),
    )  # fmt: skip
    try:
        engine.wait_ready(timeout=180)
        assert run_check("--address", engine.address, *_tls(certs)).returncode == 0
        assert run_check("--address", f"127.0.0.1:{health_port}").returncode == 0
        plaintext = run_check("--address", engine.address, "--timeout", "2")
        assert plaintext.returncode == 1
        no_client = run_check(
            "--address", engine.address, "--timeout", "2", *_tls(certs, client=False)
        )
        assert no_client.returncode == 1
    finally:
        engine.stop()
