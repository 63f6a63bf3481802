"""The engine's layers read top-down, and the imports say so:

    __main__, rpc/, entrypoints/     the edges (gRPC server, offline LLM)
    loop/, engine_core.py            the busy loop and the orchestrator
    executor/                        the runner(s) the orchestrator drives (tensor parallelism)
    worker/, models/, lora/, ...     what runs the model
    distributed/                     process groups and collectives (tensor parallelism)
    core/                            CPU bookkeeping: scheduler, KV cache, requests (no torch)

A folder never imports a layer above it. The exceptions are types, named under ``TYPE_CHECKING``
only: ``core/request.py`` names a request's grammar (a ``structured_output`` object), and
``core/scheduler.py`` names ``SchedulerConfig`` (in ``config.py``, which pulls in the kernels and
torch).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ENGINE = Path(__file__).resolve().parents[2] / "engine_svc"

ABOVE_WORKER = (
    "engine_svc.rpc",
    "engine_svc.entrypoints",
    "engine_svc.loop",
    "engine_svc.engine_core",
)
# What each folder must not import at all (a TYPE_CHECKING import included), and what it may
# import for types only.
RULES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "core": (
        (*ABOVE_WORKER, "engine_svc.worker", "engine_svc.models", "engine_svc.lora"),
        ("engine_svc.structured_output", "engine_svc.config"),
    ),
    "worker": (ABOVE_WORKER, ()),
    # process groups and collectives: below the model, which they know nothing of
    "distributed": (
        (*ABOVE_WORKER, "engine_svc.worker", "engine_svc.models", "engine_svc.lora"),
        (),
    ),
    "models": (ABOVE_WORKER, ()),
    "lora": (ABOVE_WORKER, ()),
    "structured_output": (ABOVE_WORKER, ()),
    "loop": (("engine_svc.rpc", "engine_svc.entrypoints"), ()),
    # the runner(s) the engine core drives: beside it, below the loop and the edges
    "executor": (ABOVE_WORKER, ()),
}


def _imports(path: Path) -> list[tuple[str, bool]]:
    """(module, whether only for type checking) of every import in ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    typing_only: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            typing_only.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.append((node.module, id(node) in typing_only))
        elif isinstance(node, ast.Import):
            found += [(alias.name, id(node) in typing_only) for alias in node.names]
    return found


def _under(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


@pytest.mark.parametrize("folder", sorted(RULES))
def test_no_folder_imports_a_layer_above_it(folder: str) -> None:
    never, types_only = RULES[folder]
    wrong = []
    for path in sorted((ENGINE / folder).glob("*.py")):
        for module, typing_only in _imports(path):
            if _under(module, never) or (_under(module, types_only) and not typing_only):
                wrong.append(f"{path.relative_to(ENGINE.parent)}: {module}")
    assert not wrong, "imports from a layer above:\n" + "\n".join(wrong)


def test_the_rule_sees_a_forbidden_import(tmp_path: Path) -> None:
    """The check itself: a runtime import is caught, a type-only one told apart."""
    source = tmp_path / "m.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "from engine_svc.worker.model_runner import ModelRunner\n"
        "import engine_svc.engine_core\n"
        "if TYPE_CHECKING:\n"
        "    from engine_svc.config import SchedulerConfig\n"
    )
    found = [(m, t) for m, t in _imports(source) if m.startswith("engine_svc")]
    assert found == [
        ("engine_svc.worker.model_runner", False),
        ("engine_svc.engine_core", False),
        ("engine_svc.config", True),
    ]


def test_bookkeeping_and_client_batches_import_without_torch() -> None:
    """core/ is CPU bookkeeping, and a consumer of the loop's batches (``ClientBatch``, the
    refusals) needs neither torch nor the engine core."""
    modules = sorted(f"engine_svc.core.{p.stem}" for p in (ENGINE / "core").glob("[!_]*.py"))
    modules += ["engine_svc.loop.clients", "engine_svc.loop.errors"]
    code = (
        f"import sys\nfor m in {modules!r}:\n    __import__(m)\n"
        "bad = [m for m in ('torch', 'engine_svc.engine_core') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ENGINE.parent)
