#!/usr/bin/env bash
# One call of the device tool's GPU machine, all phases in one command (a loan is rare and short):
#
#   run(command="bash scripts/gpu_session.sh tests kernels", carry=[".whl"])
#   run(command="bash scripts/gpu_session.sh relay", carry=[".whl"])   (its own call: ~6 min)
#
# Phases (any order, each bounded by its own timeout; logs and JSON land in $OUT, at most 8
# files come back):
#   env        nvidia-smi, torch/cupy versions (always run first)
#   tests      pytest tests/gpu (kernels against their torch references, the engine's greedy
#              parity on CUDA) -> $OUT/gpu_tests.log
#   kernels    benchmarks/kernels_decode.py -> $OUT/kernels_decode.json
#   throughput benchmarks/throughput.py --device cuda on the llama-h512 shape -> $OUT/throughput_cuda.json
#   relay      benchmarks/gateway_relay.py (16 cores: the gateway-relay issue's targets) ->
#              $OUT/gateway_relay_h200.json; ~6 minutes (three paced pairs since 2026-11-23):
#              give it a call of its own, run(command="bash scripts/gpu_session.sh relay")
# Needs the wheels of scripts/gpu_wheels.sh in .whl (carried). Python there is 3.12 with torch,
# cupy, transformers, numpy, uvloop preinstalled.
set -uo pipefail
OUT="${OUT:-/tmp/gpu_out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [[ -d .whl ]]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/site:$PWD"
else
  export PYTHONPATH="$PWD"
fi
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  nproc
  python3 -c 'import torch, sys; print(sys.version); print("torch", torch.__version__, torch.version.cuda, torch.cuda.get_device_name())'
  python3 -c 'import cupy; print("cupy", cupy.__version__)'
  git log --oneline -1 2>/dev/null || true
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
for phase in "$@"; do
  echo "=== $phase $(date -u +%T)"
  case "$phase" in
    env) ;;
    tests)
      timeout 420 python3 -m pytest -q -x -p no:cacheprovider tests/gpu 2>&1 |
        tee "$OUT/gpu_tests.log" | tail -30
      ;;
    kernels)
      timeout 240 python3 benchmarks/kernels_decode.py --out "$OUT/kernels_decode.json" 2>&1 |
        tail -40
      ;;
    throughput)
      timeout 400 python3 benchmarks/throughput.py --device cuda --dtype bfloat16 \
        --shape llama-h512 --num-requests 256 --input-len 16 256 --output-len 16 128 \
        --systems tandem hf-cb --out "$OUT/throughput_cuda.json" 2>&1 | tail -40
      ;;
    relay)
      timeout 540 python3 benchmarks/gateway_relay.py --out "$OUT/gateway_relay_h200.json" \
        --note "H200 machine, 16 cores" 2>&1 | tail -40
      ;;
    *) echo "unknown phase $phase" ;;
  esac
done
