"""Architecture rules: the gateway never imports torch; only the engine client sees protobuf."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(60)


def test_gateway_does_not_import_torch() -> None:
    code = (
        "import sys\n"
        "import frontend_svc, frontend_svc.server.app, frontend_svc.__main__\n"
        "from frontend_svc.server.app import build_app\n"
        "from frontend_svc.config import FrontendConfig\n"
        "build_app(FrontendConfig())\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'transformers', 'numpy'))\n"
        "assert not heavy, heavy\n"
    )
    _runs_clean(code)


def _runs_clean(code: str) -> None:
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr


def _importers(folder: str, *needles: str) -> list[str]:
    return sorted(
        str(p.relative_to(ROOT))
        for p in (ROOT / folder).rglob("*.py")
        if any(n in p.read_text() for n in needles)
    )


# The stubs, and the contract's modules that speak the wire format (messages <-> types, the
# Stream's outbox): the types themselves (protos.types) are for everyone.
_WIRE = (
    "protos.tandem",
    "engine_pb2",
    "protos.convert",
    "protos.stream_outbox",
    "protos import convert",
)


def test_only_the_gateways_engine_folder_imports_the_stubs() -> None:
    importers = _importers("frontend_svc", *_WIRE)
    assert importers, "the rule must look at something"
    assert all(p.startswith("frontend_svc/engine/") for p in importers), importers


def test_only_the_engines_rpc_folder_imports_the_stubs() -> None:
    importers = _importers("engine_svc", *_WIRE)
    assert importers, "the rule must look at something"
    assert all(p.startswith("engine_svc/rpc/") for p in importers), importers


def test_neither_service_imports_the_other() -> None:
    for folder, other in (("frontend_svc", "engine_svc"), ("engine_svc", "frontend_svc")):
        pattern = re.compile(rf"^\s*(from|import) {other}\b", re.M)
        offenders = [
            str(p.relative_to(ROOT))
            for p in (ROOT / folder).rglob("*.py")
            if pattern.search(p.read_text())
        ]
        assert offenders == [], offenders


def test_the_contract_package_imports_no_torch_and_neither_service() -> None:
    """protos/ is what both services share: importing every module of it pulls in no torch and
    no code of either service."""
    modules = sorted(
        ".".join(p.relative_to(ROOT).with_suffix("").parts)
        for p in (ROOT / "protos").rglob("*.py")
        if p.name != "__init__.py"
    )
    assert "protos.flow_window" in modules
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'numpy', 'frontend_svc', 'engine_svc'))\n"
        "assert not bad, bad\n"
    )
    _runs_clean(code)


def test_each_type_of_the_contract_is_defined_once() -> None:
    """The types that cross the boundary, the window and the merge rule live in protos/ only;
    the engine's ModelInfo may extend the contract's (its checks), not redefine its fields."""
    import protos.types

    names = {
        n
        for n, v in vars(protos.types).items()
        if isinstance(v, type) and v.__module__ == "protos.types"
    } | {"FlowWindow", "StreamOutbox"}
    assert {"EngineRequest", "LoadFigures", "ModelInfo", "FinishReason"} <= names
    pattern = re.compile(rf"^class ({'|'.join(sorted(names))})\b(?!\(contract\.)", re.M)
    offenders = [
        f"{p.relative_to(ROOT)}: {m.group(0)}"
        for folder in ("frontend_svc", "engine_svc", "benchmarks", "tests")
        for p in (ROOT / folder).rglob("*.py")
        for m in pattern.finditer(p.read_text())
    ]
    assert offenders == [], offenders
