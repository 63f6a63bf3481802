"""The documented opt-out from the services' grpcio I/O (protos/grpc_runtime.py): with
``GRPC_EXPERIMENTS=`` (grpcio's defaults, its EventEngine I/O) an engine and a gateway serve the
same completions, streamed and not, as the session's pair on the polling I/O."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from protos.grpc_runtime import EXPERIMENTS
from tests.integration.harness import API_KEY, MODEL, Engine, Gateway


def _complete(gateway: Gateway) -> tuple[str, str]:
    """(non-streamed text, streamed text joined) of one greedy 40-token completion."""
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=API_KEY, max_retries=0)

    def create(stream: bool):  # type: ignore[no-untyped-def]
        return client.completions.create(
            model=MODEL,
            prompt="Hello world",
            max_tokens=40,
            temperature=0,
            extra_body={"ignore_eos": True},
            stream=stream,
            timeout=60,
        )

    whole = create(stream=False)
    assert whole.choices[0].finish_reason == "length"
    chunks = list(create(stream=True))
    assert chunks[-1].choices[0].finish_reason == "length"
    return whole.choices[0].text, "".join(c.choices[0].text for c in chunks)


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
        try:
            for pid in (engine.popen.pid, opted_out.popen.pid):  # they started with it
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                assert f"{EXPERIMENTS}=".encode() in environ
            assert _complete(opted_out.wait_healthy()) == (expected, expected)
        finally:
            opted_out.stop()
    finally:
        engine.stop()
