#!/usr/bin/env bash
# Set up (idempotent) and run Tandem locally on the embedded default model.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
exec .venv/bin/python -m engine_svc.entrypoints.offline_demo "$@"
