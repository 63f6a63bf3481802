#!/usr/bin/env bash
# Create .venv and install Tandem with its engine and development extras.
# torch is pinned to the CPU build this project's machines carry; set TANDEM_TORCH to override
# (e.g. TANDEM_TORCH="torch==2.13.0" on a GPU machine with a CUDA build available).
# The installs are skipped when they last succeeded for the same pyproject.toml and torch pin
# (copied into .venv/tandem-setup.stamp) and the venv still finds torch, transformers and
# engine_svc; delete the stamp to force them.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH=${TANDEM_TORCH:-torch==2.13.0}
STAMP=.venv/tandem-setup.stamp

# What the installs depend on, byte for byte.
setup_inputs() {
  printf 'torch: %s\n' "$TORCH"
  cat pyproject.toml
}

# The venv's python runs and finds the packages, engine_svc through the editable install rather
# than the current directory (-I), without the 3 s import of torch (find_spec).
venv_finds_tandem() {
  .venv/bin/python -I -c 'import importlib.util as u, sys
sys.exit(not all(u.find_spec(m) for m in ("torch", "transformers", "engine_svc")))' 2>/dev/null
}

if cmp -s <(setup_inputs) "$STAMP" && venv_finds_tandem; then
  echo "tandem ready (installed already for this pyproject.toml and $TORCH)"
  exit 0
fi

if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
rm -f "$STAMP"
# A failed install is reported by pip and leaves no stamp, so the next run tries again; whether
# this run can go on is for the import below to say.
installed=1
pip_install() {
  .venv/bin/python -m pip install -q "$@" 2>&1 | { grep -v "^WARNING: Location" || true; } ||
    installed=0
}
pip_install --upgrade pip
pip_install "$TORCH"
# setuptools' note on every editable install (a package folder in the working directory is
# imported first) says what this layout intends.
PYTHONWARNINGS="ignore:Editable installation" pip_install -e ".[dev]"
.venv/bin/python -c "import torch, transformers, engine_svc; print('tandem ready: torch', torch.__version__)"
if [ "$installed" = 1 ]; then
  setup_inputs >"$STAMP"
else
  echo "setup.sh: an install failed (see above); the next run tries it again" >&2
fi
