"""The committed stubs match the .proto, and the contract is what the gateway relies on."""

from __future__ import annotations

import filecmp
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GENERATED = ("engine_pb2.py", "engine_pb2.pyi", "engine_pb2_grpc.py")
pytestmark = pytest.mark.timeout(120)


def test_committed_stubs_are_fresh(tmp_path: Path) -> None:
    subprocess.run(
        ["bash", str(ROOT / "scripts" / "gen_protos.sh"), str(tmp_path)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    committed = ROOT / "protos" / "tandem" / "engine" / "v1"
    fresh = tmp_path / "tandem" / "engine" / "v1"
    stale = [name for name in GENERATED if not filecmp.cmp(committed / name, fresh / name, False)]
    assert not stale, f"stale generated stubs {stale}: run scripts/gen_protos.sh"


def test_stubs_import_by_package_path() -> None:
    from protos.tandem.engine.v1 import engine_pb2, engine_pb2_grpc

    assert engine_pb2.DESCRIPTOR.package == "tandem.engine.v1"
    assert engine_pb2.DESCRIPTOR.name == "tandem/engine/v1/engine.proto"
    service = engine_pb2.DESCRIPTOR.services_by_name["Engine"]
    assert {m.name for m in service.methods} == {
        "Stream",
        "Generate",
        "Abort",
        "GetModelInfo",
        "GetTokenizer",
        "AddLora",
        "RemoveLora",
        "ListLoras",
        "PinLora",
        "ResetPrefixCache",
        "Sleep",
        "WakeUp",
        "IsSleeping",
        "StartProfile",
        "StopProfile",
    }
    assert hasattr(engine_pb2_grpc, "EngineStub")


def test_sampling_fields_with_non_zero_defaults_are_optional() -> None:
    from protos.tandem.engine.v1 import engine_pb2

    fields = engine_pb2.SamplingParams.DESCRIPTOR.fields_by_name
    optional = {n for n, f in fields.items() if f.has_presence}
    assert {
        "max_tokens",
        "temperature",
        "top_p",
        "seed",
        "repetition_penalty",
        "logprobs",
        "prompt_logprobs",
    } <= optional
    params = engine_pb2.SamplingParams(temperature=0.0)
    assert params.HasField("temperature") and not params.HasField("top_p")
