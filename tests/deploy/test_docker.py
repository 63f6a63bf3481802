"""The container images, checked without a Docker engine.

The Dockerfiles are parsed (tests/deploy/dockerfile.py) and held to what a build and a run would
need: every COPY source exists and survives .dockerignore, the modules the images run exist in
the packages they copy, a non-root USER, a HEALTHCHECK, EXPOSE matching the services' default
ports, the engine's command line accepted by the engine's own parser, torch pinned like
pyproject.toml, and no torch or CUDA anywhere near the gateway image. Every check is also shown
to catch a broken copy. The images' health-check commands are run against live processes.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.deploy.conftest import REPO
from tests.deploy.dockerfile import (
    Dockerfile,
    DockerfileError,
    DockerIgnore,
    Stage,
    exposed,
    glob_context,
    healthcheck_argv,
    parse,
    run_argv,
    seconds,
    shell_commands,
    substitute,
)
from tests.integration.harness import Engine, Gateway, free_port

tomllib = pytest.importorskip("tomllib")
requirements = pytest.importorskip("packaging.requirements")

ENGINE_DOCKERFILE = REPO / "docker" / "engine.Dockerfile"
FRONTEND_DOCKERFILE = REPO / "docker" / "frontend.Dockerfile"
ROOT_USERS = {"root", "0"}
ENGINE_EXTRAS_ONLY = re.compile(r"torch|cuda|cupy|nvidia|transformers|safetensors", re.I)


def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def dockerignore(text: str | None = None) -> DockerIgnore:
    return DockerIgnore.parse((REPO / ".dockerignore").read_text() if text is None else text)


def module_of(argv: list[str]) -> str | None:
    """MODULE of ``python -m MODULE ...``."""
    if len(argv) >= 3 and Path(argv[0]).name.startswith("python") and argv[1] == "-m":
        return argv[2]
    return None


def pip_installs(stage: Stage, variables: dict[str, str]) -> list[list[str]]:
    """The arguments of every ``pip install`` in the RUN lines of ``stage``."""
    out = []
    for ins in stage.all("RUN"):
        for words in shell_commands(substitute(ins.text, variables)):
            if words[:2] == ["pip", "install"]:
                out.append(words[2:])
            elif words[1:4] == ["-m", "pip", "install"]:
                out.append(words[4:])
    return out


# ---------------------------------------------------------------------------- the checks


def image_problems(df: Dockerfile, root: Path, ignore: DockerIgnore) -> list[str]:
    """What would make ``docker build -f ... root`` fail or the image misbehave."""
    problems: list[str] = []
    context = set(ignore.context_files(root))
    stage_names: set[str] = set()
    copied: set[str] = set()
    for stage in df.stages:
        variables = {**df.global_args, **df.arg_defaults(stage)}
        for ins in stage.all("COPY") + stage.all("ADD"):
            words = ins.words()
            if len(words) < 2:
                problems.append(f"line {ins.line}: {ins.keyword} needs a source and a target")
                continue
            if "from" in ins.flags:
                if ins.flags["from"] not in stage_names:
                    problems.append(f"line {ins.line}: --from={ins.flags['from']} is no stage")
                continue
            for source in words[:-1]:
                matches = glob_context(root, substitute(source, variables))
                if not matches:
                    problems.append(f"line {ins.line}: {source} does not exist in the context")
                for m in matches:
                    copied.add(m)
                    if m != "." and ignore.excluded(m):
                        problems.append(f"line {ins.line}: {m} is excluded by .dockerignore")
                    elif (root / m).is_dir() and not any(f.startswith(m + "/") for f in context):
                        problems.append(f"line {ins.line}: {m}/ has no file in the context")
        if stage.name:
            stage_names.add(stage.name)

    final = df.final
    user = final.last("USER")
    if user is None:
        problems.append("no USER: the container runs as root")
    elif user.text.split(":")[0] in ROOT_USERS:
        problems.append(f"line {user.line}: USER {user.text} runs as root")
    for keyword in ("ENTRYPOINT", "CMD"):
        run = final.last(keyword)
        if run is not None and run.exec_form is None:
            problems.append(f"line {run.line}: {keyword} in shell form: SIGTERM would reach sh")
    if final.last("ENTRYPOINT") is None and final.last("CMD") is None:
        problems.append("no ENTRYPOINT or CMD")
    health = final.last("HEALTHCHECK")
    argvs = [run_argv(final)]
    if health is None:
        problems.append("no HEALTHCHECK")
    else:
        argv = healthcheck_argv(health)
        if argv is None:
            problems.append(f"line {health.line}: HEALTHCHECK NONE")
        else:
            argvs.append(argv)
            if seconds(health.flags.get("timeout", "30s")) <= 0:
                problems.append(f"line {health.line}: HEALTHCHECK timeout must be positive")
    for argv in argvs:
        module = module_of(argv)
        if module is None:
            continue
        spec = importlib.util.find_spec(module)
        if spec is None or spec.origin is None or not Path(spec.origin).is_relative_to(root):
            problems.append(f"python -m {module}: no such module in the repository")
        elif module.split(".")[0] not in copied and "." not in copied:
            problems.append(f"python -m {module}: its package is never copied into the image")
    if not exposed(final):
        problems.append("no EXPOSE")
    return problems


def engine_problems(df: Dockerfile) -> list[str]:
    """The engine image's own rules, beyond :func:`image_problems`."""
    from engine_svc import healthcheck
    from engine_svc.__main__ import parse_args

    problems: list[str] = []
    base = df.global_args.get("BASE_IMAGE", df.final.base)
    m = re.fullmatch(
        r"nvidia/cuda:(\d+)\.(\d+)(?:\.\d+)?-(?:cudnn\d*-)?runtime-ubuntu(\d+\.\d+)", base
    )
    if m is None:
        problems.append(f"base image {base} is not an nvidia/cuda runtime image")
    else:
        if {"22.04": (3, 10), "24.04": (3, 12)}.get(m.group(3), (0, 0)) < (3, 11):
            problems.append(f"ubuntu {m.group(3)}'s python3 is older than 3.11")
        builder = df.stages[0]
        index = df.arg_defaults(builder).get("TORCH_INDEX_URL", "")
        if not index.endswith(f"/cu{m.group(1)}{m.group(2)}"):
            problems.append(f"TORCH_INDEX_URL {index} is not the CUDA {m[1]}.{m[2]} wheel index")
    builder = df.stages[0]
    args = df.arg_defaults(builder)
    extras = pyproject()["project"]["optional-dependencies"]
    torch_req = next(
        requirements.Requirement(r)
        for r in extras["engine"]
        if requirements.Requirement(r).name == "torch"
    )
    spec = args.get("TORCH_SPEC", "")
    if not spec or requirements.Requirement(spec).specifier != torch_req.specifier:
        problems.append(f"TORCH_SPEC {spec!r} differs from pyproject's {torch_req}")
    wanted = set(args.get("EXTRAS", "").split(","))
    if not {"engine", "gpu"} <= wanted or not wanted <= set(extras):
        problems.append(f"EXTRAS {args.get('EXTRAS')!r} must name pyproject extras engine,gpu")
    installs = pip_installs(builder, {**df.global_args, **args})
    torch_at = next((i for i, a in enumerate(installs) if torch_req.name in " ".join(a)), None)
    package_at = next((i for i, a in enumerate(installs) if a and a[-1].startswith(".[")), None)
    if torch_at is None or package_at is None or torch_at > package_at:
        problems.append("torch must be installed from TORCH_INDEX_URL before the package")
    elif "--index-url" in installs[package_at]:
        problems.append("the package's own dependencies must come from the default index")

    final = df.final
    argv = run_argv(final)
    if module_of(argv) != "engine_svc":
        problems.append(f"the image runs {argv}, not python -m engine_svc")
    else:
        try:
            flags = parse_args(argv[3:])
        except SystemExit:
            return [*problems, f"the engine rejects its command line {argv[3:]}"]
        if (flags.host, flags.model) != ("0.0.0.0", "/models"):
            problems.append(f"engine runs with --host {flags.host} --model {flags.model}")
        if flags.port not in exposed(final):
            problems.append(f"EXPOSE {exposed(final)} lacks the engine's port {flags.port}")
    health = final.last("HEALTHCHECK")
    check = healthcheck_argv(health) if health else None
    if check is None or module_of(check) != "engine_svc.healthcheck":
        problems.append("HEALTHCHECK is not python -m engine_svc.healthcheck")
    else:
        assert health is not None
        options = healthcheck.parse_args(check[3:])
        if options.address.rsplit(":", 1)[1] != str(parse_args([]).port):
            problems.append(f"HEALTHCHECK checks {options.address}, not the engine's port")
        if seconds(health.flags.get("timeout", "30s")) <= options.timeout:
            problems.append("HEALTHCHECK --timeout must exceed the check's own --timeout")
    cache = df.env(final).get("TANDEM_CACHE_DIR")
    commands = [c for ins in final.all("RUN") for c in shell_commands(ins.text)]
    made = any(c[0] == "mkdir" and cache in c for c in commands)
    owned = any(c[0] == "chown" and cache in c for c in commands)
    if not cache:
        problems.append("TANDEM_CACHE_DIR is not set")
    elif not (made and owned):
        problems.append(f"TANDEM_CACHE_DIR {cache} is not created and given to the user")
    return problems


