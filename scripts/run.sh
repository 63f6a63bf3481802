#!/usr/bin/env bash
# Set up (idempotent) and run Tandem locally: the gRPC engine on the embedded default model (or
# --model PATH) and the OpenAI gateway on http://127.0.0.1:8000. Ctrl-C stops both.
#   ./scripts/run.sh                      # embedded tiny model (gibberish text, no GPU needed)
#   ./scripts/run.sh --model /models/Qwen3-0.6B
#   ./scripts/run.sh --model /models/Qwen3-0.6B -- --port 9000 --api-key change-me
# Arguments before a lone `--` go to the engine (python -m engine_svc --help), those after it to
# the gateway (python -m frontend_svc --help). Whichever of the two stops first stops the other,
# and run.sh exits with its status (so a failure, such as a port in use, is a non-zero exit).
# Environment: TANDEM_ENGINE_PORT (50051), TANDEM_PORT (8000), TANDEM_API_KEY (unset: no auth),
# and any other gateway flag as TANDEM_<FLAG> (e.g. TANDEM_WORKERS=2);
# TANDEM_SKIP_SETUP=1 skips setup.sh (the venv is ready); TANDEM_RUN_DRY_RUN=1 prints the two
# commands and exits.
set -euo pipefail
cd "$(dirname "$0")/.."

engine_args=()
gateway_args=()
to_gateway=0
for arg in "$@"; do
  if [ "$to_gateway" = 0 ] && [ "$arg" = "--" ]; then
    to_gateway=1
  elif [ "$to_gateway" = 1 ]; then
    gateway_args+=("$arg")
  else
    engine_args+=("$arg")
  fi
done

# The value of the last `NAME V` or `NAME=V` among the arguments after the first two, else $2.
flag_value() {
  local name=$1 value=$2
  shift 2
  while [ $# -gt 0 ]; do
    case $1 in
      "$name") if [ $# -gt 1 ]; then value=$2; shift; fi ;;
      "$name"=*) value=${1#*=} ;;
    esac
    shift
  done
  printf '%s\n' "$value"
}

# (The ${a[@]+...} form: an empty array under `set -u` in bash before 4.4.)
ENGINE_PORT=$(flag_value --port "${TANDEM_ENGINE_PORT:-50051}" ${engine_args[@]+"${engine_args[@]}"})
HTTP_PORT=$(flag_value --port "${TANDEM_PORT:-8000}" ${gateway_args[@]+"${gateway_args[@]}"})
HTTP_HOST=$(flag_value --host "${TANDEM_HOST:-127.0.0.1}" ${gateway_args[@]+"${gateway_args[@]}"})
CERT=$(flag_value --ssl-certfile "${TANDEM_SSL_CERTFILE:-}" ${gateway_args[@]+"${gateway_args[@]}"})
case $HTTP_HOST in 0.0.0.0 | :: | "") HTTP_HOST=127.0.0.1 ;; esac
SCHEME=http
if [ -n "$CERT" ]; then SCHEME=https; fi

ENGINE_CMD=(.venv/bin/python -m engine_svc --port "$ENGINE_PORT" ${engine_args[@]+"${engine_args[@]}"})
GATEWAY_CMD=(.venv/bin/python -m frontend_svc --engine "127.0.0.1:$ENGINE_PORT" --port "$HTTP_PORT"
  ${gateway_args[@]+"${gateway_args[@]}"})
if [ -n "${TANDEM_RUN_DRY_RUN:-}" ]; then
  printf 'engine:'; printf ' %q' "${ENGINE_CMD[@]}"; echo
  printf 'gateway:'; printf ' %q' "${GATEWAY_CMD[@]}"; echo
  exit 0
fi

if [ -z "${TANDEM_SKIP_SETUP:-}" ]; then
  ./scripts/setup.sh
fi

ENGINE_PID=
GATEWAY_PID=
stop_both() {
  trap - EXIT INT TERM
  for pid in $GATEWAY_PID $ENGINE_PID; do
    kill "$pid" 2>/dev/null || true
  done
  for pid in $GATEWAY_PID $ENGINE_PID; do
    wait "$pid" 2>/dev/null || true
  done
}
trap stop_both EXIT
trap 'stop_both; exit 130' INT
trap 'stop_both; exit 143' TERM

"${ENGINE_CMD[@]}" &
ENGINE_PID=$!
# The gateway waits for the engine by itself (and reconnects if it restarts).
"${GATEWAY_CMD[@]}" &
GATEWAY_PID=$!
echo "gateway: $SCHEME://$HTTP_HOST:$HTTP_PORT/v1  (try: curl $SCHEME://$HTTP_HOST:$HTTP_PORT/v1/models)"

# Until one of them stops (bash reaps a child as it exits, so kill -0 fails from then on).
while kill -0 "$ENGINE_PID" 2>/dev/null && kill -0 "$GATEWAY_PID" 2>/dev/null; do
  sleep 0.2
done
if kill -0 "$ENGINE_PID" 2>/dev/null; then
  status=0
  wait "$GATEWAY_PID" || status=$?
  echo "run.sh: the gateway exited with status $status; stopping the engine" >&2
else
  status=0
  wait "$ENGINE_PID" || status=$?
  echo "run.sh: the engine exited with status $status; stopping the gateway" >&2
fi
stop_both
exit "$status"
