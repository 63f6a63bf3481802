#!/usr/bin/env bash
# Downloads, into .whl/ (git-ignored through .git/info/exclude), the wheels the device tool's GPU
# machine lacks (Python 3.12 there, nothing fetchable): the gateway's web stack, pydantic,
# xgrammar, grpc/protobuf at the versions the committed stubs were generated with, and the test
# clients. scripts/gpu_session.sh installs them there. Run it here, once per checkout.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
mkdir -p .git/info .whl
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >>.git/info/exclude
version() { "$PY" -m pip show "$1" 2>/dev/null | awk '/^Version/{print $2}' || true; }
pkgs=()
for p in starlette uvicorn orjson httptools pydantic pydantic_core annotated-types \
  typing-inspection xgrammar protobuf grpcio grpcio-health-checking grpcio-reflection openai \
  distro jiter jsonschema jsonschema-specifications referencing rpds-py sniffio; do
  v="$(version "$p")"
  pkgs+=("$p${v:+==$v}")
done
platforms=()
for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
  manylinux1_x86_64; do
  platforms+=(--platform "$tag")
done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d .whl "${pkgs[@]}"
du -sh .whl
