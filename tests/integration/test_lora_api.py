"""LoRA adapters through the real gateway in front of the real engine: /v1/models cards,
requests naming an adapter (the same tokens as the engine gives over gRPC with that
lora_name), POST /v1/load_lora_adapter and /v1/unload_lora_adapter with tiny PEFT adapters, a
bad adapter directory (400 naming the file, the others still served).

Skipped only when the engine answers UNIMPLEMENTED to AddLora (an engine without LoRA support).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest

from protos.tandem.engine.v1 import engine_pb2 as pb
from protos.tandem.engine.v1 import engine_pb2_grpc as pb_grpc
from tests.integration.grpc_util import add_request, generate, tokens_of
from tests.integration.harness import MODEL, Engine, Gateway
from tests.lora_peft import make_adapter

pytestmark = pytest.mark.timeout(300)
PROMPT = [300, 301, 302, 303, 304, 305, 306]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def adapters(cache_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from engine_svc.default_model import ensure_default_model

    base = ensure_default_model()
    root = tmp_path_factory.mktemp("api_lora")
    dirs = {
        "alpha": make_adapter(base, root / "alpha", r=4, alpha=8, targets="all-linear", seed=1),
        "beta": make_adapter(
            base, root / "beta", r=8, alpha=16, targets=["q_proj", "v_proj"], seed=2
        ),
    }
    broken = root / "broken"
    shutil.copytree(dirs["alpha"], broken)
    (broken / "adapter_model.safetensors").write_bytes(b"\x00not safetensors")
    dirs["broken"] = broken
    return dirs


@pytest.fixture(scope="module")
def servers(
    cache_dir: Path, log_dir: Path, adapters: dict[str, Path]
) -> Iterator[tuple[pb_grpc.EngineStub, Gateway]]:
    engine = Engine(
        cache_dir,
        log_dir,
        "--max-num-seqs",
        "8",
        "--kv-cache-memory",
        "32MiB",
        "--enable-lora",
        "--max-loras",
        "2",
        "--max-lora-rank",
        "8",
        "--lora-modules",
        f"alpha={adapters['alpha']}",
    )
    gateway: Gateway | None = None
    try:
        engine.wait_ready()
        with grpc.insecure_channel(engine.address) as channel:
            stub = pb_grpc.EngineStub(channel)
            try:  # a path that does not exist: any answer but UNIMPLEMENTED will do
                stub.AddLora(pb.AddLoraRequest(lora_name="probe", lora_path="/nonexistent"))
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.UNIMPLEMENTED:  # type: ignore[attr-defined]
                    pytest.skip("the engine does not implement AddLora (no LoRA support yet)")
            gateway = Gateway(
                engine.address, cache_dir, log_dir, "--enable-runtime-lora-updating"
            ).wait_healthy()
            yield stub, gateway
    finally:
        if gateway is not None:
            gateway.stop()
        engine.stop()


def post(gateway: Gateway, path: str, body: dict[str, object]) -> httpx.Response:
    return httpx.post(f"{gateway.url}{path}", json=body, headers=gateway.headers, timeout=60)


def http_tokens(gateway: Gateway, model: str) -> list[int]:
    body = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    r = post(gateway, "/v1/completions", body)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == model
    return list(r.json()["choices"][0]["token_ids"])


def grpc_tokens(stub: pb_grpc.EngineStub, lora_name: str) -> list[int]:
    request = add_request(f"direct-{lora_name}", PROMPT, MAX_TOKENS)
    request.lora_name = lora_name
    return tokens_of(generate(stub, request))


def cards(gateway: Gateway) -> dict[str, dict[str, object]]:
    r = httpx.get(f"{gateway.url}/v1/models", headers=gateway.headers, timeout=30)
    assert r.status_code == 200, r.text
    return {c["id"]: c for c in r.json()["data"]}


def test_a_startup_adapter_is_listed_and_served(
    servers: tuple[pb_grpc.EngineStub, Gateway], adapters: dict[str, Path]
) -> None:
    stub, gateway = servers
    listed = cards(gateway)
    assert listed["alpha"]["parent"] == MODEL
    assert listed["alpha"]["root"] == str(adapters["alpha"])
    base = http_tokens(gateway, MODEL)
    alpha = http_tokens(gateway, "alpha")
    assert alpha == grpc_tokens(stub, "alpha")  # the gateway sent lora_name
    assert base == grpc_tokens(stub, "")
    assert alpha != base


def test_load_serve_and_unload(
    servers: tuple[pb_grpc.EngineStub, Gateway], adapters: dict[str, Path]
) -> None:
    stub, gateway = servers
    r = post(
        gateway, "/v1/load_lora_adapter", {"lora_name": "beta", "lora_path": str(adapters["beta"])}
    )
    assert r.status_code == 200, r.text
    assert "beta" in cards(gateway)
    beta = http_tokens(gateway, "beta")
    assert beta == grpc_tokens(stub, "beta")
    assert beta != http_tokens(gateway, "alpha")

    again = post(
        gateway, "/v1/load_lora_adapter", {"lora_name": "beta", "lora_path": str(adapters["beta"])}
    )
    assert again.status_code == 400 and again.json()["error"]["param"] == "lora_name"

    r = post(gateway, "/v1/unload_lora_adapter", {"lora_name": "beta"})
    assert r.status_code == 200, r.text
    assert "beta" not in cards(gateway)
    gone = post(gateway, "/v1/completions", {"model": "beta", "prompt": PROMPT, "max_tokens": 2})
    assert gone.status_code == 404
    assert post(gateway, "/v1/unload_lora_adapter", {"lora_name": "beta"}).status_code == 404


def test_a_bad_directory_is_400_naming_the_file(
    servers: tuple[pb_grpc.EngineStub, Gateway], adapters: dict[str, Path]
) -> None:
    stub, gateway = servers
    body = {"lora_name": "broken", "lora_path": str(adapters["broken"])}
    r = post(gateway, "/v1/load_lora_adapter", body)
    assert r.status_code == 400, r.text
    assert "adapter_model.safetensors" in r.json()["error"]["message"]
    assert "broken" not in cards(gateway)
    assert http_tokens(gateway, "alpha") == grpc_tokens(stub, "alpha")  # still served


def test_metrics_name_the_adapter_a_running_request_uses(
    servers: tuple[pb_grpc.EngineStub, Gateway],
) -> None:
    """vllm:lora_requests_info, from the engine's load figures: while a request for "alpha"
    streams, the series names it among the running adapters, with the engine's max_loras."""
    from prometheus_client.parser import text_string_to_metric_families

    _, gateway = servers
    body = {
        "model": "alpha",
        "prompt": PROMPT,
        "max_tokens": 400,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    url, headers = gateway.url, gateway.headers
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: {"))  # it is running
        scrape = httpx.get(f"{url}/metrics", headers=headers, timeout=30).text
        info = [
            s.labels
            for family in text_string_to_metric_families(scrape)
            for s in family.samples
            if s.name == "vllm:lora_requests_info"
        ]
        for _ in lines:  # read it to the end
            pass
    assert len(info) == 1, info
    assert info[0]["running_lora_adapters"] == "alpha"
    assert info[0]["waiting_lora_adapters"] == ""
    assert info[0]["max_lora"] == "2"