def frontend_problems(df: Dockerfile) -> list[str]:
    """The gateway image: base dependencies only, no torch, no CUDA."""
    from frontend_svc.config import FrontendConfig, config_from_args

    problems: list[str] = []
    for stage in df.stages:
        if not re.fullmatch(r"python:3\.\d+-slim(-\w+)?", stage.base):
            problems.append(f"base image {stage.base} is not a slim Python image")
        variables = {**df.global_args, **df.arg_defaults(stage)}
        for ins in stage.all("RUN"):
            for words in shell_commands(substitute(ins.text, variables)):
                if "install" in words and ENGINE_EXTRAS_ONLY.search(" ".join(words)):
                    problems.append(f"line {ins.line}: installs an engine dependency: {words}")
        for ins in stage.all("ENV") + stage.all("ARG"):
            if ENGINE_EXTRAS_ONLY.search(ins.text):
                problems.append(f"line {ins.line}: {ins.keyword} names an engine dependency")
        for args in pip_installs(stage, variables):
            if args != ["."]:
                problems.append(f"pip install {' '.join(args)}: the gateway installs only '.'")
    final = df.final
    argv = run_argv(final)
    if module_of(argv) != "frontend_svc":
        problems.append(f"the image runs {argv}, not python -m frontend_svc")
    else:
        try:
            config = config_from_args(argv[3:], environ=df.env(final))
        except SystemExit:
            return [*problems, f"the gateway rejects its command line {argv[3:]}"]
        if config.host != "0.0.0.0":
            problems.append(f"the gateway listens on {config.host}, not 0.0.0.0")
        if config.port != FrontendConfig().port or config.port not in exposed(final):
            problems.append(f"EXPOSE {exposed(final)} lacks the gateway's port {config.port}")
    health = final.last("HEALTHCHECK")
    check = healthcheck_argv(health) if health else None
    if check is None or not re.search(r"urllib.*/(live|health)\b", " ".join(check)):
        problems.append("HEALTHCHECK does not GET /live or /health with urllib")
    return problems


