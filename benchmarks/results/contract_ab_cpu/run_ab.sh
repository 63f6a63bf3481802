#!/usr/bin/env bash
# Relay A/B for issue 30 point 1: base 1490bc5 (/tmp/base_ob: the contract's types moved, the
# engine's own outbox and stand-in merge still in place) vs head (/work/main), alternating.
set -u
PY=/work/main/.venv/bin/python
RELAY=(--concurrency 1 64 256 --duration 5 --warmup 2 --settle 0.5 --paced-repeats 1 --workers 1)
for round in 1 2; do
  for side in base head; do
    if [[ $side == base ]]; then dir=/tmp/base_ob; else dir=/work/main; fi
    echo "=== relay $side round $round $(date -u +%T)"
    (cd $dir && PYTHONPATH=$dir timeout 300 $PY benchmarks/gateway_relay.py "${RELAY[@]}" \
      --note "$side round $round" --out /tmp/ab2/relay_${side}_${round}.json 2>&1 | tail -25)
  done
done
echo "=== done $(date -u +%T)"
