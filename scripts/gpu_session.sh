#!/usr/bin/env bash
# One call of the device tool's GPU machine, all phases in one command (a loan is rare and short):
#
#   run(command="bash scripts/gpu_session.sh tests throughput anatomy kernels", carry=[".whl"],
#       timeout_s=540)         (~7 min on an H200; the phases in order of what matters most)
#   run(command="bash scripts/gpu_session.sh peers", carry=[".whl"])   (~5 min: the same-run
#       ratio to transformers' static batching, which alone takes ~200 s)
#   run(command="bash scripts/gpu_session.sh relay", carry=[".whl"])   (its own call: ~6 min)
#
# Phases (any order, each bounded by its own timeout so one failure loses nothing else; logs and
# JSON land in $OUT):
#   env        nvidia-smi, torch/cupy versions (always run first)
#   tests      pytest tests/gpu: kernels against their torch references (fused ones with
#              NaN-poisoned outputs), CUDA graph replay == eager bit for bit, greedy tokens with
#              graphs on == off, one host sync per decode step, engine parity
#              -> $OUT/gpu_tests.log
#   kernels    benchmarks/kernels_decode.py (decode vs copy bandwidth, Qwen3-0.6B and Llama-3-8B
#              heads, batch 1/64/256, contexts 512-8192 and mixed) -> $OUT/kernels_decode.json;
#              benchmarks/kernels_prefill.py (FlashAttention-2 prefill vs the scalar kernel, flash
#              SDPA and the GEMM rate) -> $OUT/kernels_prefill.json
#   anatomy    benchmarks/step_anatomy.py --device cuda: decode step ms, host CUDA calls and
#              syncs per step, batch 1/32/128/256 x context 512/1024/2048, graphs on and off
#              -> $OUT/step_anatomy_cuda.json
#   throughput the 256-request Qwen3-0.6B workload (in/out uniform 100-1024), Tandem with graphs,
#              with a per-step timeline -> $OUT/throughput_cuda.json, $OUT/timeline_graphs.json
#   eager      the same workload with --enforce-eager -> $OUT/throughput_cuda_eager.json
#   peers      the same workload, Tandem and transformers' static batching (batch 256) in one run
#              -> $OUT/throughput_peers.json
#   sweep      benchmarks/kernels_decode.py --sweep: every split-K partition count x query heads
#              per thread block, the rule's choice beside the fastest -> $OUT/kernels_decode_sweep.json
#   ab         the engine A/B in one call: the tree in .ab_base (carried) against this one, the
#              throughput workload (2 rounds) and the step anatomy at batch 1/256 -> $OUT/ab_*.json
#   spec       benchmarks/spec_decode.py: n-gram and draft-model speculative decoding (k=4)
#              against none, batch 1/16/64 -> $OUT/spec_decode_cuda.json
#   relay      benchmarks/gateway_relay.py (16 cores: the gateway-relay issue's targets) ->
#              $OUT/gateway_relay_h200.json; ~6 minutes: give it a call of its own
# Needs the wheels of scripts/gpu_wheels.sh in .whl (carried). Python there is 3.12 with torch,
# cupy, transformers, numpy, uvloop preinstalled.
#
# DRY_RUN=1 runs every phase on the CPU with tiny settings (a check of this script and of the
# benchmarks' command lines before a loan is spent): OUT=/tmp/dry DRY_RUN=1 bash
# scripts/gpu_session.sh tests kernels anatomy throughput peers
set -uo pipefail
OUT="${OUT:-/tmp/gpu_out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
SITE=""
if [[ -d .whl ]]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  SITE="/tmp/site:"
fi
export PYTHONPATH="$SITE$PWD"
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  nproc
  python3 -c 'import torch, sys; print(sys.version); print("torch", torch.__version__, torch.version.cuda, torch.cuda.get_device_name())'
  python3 -c 'import cupy; print("cupy", cupy.__version__)'
  git log --oneline -1 2>/dev/null || true
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
# The throughput workload peers publish (Qwen3-0.6B shape, random bf16 weights).
WORKLOAD=(--shape qwen3-0.6b --num-requests 256 --input-len 100 1024 --output-len 100 1024
  --max-num-batched-tokens 8192 --device cuda --dtype bfloat16)
ANATOMY=(--device cuda --dtype bfloat16 --shape qwen3-0.6b --graphs both)
ANATOMY_AB=(--device cuda --dtype bfloat16 --shape qwen3-0.6b --graphs on --batches 1 256
  --contexts 512)
SWEEP=(--batch 1 64 256 --context 512 2048)
HF_BATCH=256
if [[ "${DRY_RUN:-0}" == 1 ]]; then
  WORKLOAD=(--shape llama-h512 --num-requests 8 --input-len 16 32 --output-len 8 16
    --device cpu --dtype float32)
  ANATOMY=(--device cpu --shape llama-h512 --batches 1 4 --contexts 64 --steps 2 --graphs off)
  ANATOMY_AB=("${ANATOMY[@]}")
  HF_BATCH=8