def all_problems(
    engine_text: str | None = None, frontend_text: str | None = None, ignore_text: str | None = None
) -> dict[str, list[str]]:
    ignore = dockerignore(ignore_text)
    engine = parse(ENGINE_DOCKERFILE.read_text() if engine_text is None else engine_text)
    frontend = parse(FRONTEND_DOCKERFILE.read_text() if frontend_text is None else frontend_text)
    return {
        "engine": image_problems(engine, REPO, ignore) + engine_problems(engine),
        "frontend": image_problems(frontend, REPO, ignore) + frontend_problems(frontend),
    }


# ---------------------------------------------------------------------------- the real files


def test_dockerfiles_have_no_problems() -> None:
    assert all_problems() == {"engine": [], "frontend": []}


def test_build_context_holds_every_packaged_file_and_nothing_else() -> None:
    """What setuptools packs (pyproject's package list and package data) all reaches the builder;
    no virtual environment, VCS data, tests or caches do."""
    files = set(dockerignore().context_files(REPO))
    config = pyproject()["tool"]["setuptools"]
    packages = [p.rstrip("*") for p in config["packages"]["find"]["include"]]
    data = {f"{pkg}/{pat}" for pkg, pats in config["package-data"].items() for pat in pats}
    needed = {"pyproject.toml", "README.md"}
    for package in packages:
        for path in (REPO / package).rglob("*"):
            rel = path.relative_to(REPO).as_posix()
            if "__pycache__" in rel or not path.is_file():
                continue
            if path.suffix == ".py" or any(Path(rel).match(d) for d in data):
                needed.add(rel)
    assert needed - files == set()
    assert any(f.endswith(".cu") for f in needed)  # the package data is really in the set
    tops = {f.split("/")[0] for f in files}
    assert tops == set(packages) | {"pyproject.toml", "README.md"}
    assert not [f for f in files if "__pycache__" in f or f.endswith((".pyc", ".pem", ".key"))]


