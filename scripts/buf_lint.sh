#!/usr/bin/env bash
# Lints the .proto contract with buf (STANDARD rules, see protos/buf.yaml).
# buf comes from the @bufbuild/buf npm package, installed on first use into .cache/buf
# (gitignored). Exits 3 when npm is needed but missing.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PREFIX="$ROOT/.cache/buf"
BUF="$PREFIX/node_modules/.bin/buf"

if [[ ! -x "$BUF" ]]; then
  if ! command -v npm >/dev/null 2>&1; then
    echo "buf_lint: npm not found; cannot install @bufbuild/buf" >&2
    exit 3
  fi
  npm install --silent --no-audit --no-fund --prefix "$PREFIX" @bufbuild/buf >&2
fi

cd "$ROOT/protos"
"$BUF" lint "$@"
echo "buf lint: ok ($("$BUF" --version))"
