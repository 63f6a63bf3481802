#!/usr/bin/env bash
# Regenerates the Python stubs of protos/tandem/engine/v1/engine.proto with grpcio-tools.
#
#   scripts/gen_protos.sh            # writes next to the .proto (the committed stubs)
#   scripts/gen_protos.sh OUT_DIR    # writes OUT_DIR/tandem/engine/v1/... (used by the stale test)
#
# The proto is compiled with `-I protos`, so its registered file name is
# "tandem/engine/v1/engine.proto" (what buf and server reflection see). grpcio-tools then writes
# `from tandem.engine.v1 import engine_pb2` into the gRPC stub; the sed below rewrites that to the
# package path this repository imports it by, `protos.tandem.engine.v1`.
# Never edit the generated files by hand.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-$ROOT/protos}"
PYTHON="${PYTHON:-}"
if [[ -z "$PYTHON" ]]; then
  if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi

PROTO=tandem/engine/v1/engine.proto
mkdir -p "$OUT"
cd "$ROOT"
"$PYTHON" -m grpc_tools.protoc \
  -I protos \
  --python_out="$OUT" \
  --pyi_out="$OUT" \
  --grpc_python_out="$OUT" \
  "protos/$PROTO"

GRPC_STUB="$OUT/tandem/engine/v1/engine_pb2_grpc.py"
sed -i 's/^from tandem\.engine\.v1 import /from protos.tandem.engine.v1 import /' "$GRPC_STUB"
if grep -q '^from tandem\.' "$GRPC_STUB"; then
  echo "gen_protos: unexpected import left in $GRPC_STUB" >&2
  exit 1
fi
