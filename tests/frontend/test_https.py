"""HTTPS on the gateway (vLLM's ``--ssl-certfile`` / ``--ssl-keyfile`` / ``--ssl-ca-certs`` /
``--ssl-cert-reqs``): ``python -m frontend_svc`` in front of the fake engine, with certificates
made by openssl for this test."""

from __future__ import annotations

import ssl
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.external_tools import require
from tests.frontend.fake_engine import FakeEngine
from tests.frontend.harness import free_port, wait_for
from tests.integration.test_tls import _issue, _make_ca

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    require("openssl", "the HTTPS tests make their certificates with it")
    d = tmp_path_factory.mktemp("https_certs")
    _make_ca(d, "ca")
    _issue(d, "gateway", "ca", "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n")
    _issue(d, "client", "ca", "extendedKeyUsage=clientAuth\n")
    return d


class HttpsGateway:
    def __init__(self, engine: FakeEngine, *flags: str) -> None:
        self.port = free_port()
        self.url = f"https://127.0.0.1:{self.port}"
        argv = [sys.executable, "-m", "frontend_svc", "--engine", engine.address]
        argv += ["--port", str(self.port), "--log-level", "warning", *flags]
        self.popen = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True)

    def stop(self) -> str:
        self.popen.terminate()
        try:
            _, err = self.popen.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            _, err = self.popen.communicate()
        return err


def tls_flags(certs: Path) -> list[str]:
    return [
        *("--ssl-certfile", str(certs / "gateway.crt")),
        *("--ssl-keyfile", str(certs / "gateway.key")),
    ]


@pytest.fixture()
def https_gateway(engine: FakeEngine, certs: Path) -> Iterator[HttpsGateway]:
    g = HttpsGateway(engine, *tls_flags(certs))
    yield g
    g.stop()


def answers(url: str, **client: object) -> bool:
    try:
        return httpx.get(url, timeout=2, **client).status_code == 200  # type: ignore[arg-type]
    except httpx.HTTPError:
        return False


def test_health_over_https(https_gateway: HttpsGateway, certs: Path) -> None:
    ca = ssl.create_default_context(cafile=str(certs / "ca.crt"))
    wait_for(lambda: answers(f"{https_gateway.url}/health", verify=ca), 20, "/health over TLS")
    r = httpx.get(f"{https_gateway.url}/v1/models", verify=ca, timeout=5)
    assert r.status_code == 200 and r.json()["data"]
    with pytest.raises(httpx.ConnectError):  # the certificate is checked: not a system CA's
        httpx.get(f"{https_gateway.url}/health", timeout=5)
    with pytest.raises(httpx.HTTPError):  # no plain HTTP on that port
        httpx.get(f"http://127.0.0.1:{https_gateway.port}/health", timeout=5)


def test_client_certificates_when_required(engine: FakeEngine, certs: Path) -> None:
    flags = [*tls_flags(certs), "--ssl-ca-certs", str(certs / "ca.crt"), "--ssl-cert-reqs", "2"]
    g = HttpsGateway(engine, *flags)
    try:
        ca = ssl.create_default_context(cafile=str(certs / "ca.crt"))
        mutual = ssl.create_default_context(cafile=str(certs / "ca.crt"))
        mutual.load_cert_chain(certs / "client.crt", certs / "client.key")
        wait_for(lambda: answers(f"{g.url}/health", verify=mutual), 20, "/health over mTLS")
        assert not answers(f"{g.url}/health", verify=ca)  # no client certificate: refused
    finally:
        g.stop()


def test_a_missing_certificate_is_one_line_and_status_1(engine: FakeEngine, tmp_path: Path) -> None:
    missing = tmp_path / "nope.crt"
    r = subprocess.run(
        [sys.executable, "-m", "frontend_svc", "--engine", engine.address]
        + ["--port", str(free_port()), "--ssl-certfile", str(missing)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 1
    assert r.stderr.strip().count("\n") == 0, r.stderr
    assert f"ERROR frontend_svc: cannot serve HTTPS with --ssl-certfile {missing}: " in r.stderr
    assert "Traceback" not in r.stderr
