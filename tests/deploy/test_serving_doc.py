"""docs/serving-a-checkpoint.md says only what works: every ``--flag`` it names exists (on the
engine, the gateway, or the outside tool the text runs), its compose overrides pass
``docker-compose config`` on top of docker-compose.yml with engine commands the engine parses, and
its chart values render to valid Kubernetes objects whose engine arguments the engine parses, as
does its download Job."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from typing import Any

import yaml

from engine_svc.__main__ import build_parser as engine_parser
from frontend_svc.config import build_arg_parser as gateway_parser
from tests.deploy.conftest import REPO
from tests.deploy.test_helm import K8S_VERSION, kubernetes_validate, render
from tests.external_tools import require

DOC = REPO / "docs" / "serving-a-checkpoint.md"
# Flags of the other commands the page runs: hf download, docker compose, kubectl.
OTHER_TOOLS = {"--include", "--local-dir", "--revision", "--build", "--wait", "--from-literal"}


def yaml_blocks() -> list[Any]:
    return [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", DOC.read_text(), re.S)]


def blocks_with(key: str) -> list[dict[str, Any]]:
    found = [b for b in yaml_blocks() if key in b]
    assert found, f"no YAML block with {key!r} in {DOC.name}"
    return found


def test_every_flag_it_names_exists() -> None:
    known = set(OTHER_TOOLS)
    for parser in (engine_parser(), gateway_parser({})):
        for action in parser._actions:
            known.update(action.option_strings)
    named = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", DOC.read_text()))
    assert named <= known, named - known


def test_compose_overrides_validate(tmp_path: Path) -> None:
    compose = require("docker-compose", "validates the compose files (scripts/install_compose.sh)")
    for i, block in enumerate(blocks_with("services")):
        override = tmp_path / f"override{i}.yml"
        override.write_text(yaml.safe_dump(block))
        done = subprocess.run(
            [compose, "-f", str(REPO / "docker-compose.yml"), "-f", str(override), "config"],
            capture_output=True,
            text=True,
            timeout=120,
            env={"PATH": os.environ["PATH"], "HOME": str(tmp_path), "MODEL_DIR": str(tmp_path)},
            cwd=REPO,
        )
        assert done.returncode == 0, done.stderr
        engine_parser().parse_args(yaml.safe_load(done.stdout)["services"]["engine"]["command"])


def test_chart_values_render_valid_objects() -> None:
    for values in blocks_with("engine"):
        for path, text in render(values).items():
            if path.endswith("NOTES.txt"):
                continue
            for obj in yaml.safe_load_all(text):
                if not obj:
                    continue
                kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
                if obj["kind"] == "Deployment" and path.endswith("engine-deployment.yaml"):
                    (engine,) = obj["spec"]["template"]["spec"]["containers"]
                    engine_parser().parse_args(engine["args"])


def test_download_job_is_valid() -> None:
    (job,) = [b for b in yaml_blocks() if b.get("kind") == "Job"]
    kubernetes_validate.validate(job, K8S_VERSION, strict=True)
    (fetch,) = job["spec"]["template"]["spec"]["containers"]
    assert "hf download" in fetch["args"][0]


def test_the_readme_links_it() -> None:
    assert "docs/serving-a-checkpoint.md" in (REPO / "README.md").read_text()
