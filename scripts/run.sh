#!/usr/bin/env bash
# Set up (idempotent) and run Tandem locally: the gRPC engine on the embedded default model (or
# --model PATH) and the OpenAI gateway on http://127.0.0.1:8000. Ctrl-C stops both.
#   ./scripts/run.sh                      # embedded tiny model (gibberish text, no GPU needed)
#   ./scripts/run.sh --model /models/Qwen3-0.6B
# Environment: TANDEM_ENGINE_PORT (50051), TANDEM_PORT (8000), TANDEM_API_KEY (unset: no auth).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
ENGINE_PORT=${TANDEM_ENGINE_PORT:-50051}
HTTP_PORT=${TANDEM_PORT:-8000}

.venv/bin/python -m engine_svc --port "$ENGINE_PORT" "$@" &
ENGINE_PID=$!
trap 'kill $ENGINE_PID 2>/dev/null; wait $ENGINE_PID 2>/dev/null' EXIT INT TERM

# The gateway waits for the engine by itself (and reconnects if it restarts).
echo "gateway: http://127.0.0.1:$HTTP_PORT/v1  (try: curl http://127.0.0.1:$HTTP_PORT/v1/models)"
.venv/bin/python -m frontend_svc --engine "127.0.0.1:$ENGINE_PORT" --port "$HTTP_PORT"