fi
# The tail of a phase's output without the exit-time noise of triton's bindings (nanobind leak
# lists, from transformers importing torch._dynamo).
quiet() { grep -v -e '^nanobind' -e '^ - ' -e 'refleaks.html' | tail -"$1"; }
for phase in "$@"; do
  echo "=== $phase $(date -u +%T)"
  case "$phase" in
    env) ;;
    tests)
      timeout 170 python3 -m pytest -q -p no:cacheprovider -rfEs --durations=12 tests/gpu 2>&1 |
        tee "$OUT/gpu_tests.log" | quiet 40
      ;;
    kernels)
      if [[ "${DRY_RUN:-0}" == 1 ]]; then
        python3 benchmarks/kernels_decode.py --help >/dev/null && echo "kernels_decode.py parses"
        python3 benchmarks/kernels_prefill.py --help >/dev/null && echo "kernels_prefill.py parses"
      else
        timeout 60 python3 benchmarks/kernels_prefill.py --dtype bfloat16 \
          --out "$OUT/kernels_prefill.json" 2>&1 | quiet 12
        timeout 80 python3 benchmarks/kernels_decode.py --dtype bfloat16 \
          --out "$OUT/kernels_decode.json" 2>&1 | quiet 40
      fi
      ;;
    sweep)
      if [[ "${DRY_RUN:-0}" == 1 ]]; then
        python3 benchmarks/kernels_decode.py --help | grep -q -- --sweep && echo "--sweep parses"
      else
        timeout 90 python3 benchmarks/kernels_decode.py --dtype bfloat16 --sweep "${SWEEP[@]}" \
          --out "$OUT/kernels_decode_sweep.json" 2>&1 | quiet 40
      fi
      ;;
    spec)
      # Speculative decoding (issue 34): n-gram and a quarter-layer draft model, k=4, against
      # none on the Qwen3-0.6B shape, batch 1/16/64, outputs checked equal; verification steps
      # replay the decode graphs (one row per token) -> $OUT/spec_decode_cuda.json
      if [[ "${DRY_RUN:-0}" == 1 ]]; then
        timeout 120 python3 benchmarks/spec_decode.py --batch 1 2 --max-tokens 16 --rounds 1 \
          --systems none ngram draft --out "$OUT/spec_decode_cuda.json" 2>&1 | quiet 10
      else
        timeout 240 python3 benchmarks/spec_decode.py --device cuda --dtype bfloat16 \
          --shape qwen3-0.6b --batch 1 16 64 --systems none ngram draft \
          --out "$OUT/spec_decode_cuda.json" 2>&1 | quiet 14
      fi
      ;;
    ab)
      # The engine, A/B in one call: .ab_base (carried; made with `git archive BASE | tar -x -C
      # .ab_base`) against this tree: the throughput workload, 2 rounds each, then the step
      # anatomy at batch 1 and 256 (graphs on) of each.
      if [[ ! -d .ab_base ]]; then
        echo "ab: no .ab_base"
        continue
      fi
      for side in head base; do
        dir="$PWD"
        [[ $side == base ]] && dir="$PWD/.ab_base"
        (cd "$dir" && PYTHONPATH="$SITE$dir" timeout 110 python3 benchmarks/throughput.py \
          "${WORKLOAD[@]}" --systems tandem --rounds 2 --out "$OUT/ab_throughput_$side.json" \
          2>&1 | quiet 8)
      done
      for side in head base; do
        dir="$PWD"
        [[ $side == base ]] && dir="$PWD/.ab_base"
        (cd "$dir" && PYTHONPATH="$SITE$dir" timeout 60 python3 benchmarks/step_anatomy.py \
          "${ANATOMY_AB[@]}" --out "$OUT/ab_anatomy_$side.json" 2>&1 | quiet 6)
      done
      ;;
    anatomy)
      timeout 110 python3 benchmarks/step_anatomy.py "${ANATOMY[@]}" \
        --out "$OUT/step_anatomy_cuda.json" 2>&1 | quiet 40
      ;;
    throughput)
      timeout 110 python3 benchmarks/throughput.py "${WORKLOAD[@]}" --systems tandem \
        --timeline "$OUT/timeline_graphs.json" --out "$OUT/throughput_cuda.json" 2>&1 | quiet 25
      ;;
    eager)
      timeout 80 python3 benchmarks/throughput.py "${WORKLOAD[@]}" --systems tandem \
        --enforce-eager --out "$OUT/throughput_cuda_eager.json" 2>&1 | quiet 25
      ;;
    peers)
      timeout 420 python3 benchmarks/throughput.py "${WORKLOAD[@]}" --systems tandem hf-static \
        --hf-batch-size "$HF_BATCH" --out "$OUT/throughput_peers.json" 2>&1 | quiet 30
      ;;
    relay)
      timeout 540 python3 benchmarks/gateway_relay.py --out "$OUT/gateway_relay_h200.json" \
        --note "H200 machine, 16 cores" 2>&1 | quiet 40
      ;;
    *) echo "unknown phase $phase" ;;
  esac
done
