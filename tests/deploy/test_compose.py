"""docker-compose.yml (GPU) and docker-compose.cpu.yml, validated by a real compose.

``docker-compose config`` (Debian's docker-compose 1.29; ``scripts/install_compose.sh``) checks a
file against the compose schema and interpolates it with no Docker engine. The rendered config is
then held to what the services need: the GPU reservation, the read-only model volume, the
health-gated start of the gateway, the ports, the engine's flags as the engine parses them.
Broken copies must fail. The gateway's readiness check is run against live gateways.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from engine_svc import healthcheck
from engine_svc.__main__ import parse_args as engine_args
from frontend_svc.config import FrontendConfig, config_from_args
from tests.deploy.conftest import REPO
from tests.deploy.dockerfile import parse, seconds
from tests.external_tools import require
from tests.integration.harness import Gateway

GPU_FILE = REPO / "docker-compose.yml"
CPU_FILE = REPO / "docker-compose.cpu.yml"
ENGINE_DOCKERFILE = REPO / "docker" / "engine.Dockerfile"


@pytest.fixture(scope="module")
def compose() -> str:
    return require("docker-compose", "validates the compose files (scripts/install_compose.sh)")


def run_config(
    compose: str, file: Path, **env: str
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any] | None]:
    """``docker-compose -f FILE config`` with only ``env`` (plus PATH and HOME) in the
    environment; relative paths resolve against the repository, as for the real files."""
    done = subprocess.run(
        [compose, "--project-directory", str(REPO), "-f", str(file), "config"],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp"), **env},
        cwd=REPO,
    )
    rendered = yaml.safe_load(done.stdout) if done.returncode == 0 else None
    return done, rendered


def rendered_ok(compose: str, file: Path, **env: str) -> dict[str, Any]:
    done, config = run_config(compose, file, **env)
    assert done.returncode == 0, done.stderr
    assert config is not None
    return config


def volumes(service: dict[str, Any]) -> list[tuple[str, str, bool]]:
    """(source, target, read_only) of each volume, from the short or the long syntax."""
    out = []
    for v in service.get("volumes", []):
        if isinstance(v, str):
            parts = v.split(":")
            out.append((parts[0], parts[1], len(parts) > 2 and "ro" in parts[2].split(",")))
        else:
            out.append((v["source"], v["target"], bool(v.get("read_only"))))
    return out


def ports(service: dict[str, Any]) -> list[tuple[str, int, int]]:
    """(host ip, published, target) of each port, from the short or the long syntax."""
    out = []
    for p in service.get("ports", []):
        if isinstance(p, dict):
            out.append((p.get("host_ip", ""), int(p["published"]), int(p["target"])))
        else:
            spec = str(p).split("/")[0].split(":")
            ip = spec[0] if len(spec) == 3 else ""
            out.append((ip, int(spec[-2]), int(spec[-1])))
    return out


def gpu_devices(service: dict[str, Any]) -> list[dict[str, Any]]:
    return service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])


def engine_image() -> tuple[list[str], dict[str, str], set[str]]:
    """The engine Dockerfile's ENTRYPOINT, final ENV and every ARG name."""
    df = parse(ENGINE_DOCKERFILE.read_text())
    entry = df.final.last("ENTRYPOINT")
    assert entry is not None and entry.exec_form is not None
    names = set(df.global_args) | {n for s in df.stages for n in df.arg_defaults(s)}
    return entry.exec_form, df.env(df.final), names


def engine_flags(service: dict[str, Any]) -> Any:
    """The engine's parsed flags for this service: image ENTRYPOINT + compose command."""
    entry, _, _ = engine_image()
    assert entry[:3] == ["python", "-m", "engine_svc"]
    command = service["command"]
    assert isinstance(command, list), "command in exec (list) form"
    return engine_args(entry[3:] + command)


def check_common(config: dict[str, Any], api_key: str) -> None:
    """What both files promise: health-checked engine, health-gated gateway on port 8000."""
    services = config["services"]
    assert set(services) == {"engine", "frontend"}
    engine, frontend = services["engine"], services["frontend"]
    default_port = engine_args([]).port

    assert engine["build"]["dockerfile"] == "docker/engine.Dockerfile"
    assert frontend["build"]["dockerfile"] == "docker/frontend.Dockerfile"
    for service in (engine, frontend):
        assert Path(service["build"]["context"]) == REPO
        assert (REPO / service["build"]["dockerfile"]).is_file()

    flags = engine_flags(engine)
    assert (flags.host, flags.port) == ("0.0.0.0", default_port)
    test = engine["healthcheck"]["test"]
    assert test[:4] == ["CMD", "python", "-m", "engine_svc.healthcheck"]
    check = healthcheck.parse_args(test[4:])
    assert check.address.rsplit(":", 1)[1] == str(flags.port)
    assert seconds(engine["healthcheck"]["timeout"]) > check.timeout
    # Docker's default 10s would SIGKILL the engine in the middle of its drain.
    assert seconds(engine["stop_grace_period"]) > flags.shutdown_timeout
    assert ports(engine) == [("127.0.0.1", default_port, default_port)]

    assert frontend["depends_on"] == {"engine": {"condition": "service_healthy"}}
    assert ports(frontend) == [("", FrontendConfig().port, FrontendConfig().port)]
    assert not gpu_devices(frontend)
    env = {k: "" if v is None else str(v) for k, v in frontend["environment"].items()}
    gateway = config_from_args([], environ=env)
    assert gateway.engine_address == f"engine:{flags.port}"
    assert gateway.api_key == (api_key or None)
    assert gateway.workers == 1
    ready = frontend["healthcheck"]["test"]
    assert ready[:3] == ["CMD", "python", "-c"] and f":{gateway.port}/health" in ready[3]


