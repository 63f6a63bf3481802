"""Mutual TLS between gateway and engine, with certificates made by openssl for this test.

The engine serves its gRPC port with TLS and requires client certificates signed by the CA;
a plaintext health port answers probes. The gateway connects with its own client pair.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.tandem.engine.v1 import engine_pb2 as pb
from protos.tandem.engine.v1 import engine_pb2_grpc as pb_grpc
from tests.external_tools import require
from tests.integration.harness import MODEL, Engine, Gateway, child_env, free_port

pytestmark = pytest.mark.timeout(180)


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _issue(d: Path, name: str, ca: str, ext: str) -> None:
    """An EC key and a certificate for ``name`` signed by ``ca``, with the X.509 extensions."""
    (d / f"{name}.ext").write_text(ext)
    key = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    _openssl("req", *key, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj",
             f"/CN={name}", cwd=d)  # fmt: skip
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key",
             "-CAcreateserial", "-days", "2", "-out", f"{name}.crt", "-extfile", f"{name}.ext",
             cwd=d)  # fmt: skip


def _make_ca(d: Path, name: str) -> None:
    key = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    _openssl("req", "-x509", *key, "-keyout", f"{name}.key", "-out", f"{name}.crt", "-days",
             "2", "-subj", f"/CN={name}", cwd=d)  # fmt: skip


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    require("openssl", "the mTLS tests make their certificates with it")
    d = tmp_path_factory.mktemp("certs")
    _make_ca(d, "ca")
    _make_ca(d, "rogue-ca")
    _issue(d, "engine", "ca", "subjectAltName=DNS:tandem-engine,IP:127.0.0.1\n"
           "extendedKeyUsage=serverAuth\n")  # fmt: skip
    _issue(d, "gateway", "ca", "extendedKeyUsage=clientAuth\n")
    _issue(d, "rogue", "rogue-ca", "extendedKeyUsage=clientAuth\n")
    return d


@pytest.fixture(scope="module")
def tls_engine(certs: Path, cache_dir: Path, log_dir: Path) -> Iterator[Engine]:
    e = Engine(
        cache_dir,
        log_dir,
        "--max-num-seqs", "4", "--kv-cache-memory", "16MiB",
        "--tls-cert", str(certs / "engine.crt"),
        "--tls-key", str(certs / "engine.key"),
        "--tls-ca", str(certs / "ca.crt"),
        "--health-port", str(health_port := free_port()),
    )  # fmt: skip
    e.health_port = health_port  # type: ignore[attr-defined]
    try:
        yield e.wait_ready()
    finally:
        e.stop()


def _tls_channel(certs: Path, address: str, client: str | None) -> grpc.Channel:
    creds = grpc.ssl_channel_credentials(
        root_certificates=(certs / "ca.crt").read_bytes(),
        private_key=(certs / f"{client}.key").read_bytes() if client else None,
        certificate_chain=(certs / f"{client}.crt").read_bytes() if client else None,
    )
    return grpc.secure_channel(address, creds)


def _model_info(channel: grpc.Channel) -> pb.GetModelInfoResponse:
    return pb_grpc.EngineStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=5)


def test_engine_requires_a_client_certificate_from_its_ca(certs: Path, tls_engine: Engine) -> None:
    with _tls_channel(certs, tls_engine.address, "gateway") as ch:
        assert _model_info(ch).max_model_len > 0
    for client in (None, "rogue"):  # no certificate; one from another CA
        with _tls_channel(certs, tls_engine.address, client) as ch:
            with pytest.raises(grpc.RpcError) as err:
                _model_info(ch)
            assert err.value.code() is grpc.StatusCode.UNAVAILABLE, client
    with grpc.insecure_channel(tls_engine.address) as ch, pytest.raises(grpc.RpcError) as err:
        _model_info(ch)
    assert err.value.code() is grpc.StatusCode.UNAVAILABLE


def test_plaintext_health_port_serves_only_health(tls_engine: Engine) -> None:
    address = f"127.0.0.1:{tls_engine.health_port}"  # type: ignore[attr-defined]
    with grpc.insecure_channel(address) as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as err:
            _model_info(ch)
        assert err.value.code() is grpc.StatusCode.UNIMPLEMENTED


def test_gateway_over_mtls(certs: Path, tls_engine: Engine, cache_dir: Path, log_dir: Path) -> None:
    tls = [
        "--tls-ca", str(certs / "ca.crt"),
        "--tls-cert", str(certs / "gateway.crt"),
        "--tls-key", str(certs / "gateway.key"),
    ]  # fmt: skip
    # the certificate names tandem-engine and 127.0.0.1; both verify
    for extra in ([], ["--tls-server-name", "tandem-engine"]):
        g = Gateway(tls_engine.address, cache_dir, log_dir, *tls, *extra)
        try:
            g.wait_healthy()
            r = httpx.post(
                f"{g.url}/v1/completions",
                headers=g.headers,
                json={"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0},
                timeout=30,
            )
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 4
        finally:
            g.stop()
    # a name the certificate does not carry, or no client pair: never healthy, 503 with reason
    for bad in (
        [*tls, "--tls-server-name", "someone-else"],
        ["--tls-ca", str(certs / "ca.crt")],
    ):
        g = Gateway(tls_engine.address, cache_dir, log_dir, *bad)
        try:
            statuses = set()
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                try:
                    r = httpx.get(f"{g.url}/health", timeout=2)
                except httpx.HTTPError:
                    continue  # not listening yet
                statuses.add(r.status_code)
                time.sleep(0.2)
            assert statuses == {503}, bad
            assert "no engine can serve" in r.json()["error"]["message"]
        finally:
            g.kill()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--tls-ca", "ca.crt"], "--tls-ca needs --tls-cert and --tls-key"),
        (["--tls-cert", "x.crt"], "--tls-key is missing"),
        (["--tls-cert", "/nonexistent.crt", "--tls-key", "/nonexistent.key"], "--tls-cert"),
    ],
)
def test_engine_refuses_partial_or_missing_tls_files(
    flags: list[str], message: str, cache_dir: Path
) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "engine_svc", *flags],
        env=child_env(cache_dir),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode != 0
    assert message in r.stderr


def test_gateway_refuses_a_client_pair_without_ca(cache_dir: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "frontend_svc", "--tls-cert", "a.crt", "--tls-key", "a.key"],
        env=child_env(cache_dir),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2
    assert "--tls-cert needs --tls-ca" in r.stderr
