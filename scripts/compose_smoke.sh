#!/usr/bin/env bash
# Build both images, start docker-compose.cpu.yml, and talk to it through the gateway: /health,
# a chat completion and a streamed one (the `openai` SDK, from the host), /metrics; then check the
# engine built its C CPU kernels. Everything it made is removed at the end, failed or not.
#
#   sudo ./scripts/compose_smoke.sh          # needs root, or a usable docker and a base image
#
# Works on a machine with no image registry and no PyPI inside containers:
#   - the base image is Debian made here (debootstrap from the host's apt mirror, `docker import`),
#     the host's own release, so the image's python3 is the host's;
#   - the wheels come from the host: the venv's pip downloads them with the host's pip settings
#     (index, find-links, certificate authority: whatever `pip config list` and PIP_* say) into a
#     wheelhouse served on 127.0.0.1 while the images build (`--network host`); the builds get
#     its URL as PIP_INDEX_URL / TORCH_INDEX_URL, so no certificate or credential reaches them;
#   - the build arguments are the compose file's (`compose config`), except BASE_IMAGE /
#     PYTHON_IMAGE, TORCH_INDEX_URL, TORCH_SPEC (the venv's torch, the CPU build) and PIP_INDEX_URL.
# Missing tools (docker.io, debootstrap, a compose) are installed with apt-get when root; a daemon
# that is not running is started, and stopped again at the end. Builds use the classic builder
# (DOCKER_BUILDKIT=0: Docker 20.10's and 28's, with or without buildx); compose v2
# (`docker compose`) if present, else v1 (`docker-compose`), runs `up -d --no-build`.
#
# Removed at the end: the compose project (containers, network, volume), the images this run
# built (not ones that were there before), the base image if this run made it, the wheelhouse,
# the daemon if this run started it. TANDEM_SMOKE_KEEP_CACHE=1 keeps the base image, the built
# images and the wheelhouse (under ~/.cache/tandem-smoke) for a warm next run.
# Timings on this project's 2-core VM: README, "Run with docker compose".
#
# Environment: TANDEM_SMOKE_KEEP_CACHE (0), TANDEM_SMOKE_MIRROR (the host's Debian mirror),
# TANDEM_SMOKE_SUITE (the host's Debian release), TANDEM_SMOKE_TORCH (torch==<the venv's
# version>), TANDEM_SMOKE_PYTHON (.venv/bin/python: pip, PyYAML, openai, httpx),
# TANDEM_SMOKE_UP_TIMEOUT (420 s for the stack to become healthy).
# The last line of stdout is `compose_smoke: {json}`: the result and each phase's seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
PY=${TANDEM_SMOKE_PYTHON:-$REPO/.venv/bin/python}
KEEP=${TANDEM_SMOKE_KEEP_CACHE:-0}
UP_TIMEOUT=${TANDEM_SMOKE_UP_TIMEOUT:-420}
PROJECT="tandem-smoke-$$"
# Tags of this run's own (a kept cache's: stable ones), never the compose file's tandem-*:* tags.
TAG=$([ "$KEEP" = 1 ] && echo cache || echo "run-$$")
ENGINE_TAG=tandem-smoke-engine:$TAG
FRONTEND_TAG=tandem-smoke-frontend:$TAG
CACHE_DIR=${XDG_CACHE_HOME:-$HOME/.cache}/tandem-smoke
WORK=$(mktemp -d /tmp/tandem-smoke.XXXXXX)
export DOCKER_BUILDKIT=0 COMPOSE_DOCKER_CLI_BUILD=0