# ---------------------------------------------------------------------------- the GPU file


def test_gpu_file(compose: str, tmp_path: Path) -> None:
    model = tmp_path / "Qwen3-0.6B"
    config = rendered_ok(compose, GPU_FILE, MODEL_DIR=str(model), TANDEM_API_KEY="sk-test")
    check_common(config, api_key="sk-test")
    engine = config["services"]["engine"]
    [device] = gpu_devices(engine)
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    assert device.get("count") in (1, "all") or device.get("device_ids")
    assert volumes(engine) == [(str(model), "/models", True)]
    assert engine_flags(engine).model == "/models"
    assert engine_flags(engine).device == "auto"


def test_gpu_file_requires_model_dir(compose: str) -> None:
    for env in ({}, {"MODEL_DIR": ""}):
        done, _ = run_config(compose, GPU_FILE, **env)
        assert done.returncode != 0, env
        assert "set MODEL_DIR to a Hugging Face checkpoint directory" in done.stderr, done.stderr


def test_tensor_parallel_size_follows_the_environment(compose: str) -> None:
    engine = rendered_ok(compose, GPU_FILE, MODEL_DIR="/m")["services"]["engine"]
    assert engine_flags(engine).tensor_parallel_size == 1
    [device] = gpu_devices(engine)
    assert device["count"] == "all"  # the ranks take the first N of the machine's GPUs
    assert engine["shm_size"]  # NCCL's /dev/shm
    engine = rendered_ok(compose, GPU_FILE, MODEL_DIR="/m", TANDEM_TENSOR_PARALLEL_SIZE="4")
    assert engine_flags(engine["services"]["engine"]).tensor_parallel_size == 4


def test_host_ports_follow_the_environment(compose: str) -> None:
    config = rendered_ok(
        compose, GPU_FILE, MODEL_DIR="/m", TANDEM_PORT="9000", TANDEM_ENGINE_PORT="6000"
    )
    assert ports(config["services"]["frontend"]) == [("", 9000, 8000)]
    assert ports(config["services"]["engine"]) == [("127.0.0.1", 6000, 50051)]


@pytest.mark.parametrize("file", [GPU_FILE, CPU_FILE], ids=["gpu", "cpu"])
def test_gateway_workers_follow_the_environment(compose: str, file: Path) -> None:
    config = rendered_ok(compose, file, MODEL_DIR="/m", TANDEM_WORKERS="4")
    env = {
        k: "" if v is None else str(v)
        for k, v in config["services"]["frontend"]["environment"].items()
    }
    assert config_from_args([], environ=env).workers == 4


@pytest.mark.parametrize("file", [GPU_FILE, CPU_FILE], ids=["gpu", "cpu"])
def test_gateway_tool_calling_follows_the_environment(compose: str, file: Path) -> None:
    def gateway(**environ: str) -> Any:
        config = rendered_ok(compose, file, MODEL_DIR="/m", **environ)
        env = {
            k: "" if v is None else str(v)
            for k, v in config["services"]["frontend"]["environment"].items()
        }
        return config_from_args([], environ=env)

    default = gateway()
    assert (default.tool_call_parser, default.enable_auto_tool_choice) == (None, False)
    assert default.reasoning_parser is None
    on = gateway(TANDEM_TOOL_CALL_PARSER="hermes", TANDEM_ENABLE_AUTO_TOOL_CHOICE="true")
    assert (on.tool_call_parser, on.enable_auto_tool_choice) == ("hermes", True)
    assert gateway(TANDEM_REASONING_PARSER="qwen3").reasoning_parser == "qwen3"


# ---------------------------------------------------------------------------- the CPU file


