#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite. Extra arguments go to pytest.
# Besides the venv, the deployment tests need docker-compose (Debian's, to validate the compose
# files; installed here when apt-get is usable), npm (buf lint, the Node.js client) and openssl.
# Where one is missing its tests skip, unless TANDEM_REQUIRE_TOOLS=1 (CI), where they fail.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
./scripts/install_compose.sh || echo "test.sh: no docker-compose; the compose tests will skip" >&2
exec .venv/bin/python -m pytest -q "$@"
