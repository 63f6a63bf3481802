"""The documented opt-out from the services' grpcio I/O (protos/grpc_runtime.py): with
``GRPC_EXPERIMENTS=`` (grpcio's defaults, its EventEngine I/O) an engine and a gateway serve the
same completions, streamed and not, as the session's pair on the polling I/O."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from protos.grpc_runtime import EXPERIMENTS
from tests.integration.harness import MODEL, Engine, Gateway

BODY = {
    "model": MODEL,
    "prompt": "Hello world",
    "max_tokens": 40,
    "temperature": 0,
    "ignore_eos": True,
}


def _complete(gateway: Gateway) -> tuple[str, str]:
    """(non-streamed text, streamed text joined) of BODY."""
    url, headers = f"{gateway.url}/v1/completions", gateway.headers
    whole = httpx.post(url, json=BODY, headers=headers, timeout=60)
    assert whole.status_code == 200, whole.text
    choice = whole.json()["choices"][0]
    assert choice["finish_reason"] == "length"
    parts, finish = [], None
    with httpx.stream("POST", url, json={**BODY, "stream": True}, headers=headers) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                c = json.loads(line[6:])["choices"][0]
                parts.append(c["text"])
                finish = c["finish_reason"] or finish
    assert finish == "length"
    return choice["text"], "".join(parts)


def test_grpcio_defaults_serve_the_same(
    gateway: Gateway, cache_dir: Path, log_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    expected, streamed = _complete(gateway)  # the session pair, on the polling I/O
    assert streamed == expected and expected
    monkeypatch.setenv(EXPERIMENTS, "")  # the children inherit it: the operator's choice
    engine = Engine(cache_dir, log_dir, "--max-num-seqs", "4")
    try:
        engine.wait_ready()
        opted_out = Gateway(engine.address, cache_dir, log_dir)
        for pid in (engine.popen.pid, opted_out.popen.pid):  # they started with it
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            assert f"{EXPERIMENTS}=".encode() in environ
        try:
            assert _complete(opted_out.wait_healthy()) == (expected, expected)
        finally:
            opted_out.stop()
    finally:
        engine.stop()