def test_frontend_packages_need_no_engine_dependency() -> None:
    """``pip install .`` brings only the base dependencies, and the gateway runs on them: its
    modules import (and build the app) with every engine-only package unimportable."""
    base = [requirements.Requirement(r).name for r in pyproject()["project"]["dependencies"]]
    assert not [name for name in base if ENGINE_EXTRAS_ONLY.search(name)], base
    code = (
        "import sys\n"
        "for name in ('torch', 'transformers', 'safetensors', 'cupy', 'engine_svc', 'kernels'):\n"
        "    sys.modules[name] = None\n"
        "import frontend_svc.__main__\n"
        "from frontend_svc.server.app import build_app\n"
        "from frontend_svc.config import config_from_args\n"
        "build_app(config_from_args([]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO
    )
    assert done.returncode == 0, done.stderr


# ---------------------------------------------------------------------------- broken copies


def _engine_text() -> str:
    return ENGINE_DOCKERFILE.read_text()


def _frontend_text() -> str:
    return FRONTEND_DOCKERFILE.read_text()


def _sub(old: str, new: str, count: int = 1) -> Callable[[str], str]:
    def edit(text: str) -> str:
        assert old in text, old
        return text.replace(old, new, count)

    return edit


def _drop_healthcheck(text: str) -> str:
    out, n = re.subn(r"HEALTHCHECK [^\n]*\\\n[^\n]*\n", "", text)
    assert n == 1
    return out


