#!/usr/bin/env bash
# A/B of issue 30's constraint, base cf57020 (/tmp/base_cf5) vs head (/work/main), alternating.
set -u
PY=/work/main/.venv/bin/python
RELAY=(--concurrency 1 64 256 --duration 5 --warmup 2 --settle 0.5 --paced-repeats 1 --workers 1)
TPUT=(--shape llama-h512 --num-requests 64 --input-len 16 256 --output-len 16 128 --systems tandem)
for round in 1 2; do
  for side in base head; do
    if [[ $side == base ]]; then dir=/tmp/base_cf5; else dir=/work/main; fi
    echo "=== relay $side round $round $(date -u +%T)"
    (cd $dir && PYTHONPATH=$dir timeout 300 $PY benchmarks/gateway_relay.py "${RELAY[@]}" \
      --note "$side round $round" --out /tmp/ab/relay_${side}_${round}.json 2>&1 | tail -25)
  done
done
for side in base head; do
  if [[ $side == base ]]; then dir=/tmp/base_cf5; else dir=/work/main; fi
  echo "=== throughput $side $(date -u +%T)"
  (cd $dir && PYTHONPATH=$dir timeout 600 $PY benchmarks/throughput.py "${TPUT[@]}" \
    --out /tmp/ab/tput_${side}.json 2>&1 | tail -8)
done
echo "=== done $(date -u +%T)"