def test_cpu_file(compose: str) -> None:
    config = rendered_ok(compose, CPU_FILE)  # no MODEL_DIR, no API key
    check_common(config, api_key="")
    engine = config["services"]["engine"]
    assert not gpu_devices(engine)
    flags = engine_flags(engine)
    assert (flags.model, flags.device) == (None, "cpu")  # the embedded default model
    _, image_env, arg_names = engine_image()
    assert volumes(engine) == [("tandem-cache", image_env["TANDEM_CACHE_DIR"], False)]
    assert "tandem-cache" in config["volumes"]
    args = engine["build"]["args"]
    assert set(args) <= arg_names, "every build arg must be an ARG of the Dockerfile"
    assert not args["BASE_IMAGE"].startswith("nvidia/")
    assert args["TORCH_INDEX_URL"].endswith("/whl/cpu")
    assert args["EXTRAS"].split(",") == ["engine"]
    assert (
        engine["image"]
        != rendered_ok(compose, GPU_FILE, MODEL_DIR="/m")["services"]["engine"]["image"]
    ), "the CPU build must not overwrite the GPU image's tag"


def test_both_files_run_the_same_gateway(compose: str) -> None:
    gpu = rendered_ok(compose, GPU_FILE, MODEL_DIR="/m", TANDEM_API_KEY="k")
    cpu = rendered_ok(compose, CPU_FILE, TANDEM_API_KEY="k")
    assert gpu["services"]["frontend"] == cpu["services"]["frontend"]


# ---------------------------------------------------------------------------- broken copies


def _set(path: list[str], value: Any) -> Any:
    def edit(doc: dict[str, Any]) -> None:
        node = doc
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value

    return edit


def _drop_build(doc: dict[str, Any]) -> None:
    del doc["services"]["frontend"]["build"], doc["services"]["frontend"]["image"]


BREAKS = {  # edit, and what the error must name
    "condition": (
        _set(["services", "frontend", "depends_on", "engine", "condition"], "ready"),
        "condition",
    ),
    "unknown-key": (_set(["services", "engine", "imagee"], "tandem-engine"), "imagee"),
    "ports-type": (_set(["services", "frontend", "ports"], "8000:8000"), "ports"),
    "healthcheck-key": (
        _set(["services", "engine", "healthcheck", "command"], ["true"]),
        "healthcheck",
    ),
    "volumes-type": (_set(["services", "engine", "volumes"], "/x:/models:ro"), "volumes"),
    "no-image-or-build": (_drop_build, "neither an image nor a build"),
}


@pytest.mark.parametrize("case", sorted(BREAKS))
@pytest.mark.parametrize("file", [GPU_FILE, CPU_FILE], ids=["gpu", "cpu"])
def test_broken_copies_fail(compose: str, tmp_path: Path, file: Path, case: str) -> None:
    doc = yaml.safe_load(file.read_text())
    control = tmp_path / "control.yml"
    control.write_text(yaml.safe_dump(doc))
    assert run_config(compose, control, MODEL_DIR="/m")[0].returncode == 0  # the copy is sound
    edit, named = BREAKS[case]
    edit(doc)
    broken = tmp_path / "broken.yml"
    broken.write_text(yaml.safe_dump(doc))
    done, _ = run_config(compose, broken, MODEL_DIR="/m")
    assert done.returncode != 0, done.stdout
    assert named in done.stderr, done.stderr


def test_gpu_reservation_must_be_a_list_of_capabilities(compose: str, tmp_path: Path) -> None:
    doc = yaml.safe_load(GPU_FILE.read_text())
    devices = doc["services"]["engine"]["deploy"]["resources"]["reservations"]["devices"]
    devices[0]["capabilities"] = "gpu"
    broken = tmp_path / "broken.yml"
    broken.write_text(yaml.safe_dump(doc))
    done, _ = run_config(compose, broken, MODEL_DIR="/m")
    assert done.returncode != 0 and "capabilities" in done.stderr


def test_yaml_syntax_error_fails(compose: str, tmp_path: Path) -> None:
    broken = tmp_path / "broken.yml"
    broken.write_text(GPU_FILE.read_text() + "\n  oops: [unclosed\n")
    assert run_config(compose, broken, MODEL_DIR="/m")[0].returncode != 0


# ---------------------------------------------------------------------------- live readiness


def _readiness_argv(port: int) -> list[str]:
    config = yaml.safe_load(GPU_FILE.read_text())
    test = config["services"]["frontend"]["healthcheck"]["test"]
    assert test[:3] == ["CMD", "python", "-c"]
    return [sys.executable, "-c", test[3].replace(":8000/", f":{port}/")]


def test_gateway_readiness_check_passes_when_connected(live_gateway: Gateway) -> None:
    done = subprocess.run(_readiness_argv(live_gateway.port), capture_output=True, timeout=30)
    assert done.returncode == 0, done.stderr


def test_gateway_readiness_check_fails_without_engine(lonely_gateway: Gateway) -> None:
    """Against a gateway with no engine (/health 503) the compose check fails, so `up --wait`
    does not report the stack ready; /live (the image's own check) would pass."""
    import time

    import httpx

    live = f"http://127.0.0.1:{lonely_gateway.port}/live"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(live, timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.2)
    else:
        pytest.fail(f"gateway never answered /live:\n{lonely_gateway.log_tail()}")
    done = subprocess.run(_readiness_argv(lonely_gateway.port), capture_output=True, timeout=30)
    assert done.returncode == 1
    assert b"503" in done.stderr
