#!/usr/bin/env bash
# Install a docker-compose that can validate the compose files without a Docker engine
# (Debian's docker-compose 1.29, a Python program: `docker-compose config` needs no daemon).
# Idempotent: does nothing when docker-compose is already on PATH. Uses sudo only when not root.
set -euo pipefail
if command -v docker-compose >/dev/null 2>&1; then
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "install_compose.sh: no apt-get here; install docker-compose by hand" >&2
  exit 1
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  SUDO="sudo"
fi
echo "install_compose.sh: docker-compose not found; installing Debian's with ${SUDO:+sudo }apt-get" \
  "(the compose tests run \`docker-compose config\` on docker-compose*.yml)" >&2
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends docker-compose >/dev/null
docker-compose version --short