ENGINE_BREAKS = {
    "root-user": (_sub("USER 10001:10001", "USER root"), "runs as root"),
    "no-user": (_sub("USER 10001:10001\n", ""), "no USER"),
    "missing-source": (_sub("COPY kernels ./kernels", "COPY kernel ./kernels"), "does not exist"),
    "bad-from": (_sub("--from=builder", "--from=build"), "is no stage"),
    "no-healthcheck": (_drop_healthcheck, "no HEALTHCHECK"),
    "healthcheck-module": (
        _sub('"engine_svc.healthcheck", "--timeout"', '"engine_svc.health_check", "--timeout"'),
        "no such",
    ),
    "entry-module": (_sub('"-m", "engine_svc", "--host"', '"-m", "engine", "--host"'), "no such"),
    "shell-cmd": (_sub('CMD ["--model", "/models"]', "CMD --model /models"), "shell form"),
    "expose": (_sub("EXPOSE 50051", "EXPOSE 5051"), "lacks the engine's port"),
    "bind-loopback": (_sub('"--host", "0.0.0.0"', '"--host", "127.0.0.1"'), "--host 127.0.0.1"),
    "bad-engine-flag": (_sub('"--model", "/models"]', '"--modle", "/models"]'), "rejects"),
    "torch-range": (_sub('"torch>=2.5,<2.15"', '"torch>=2.5"'), "differs from pyproject"),
    "cuda-mismatch": (
        _sub(
            "URL=https://download.pytorch.org/whl/cu128",
            "URL=https://download.pytorch.org/whl/cu126",
        ),
        "not the CUDA 12.8 wheel index",
    ),
    "no-gpu-extra": (_sub("EXTRAS=engine,gpu", "EXTRAS=engine"), "EXTRAS"),
    "non-cuda-base": (
        _sub("BASE_IMAGE=nvidia/cuda:12.8.1-runtime-", "BASE_IMAGE=ubuntu:"),
        "not an nvidia/cuda",
    ),
    "cache-dir": (
        _sub("TANDEM_CACHE_DIR=/var/cache/tandem", "TANDEM_CACHE_DIR=/cache"),
        "/cache is not",
    ),
    "healthcheck-timeout": (_sub('"--timeout", "3"]', '"--timeout", "9"]'), "must exceed"),
}
FRONTEND_BREAKS = {
    "torch": (_sub("RUN pip install .", "RUN pip install torch && pip install ."), "engine dep"),
    "extras": (_sub("RUN pip install .", 'RUN pip install ".[engine]"'), "installs only '.'"),
    "apt-cuda": (
        _sub("RUN python -m venv", "RUN apt-get install -y nvidia-cuda-toolkit && python -m venv"),
        "installs an engine dependency",
    ),
    "index": (
        _sub("RUN pip install .", "RUN pip install --extra-index-url https://x/cu128 ."),
        "installs only '.'",
    ),
    "cuda-base": (
        _sub(
            "ARG PYTHON_IMAGE=python:3.12-slim-bookworm",
            "ARG PYTHON_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04",
        ),
        "slim",
    ),
    "root": (_sub("USER 10001:10001", "USER 0:0"), "runs as root"),
    "no-host": (_sub("TANDEM_HOST=0.0.0.0", "TANDEM_HOSTNAME=0.0.0.0"), "not 0.0.0.0"),
    "expose": (_sub("EXPOSE 8000", "EXPOSE 80"), "lacks the gateway's port"),
    "entry-module": (_sub('"-m", "frontend_svc"]', '"-m", "frontend"]'), "no such module"),
    "healthcheck": (_sub("/live'", "/alive'"), "HEALTHCHECK does not GET"),
    "missing-source": (_sub("COPY protos ./protos", "COPY proto ./protos"), "does not exist"),
}


@pytest.mark.parametrize("case", sorted(ENGINE_BREAKS))
def test_broken_engine_dockerfile_is_caught(case: str) -> None:
    edit, expected = ENGINE_BREAKS[case]
    problems = all_problems(engine_text=edit(_engine_text()))["engine"]
    assert any(expected in p for p in problems), problems


@pytest.mark.parametrize("case", sorted(FRONTEND_BREAKS))
def test_broken_frontend_dockerfile_is_caught(case: str) -> None:
    edit, expected = FRONTEND_BREAKS[case]
    problems = all_problems(frontend_text=edit(_frontend_text()))["frontend"]
    assert any(expected in p for p in problems), problems


@pytest.mark.parametrize(
    "extra, expected",
    [
        ("engine_svc\n", "engine_svc is excluded by .dockerignore"),
        ("**/*.py\n", "has no file in the context"),
        ("README.md\n", "README.md is excluded"),
    ],
)
def test_dockerignore_that_hides_a_source_is_caught(extra: str, expected: str) -> None:
    ignore = (REPO / ".dockerignore").read_text() + extra
    problems = all_problems(ignore_text=ignore)
    assert any(expected in p for p in problems["engine"] + problems["frontend"]), problems


@pytest.mark.parametrize(
    "text, error",
    [
        ("FROM a\nRUN x \\\n", "continuation at the end"),
        ("FROM a\nCOPPY a b\n", "unknown instruction COPPY"),
        ("RUN x\nFROM a\n", "RUN before FROM"),
        ("FROM a\nCMD [\"python\", '-m']\n", "not a valid JSON array"),
        ("FROM a\nCMD [1, 2]\n", "must hold strings"),
        ("FROM a b\n", "FROM IMAGE [AS NAME]"),
        ("ARG B\nFROM ${B}\n", "empty image name"),
        ("", "no FROM"),
    ],
)
def test_parser_rejects_broken_dockerfiles(text: str, error: str) -> None:
    with pytest.raises(DockerfileError, match=re.escape(error)):
        parse(text)


