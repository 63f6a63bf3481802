#!/usr/bin/env bash
# Create .venv and install Tandem with its engine and development extras.
# torch is pinned to the CPU build this project's machines carry; set TANDEM_TORCH to override
# (e.g. TANDEM_TORCH="torch==2.13.0" on a GPU machine with a CUDA build available).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -m pip install -q "${TANDEM_TORCH:-torch==2.13.0}" 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -m pip install -q -e ".[dev]" 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import torch, transformers, engine_svc; print('tandem ready: torch', torch.__version__)"