log() { echo "compose_smoke: $*" >&2; }
T0=$(date +%s)
STAGE=setup
STAGE_T0=$T0
PHASES=()
phase() { # end the current phase, start the next
  local now
  now=$(date +%s)
  PHASES+=("\"$STAGE\": $((now - STAGE_T0))")
  STAGE=$1
  STAGE_T0=$now
  log "== $1"
}
free_port() {
  "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}
port_free() { ! (: <"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# ---------------------------------------------------------------------------- teardown

DOCKERD_PID=""
WHEEL_PID=""
COMPOSE=()
COMPOSE_UP=0
BASE=""
: >"$WORK/images-before"
: >"$WORK/built-ids"

# Whether image id $1 (sha256:...) was built by this run: a build listed it, and it was not there
# before the run.
made_here() {
  local short=${1#sha256:}
  short=${short:0:12}
  grep -qx "$short" "$WORK/built-ids" && ! grep -q "^sha256:$short" "$WORK/images-before"
}

teardown() {
  local rc=$? failed=$STAGE id tag now base_id left=0
  set +e
  trap - EXIT INT TERM
  [ "$rc" = 0 ] || log "FAILED in phase '$failed' (exit $rc)"
  phase teardown
  if [ "$COMPOSE_UP" = 1 ]; then
    if [ "$rc" != 0 ]; then
      "${COMPOSE[@]}" ps >&2
      "${COMPOSE[@]}" logs --no-color --tail 60 >&2
    fi
    "${COMPOSE[@]}" down --volumes --remove-orphans --timeout 60 >&2
  fi
  [ -z "$WHEEL_PID" ] || { kill "$WHEEL_PID" && wait "$WHEEL_PID"; } 2>/dev/null
  if [ "$KEEP" != 1 ] && [ -s "$WORK/built-ids" ]; then
    # Children before parents, each alone (--no-prune: an untagged parent may be an older
    # run's cache, not ours); the base, every build's parent, last.
    for tag in "$ENGINE_TAG" "$FRONTEND_TAG"; do
      id=$(docker image inspect -f '{{.Id}}' "$tag" 2>/dev/null) || continue
      if made_here "$id"; then docker rmi --no-prune "$tag" >/dev/null; fi
    done
    base_id=$(docker image inspect -f '{{.Id}}' "$BASE" 2>/dev/null)
    tac "$WORK/built-ids" | awk '!seen[$0]++' | while read -r id; do
      if made_here "$id" && [[ $base_id != sha256:$id* ]] &&
        docker image inspect "$id" >/dev/null 2>&1; then
        docker rmi --no-prune "$id" >/dev/null
      fi
    done
    if [ -n "$base_id" ] && made_here "$base_id"; then docker rmi --no-prune "$BASE" >/dev/null; fi
    while read -r id; do
      if made_here "$id" && docker image inspect "$id" >/dev/null 2>&1; then
        log "left behind: image $id"
        left=$((left + 1))
      fi
    done < <(sort -u "$WORK/built-ids")
  fi
  if [ -n "$DOCKERD_PID" ]; then
    kill "$DOCKERD_PID"
    for _ in $(seq 60); do kill -0 "$DOCKERD_PID" 2>/dev/null || break; sleep 1; done
    log "stopped the dockerd this run started"
  fi
  rm -rf "$WORK"
  now=$(date +%s)
  PHASES+=("\"$STAGE\": $((now - STAGE_T0))")
  local IFS=,
  echo "compose_smoke: {\"ok\": $([ "$rc" = 0 ] && echo true || echo false)," \
    "\"failed_phase\": $([ "$rc" = 0 ] && echo null || echo "\"$failed\"")," \
    "\"project\": \"$PROJECT\", \"images_left\": $left, \"kept_cache\": $([ "$KEEP" = 1 ] &&
      echo true || echo false), \"total_s\": $((now - T0)), \"phases\": {${PHASES[*]}}}"
  exit "$rc"
}
trap teardown EXIT
trap 'exit 130' INT TERM

# One run at a time on this machine: two would share (and remove) each other's cached layers.
exec 9>"${TMPDIR:-/tmp}/tandem-compose-smoke.lock"
if ! flock -n 9; then
  log "another compose smoke run holds the lock; waiting for it (up to 20 minutes)"
  flock -w 1200 9 || { log "it did not finish"; exit 1; }
  STAGE_T0=$(date +%s)
fi

# ---------------------------------------------------------------------------- tools and daemon

apt_install() {
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    log "$1 is missing, and installing it needs root and apt-get"
    exit 1
  fi
  log "installing $* with apt-get"
  DEBIAN_FRONTEND=noninteractive apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

command -v docker >/dev/null 2>&1 || apt_install docker.io
if ! docker info >/dev/null 2>&1; then
  command -v dockerd >/dev/null 2>&1 || apt_install docker.io
  [ "$(id -u)" = 0 ] || { log "docker does not answer, and only root can start dockerd"; exit 1; }
  log "starting dockerd (its log: $WORK/dockerd.log)"
  dockerd >"$WORK/dockerd.log" 2>&1 9>&- &  # 9: the lock stays ours
  DOCKERD_PID=$!
  for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
  docker info >/dev/null 2>&1 || { tail -20 "$WORK/dockerd.log" >&2; exit 1; }
fi
if docker compose version >/dev/null 2>&1; then
  COMPOSE=(docker compose)
else
  command -v docker-compose >/dev/null 2>&1 || ./scripts/install_compose.sh >&2
  COMPOSE=(docker-compose)
fi
log "docker $(docker version -f '{{.Server.Version}}')," \
  "${COMPOSE[*]} $("${COMPOSE[@]}" version --short)"
# The compose file as it is, plus this run's image tags.
cat >"$WORK/override.yml" <<EOF
services:
  engine:
    image: $ENGINE_TAG
  frontend:
    image: $FRONTEND_TAG
EOF
COMPOSE+=(--project-name "$PROJECT" --project-directory "$REPO" -f docker-compose.cpu.yml
  -f "$WORK/override.yml")
docker images -aq --no-trunc | sort -u >"$WORK/images-before"

# ---------------------------------------------------------------------------- base image

phase base
# shellcheck disable=SC1091
SUITE=${TANDEM_SMOKE_SUITE:-$(. /etc/os-release 2>/dev/null && echo "${VERSION_CODENAME:-}")}
SUITE=${SUITE:-bookworm}
host_mirror() { # the first Debian mirror in the host's apt sources, else deb.debian.org
  local uri
  uri=$(grep -hsE '^(URIs:|deb )' /etc/apt/sources.list /etc/apt/sources.list.d/*.sources \
    /etc/apt/sources.list.d/*.list | grep -E '/debian/?( |$)' | head -1 |
    sed -E 's/^URIs: *//; s/^deb (\[[^]]*\] )?//; s/ .*//')
  echo "${uri:-http://deb.debian.org/debian}"
}
MIRROR=${TANDEM_SMOKE_MIRROR:-$(host_mirror)}
BASE="tandem-smoke-base:$SUITE"
if docker image inspect "$BASE" >/dev/null 2>&1; then
  log "base image $BASE is there already"
else
  command -v debootstrap >/dev/null 2>&1 || apt_install debootstrap
  log "debootstrap $SUITE from $MIRROR"
  root="$WORK/rootfs"
  debootstrap --variant=minbase --include=python3,python3-venv,python-is-python3 \
    "$SUITE" "$root" "$MIRROR" >"$WORK/debootstrap.log" 2>&1 ||
    { tail -20 "$WORK/debootstrap.log" >&2; exit 1; }
  # apt as in Debian's own images: no package cache or translations left in a layer.
  cat >"$root/etc/apt/apt.conf.d/docker-clean" <<'APT'
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
Dir::Cache::pkgcache "";
Dir::Cache::srcpkgcache "";
Acquire::Languages "none";
APT
  rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/cache/apt/*.bin \
    "$root"/var/lib/apt/lists/*
  id=$(tar -C "$root" -c . | docker import -c 'CMD ["/bin/bash"]' - "$BASE")
  rm -rf "$root"
  echo "${id#sha256:}" | cut -c1-12 >>"$WORK/built-ids"
fi
want=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
have=$(docker run --rm --network none "$BASE" python3 -c \
  'import sys; print("%d.%d" % sys.version_info[:2])')
if [ "$want" != "$have" ]; then
  log "$BASE has Python $have, $PY is $want: the host's wheels would not fit"
  exit 1
fi

# ---------------------------------------------------------------------------- wheelhouse

phase wheels
TORCH=${TANDEM_SMOKE_TORCH:-torch==$("$PY" -c 'import torch; print(torch.__version__)')}
key=$( (echo "$TORCH $SUITE" && cat pyproject.toml) | sha256sum | cut -c1-16)
if [ "$KEEP" = 1 ]; then WHEELS="$CACHE_DIR/wheels-$key"; else WHEELS="$WORK/wheels"; fi
if [ ! -f "$WHEELS/.complete" ]; then
  rm -rf "$WHEELS" && mkdir -p "$WHEELS"
  log "pip download $TORCH, the engine's dependencies and the build backend (host's settings)"
  read -ra build_requires < <("$PY" -c 'import tomllib
print(" ".join(tomllib.load(open("pyproject.toml", "rb"))["build-system"]["requires"]))')
  "$PY" -m pip download -q -d "$WHEELS" "$TORCH" ".[engine]" "${build_requires[@]}" 2>&1 |
    { grep -v "^WARNING: Location" || true; } >&2
  ls "$WHEELS"/torch-* >/dev/null
  touch "$WHEELS/.complete"
fi
# A PEP 503 index over the wheelhouse: simple/<name>/index.html linking to the files.
"$PY" - "$WHEELS" <<'PYTHON'
import re, sys
from pathlib import Path

root = Path(sys.argv[1])
projects: dict[str, list[str]] = {}
for f in sorted(root.iterdir()):
    if f.suffix == ".whl" or f.name.endswith(".tar.gz"):
        name = f.name.split("-")[0] if f.suffix == ".whl" else f.name.rsplit("-", 1)[0]
        projects.setdefault(re.sub(r"[-_.]+", "-", name).lower(), []).append(f.name)
for name, files in projects.items():
    (root / "simple" / name).mkdir(parents=True, exist_ok=True)
    links = "".join(f'<a href="../../{f}">{f}</a>\n' for f in files)
    (root / "simple" / name / "index.html").write_text(f"<html><body>\n{links}</body></html>\n")
PYTHON
# The same port each run where it is free: the URL is a build argument, so part of the layer
# cache's key.
WHEEL_PORT=38571
port_free "$WHEEL_PORT" || WHEEL_PORT=$(free_port)
"$PY" -m http.server --bind 127.0.0.1 --directory "$WHEELS" "$WHEEL_PORT" \
  >"$WORK/wheels.log" 2>&1 9>&- &
WHEEL_PID=$!
INDEX="http://127.0.0.1:$WHEEL_PORT/simple"
for _ in $(seq 50); do port_free "$WHEEL_PORT" || break; sleep 0.1; done

# ---------------------------------------------------------------------------- images

# The compose file's build arguments for a service (KEY=VALUE lines).
compose_build_args() {
  "${COMPOSE[@]}" config | "$PY" -c '
import sys, yaml
build = yaml.safe_load(sys.stdin)["services"][sys.argv[1]]["build"]
for k, v in (build.get("args") or {}).items():
    print(f"{k}={v}")' "$1"
}

build_image() { # SERVICE TAG DOCKERFILE KEY=VALUE... (in place of the compose file's values)
  local service=$1 tag=$2 dockerfile=$3 args=() line key
  local -A values=()
  shift 3
  while read -r line; do values[${line%%=*}]=${line#*=}; done < <(compose_build_args "$service")
  for line in "$@"; do values[${line%%=*}]=${line#*=}; done
  for key in $(printf '%s\n' "${!values[@]}" | sort); do
    args+=(--build-arg "$key=${values[$key]}")
  done
  log "docker build $service: ${args[*]}"
  # Its status is read from the log below, once the ids are recorded.
  { docker build --network host --force-rm -f "$dockerfile" -t "$tag" "${args[@]}" . 2>&1 ||
    true; } | tee "$WORK/build-$service.log" | { grep -E '^Step |^Successfully' || true; } >&2
  # Every image a step ended in; those that were there before (cache) are told apart later.
  sed -nE 's/^ ---> ([0-9a-f]{12})$/\1/p; s/^Successfully built ([0-9a-f]{12})$/\1/p' \
    "$WORK/build-$service.log" >>"$WORK/built-ids"
  if ! grep -q "^Successfully tagged $tag" "$WORK/build-$service.log"; then
    tail -40 "$WORK/build-$service.log" >&2
    exit 1
  fi
}

phase build_engine
build_image engine "$ENGINE_TAG" docker/engine.Dockerfile "BASE_IMAGE=$BASE" \
  "TORCH_INDEX_URL=$INDEX" "TORCH_SPEC=$TORCH" "PIP_INDEX_URL=$INDEX"
phase build_frontend
build_image frontend "$FRONTEND_TAG" docker/frontend.Dockerfile "PYTHON_IMAGE=$BASE" \
  "PIP_INDEX_URL=$INDEX"
kill "$WHEEL_PID"
wait "$WHEEL_PID" 2>/dev/null || true  # 143: the SIGTERM
WHEEL_PID=""

# ---------------------------------------------------------------------------- the stack

phase up
export TANDEM_PORT TANDEM_ENGINE_PORT TANDEM_API_KEY
TANDEM_PORT=$(free_port)
TANDEM_ENGINE_PORT=$(free_port)
TANDEM_API_KEY="smoke-$RANDOM$RANDOM"
COMPOSE_UP=1
# v1 waits here for the engine's health check (the gateway's depends_on); v2 may not.
timeout "$UP_TIMEOUT" "${COMPOSE[@]}" up -d --no-build >&2
health() { docker inspect -f '{{.State.Health.Status}}' "$("${COMPOSE[@]}" ps -q "$1")"; }
deadline=$(($(date +%s) + UP_TIMEOUT))
until [ "$(health engine)" = healthy ] && [ "$(health frontend)" = healthy ]; do
  for s in engine frontend; do
    [ "$(health "$s")" != unhealthy ] || { log "$s is unhealthy"; exit 1; }
  done
  [ "$(date +%s)" -lt "$deadline" ] || { log "not healthy within ${UP_TIMEOUT}s"; exit 1; }
  sleep 2
done
log "both services healthy; the gateway on 127.0.0.1:$TANDEM_PORT"

# ---------------------------------------------------------------------------- checks

phase checks
"$PY" - <<'PYTHON' >&2
import os

import httpx
import openai

base = f"http://127.0.0.1:{os.environ['TANDEM_PORT']}"
assert httpx.get(f"{base}/health", timeout=10).status_code == 200
assert httpx.get(f"{base}/v1/models", timeout=10).status_code == 401, "no API key asked for"
client = openai.OpenAI(
    base_url=f"{base}/v1", api_key=os.environ["TANDEM_API_KEY"], max_retries=0, timeout=120
)
model = client.models.list().data[0].id
messages = [{"role": "user", "content": "Say hello to the container."}]

chat = client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0)
choice = chat.choices[0]
assert choice.finish_reason in ("stop", "length"), choice
assert chat.usage.completion_tokens >= 1 and chat.usage.prompt_tokens >= 1, chat.usage

pieces, finish, usage = [], None, None
stream = client.chat.completions.create(
    model=model,
    messages=messages,
    max_tokens=12,
    temperature=0,
    stream=True,
    stream_options={"include_usage": True},
)
for chunk in stream:
    usage = chunk.usage or usage
    for c in chunk.choices:
        pieces.append(c.delta.content or "")
        finish = c.finish_reason or finish
assert finish == choice.finish_reason, (finish, choice.finish_reason)
assert usage is not None and usage.completion_tokens == chat.usage.completion_tokens, usage
assert "".join(pieces) == choice.message.content, "greedy: streamed text differs"

metrics = httpx.get(f"{base}/metrics", timeout=10)
assert metrics.status_code == 200, metrics.status_code
served = sum(
    float(line.rsplit(" ", 1)[1])
    for line in metrics.text.splitlines()
    if line.startswith("vllm:request_success_total")
)
assert served >= 2, f"vllm:request_success_total is {served}, want >= 2"
print(
    f"compose_smoke: {model}: {chat.usage.completion_tokens} tokens ({choice.finish_reason}), "
    f"the same streamed; /metrics counts {served:.0f} requests served"
)
PYTHON
# The engine built its C CPU kernels (with no compiler it falls back to torch's attention).
engine=$("${COMPOSE[@]}" ps -q engine)
if docker logs "$engine" 2>&1 | grep -i "kernel unavailable" >&2; then
  log "the engine fell back to torch's attention"
  exit 1
fi
kernels=$(docker exec "$engine" sh -c 'ls "$TANDEM_CACHE_DIR/kernels"')
if ! grep -q '^paged_decode_cpu-.*\.so$' <<<"$kernels"; then
  log "no CPU attention kernel in the engine's cache: $kernels"
  exit 1
fi
log "the engine's CPU kernels: $(echo "$kernels" | tr '\n' ' ')"