def test_parser_reads_continuations_args_and_forms() -> None:
    df = parse(
        "# syntax=docker/dockerfile:1\n"
        "ARG IMG=base:1\n"
        "FROM ${IMG} AS one\n"
        'ARG V="a b"\n'
        "ENV X=1 \\\n"
        "    # a comment inside the continuation\n"
        "    Y=${X}2\n"
        "RUN echo one \\\n"
        "\n"
        "    two\n"
        "FROM one\n"
        "ENV Z=${Y:-none}\n"
        'HEALTHCHECK --interval=5s CMD ["true"]\n'
        'CMD ["a", "b"]\n',
        build_args={"IMG": "other:2"},
    )
    first, second = df.stages
    assert (first.base, first.name, second.base) == ("other:2", "one", "one")
    assert df.arg_defaults(first) == {"V": "a b"}
    assert df.env(first) == {"X": "1", "Y": "12"}
    assert df.env(second) == {"X": "1", "Y": "12", "Z": "12"}
    run, health = first.last("RUN"), second.last("HEALTHCHECK")
    assert run is not None and run.text == "echo one two"
    assert health is not None and health.flags == {"interval": "5s"}
    assert run_argv(second) == ["a", "b"]


def test_dockerignore_matches_like_docker() -> None:
    ignore = DockerIgnore.parse("*/temp*\n**/*.go\ntemp?\n*.md\n!README.md\n/build/\n")
    assert ignore.excluded("somedir/temporary.txt")
    assert not ignore.excluded("somedir/sub/temporary.txt")
    assert ignore.excluded("a/b/c.go") and ignore.excluded("c.go")
    assert ignore.excluded("tempa") and not ignore.excluded("tempab")
    assert ignore.excluded("CHANGES.md") and not ignore.excluded("README.md")
    assert ignore.excluded("build/lib/x.py")  # a file under an excluded directory
    allow = DockerIgnore.parse("*\n!src\n**/__pycache__\n")
    assert not allow.excluded("src/a.py") and allow.excluded("src/__pycache__/a.pyc")
    assert allow.excluded("tests/test_a.py")


# ---------------------------------------------------------------------------- live commands


def test_engine_healthcheck_command_against_a_live_engine(engine: Engine) -> None:
    """The image's exact HEALTHCHECK command (pointed at the test's port) passes against a real
    engine and fails where nothing listens."""
    health = parse(_engine_text()).final.last("HEALTHCHECK")
    assert health is not None
    argv = healthcheck_argv(health)
    assert argv is not None and argv[0] == "python"
    argv = [sys.executable, *argv[1:]]
    up = subprocess.run([*argv, "--address", engine.address], capture_output=True, timeout=30)
    assert up.returncode == 0, up.stderr
    dead = [*argv, "--address", f"127.0.0.1:{free_port()}"]
    assert subprocess.run(dead, capture_output=True, timeout=30).returncode == 1


def test_frontend_healthcheck_command_against_a_live_gateway(lonely_gateway: Gateway) -> None:
    """The gateway image's HEALTHCHECK (liveness: GET /live on TANDEM_PORT) passes while the
    gateway runs, even with no engine behind it, and fails once it stops."""
    import os
    import time

    health = parse(_frontend_text()).final.last("HEALTHCHECK")
    assert health is not None
    argv = healthcheck_argv(health)
    assert argv is not None and argv[0] == "python"
    argv = [sys.executable, *argv[1:]]
    env = {**os.environ, "TANDEM_PORT": str(lonely_gateway.port)}
    deadline = time.monotonic() + 60
    done = subprocess.run(argv, env=env, capture_output=True, timeout=30)
    while done.returncode != 0 and time.monotonic() < deadline and lonely_gateway.alive():
        time.sleep(0.2)
        done = subprocess.run(argv, env=env, capture_output=True, timeout=30)
    assert done.returncode == 0, done.stderr
    lonely_gateway.stop()
    assert subprocess.run(argv, env=env, capture_output=True, timeout=30).returncode != 0
