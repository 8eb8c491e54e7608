#!/usr/bin/env bash
# Issue 38's runs on one GPU, in one lease: the W4A16 kernels' sweeps, the cross-engine check, and the
# Llama-3-8B shape in bf16, AWQ (random codes, random_model.py --awq) and SmoothQuant int8 / fp8 through this
# engine and vLLM 0.25.1 on the README's 2000 requests, batch 1 (512 in / 256 out) and a prefill-heavy load
# (300 prompts of 3,000 tokens, 64 out). Each step logs to $LOG_DIR (default ./quant-logs) and appends a timed
# line to $LOG_DIR/progress; every run has a time limit.
#
#   bash benchmark/quant_suite.sh vsite sweep agree bf16 awq awq-vllm sq
#
# Steps of several instances may run at once, one GPU each (CUDA_VISIBLE_DEVICES, each its own LOG_DIR): the
# bf16 model and vLLM's site are made by the first step that needs them while the others wait.
#
# Steps:
#   vsite   unpack vLLM's site from $VPARTS (default /tmp/vparts) into /tmp/vsite, once (as family_suite.sh),
#           waiting up to 15 minutes for the last part (copied in while the suite runs)
#   sweep   w4a16_gemm.py --gemm-sweep (the fused kernel's tiles and dequantizations, 256 rows first) and
#           --gemv-sweep --table-only (1-2 rows), Llama-3-8B's layers
#   agree   quant_agree.sh: lite's AWQ / GPTQ / GPTQ act-order, greedy tokens against vLLM's
#   bf16    the bf16 8B shape in /tmp/l8b (kept for lite and sq): batch 1, 2000 requests, prefill-heavy
#   awq     /tmp/l8b-awq (random_model.py --awq 128): batch 1 and 2000 requests
#   awq-vllm  the same through vLLM's AWQ-Marlin
#   lite    lmdeploy lite auto_awq on /tmp/l8b at the issue's 128 x 2048 calibration, timed (15 minutes asked)
#   sq      lite smooth_quant int8 and fp8 of /tmp/l8b (8 x 512 calibration): 2000 requests, prefill-heavy
#           (sq-int8, sq-fp8: one of them)
set -uo pipefail
SUITE_LOGS=quant-logs
# shellcheck source=benchmark/suite_common.sh
source "$(dirname "$0")/suite_common.sh"
PREFILL=(--num-requests 300 --input-len 3000 --output-len 64 --input-sigma 0 --output-sigma 0
  --max-input-len 3000 --max-output-len 64)

lines() { grep -hE '^\[(lmdeploy|latency|vllm)' "$1" | tr '\n' ' '; }
ours() {  # name model args...: this engine's run, logged
  local name=$1 model=$2; shift 2
  timeout 600 python3 benchmark/throughput.py --device cuda --max-batch-size 256 --model "$model" "$@" \
    >"$LOG_DIR/$name.log" 2>&1
  note "$name rc=$? $(lines "$LOG_DIR/$name.log")"
}
vllm() {  # name model: vLLM's batch 1 and 2000 requests
  [ -f /tmp/vsite/.ok ] || { note "$1: no vLLM site (run the vsite step)"; return; }
  vllm_run "$LOG_DIR/$1.log" --model "$2"
  note "$1 rc=$? $(lines "$LOG_DIR/$1.log")"
}
bf16_model() {  # the first caller writes /tmp/l8b; the others wait for it
  if mkdir /tmp/l8b.lock 2>/dev/null; then
    [ -f /tmp/l8b/config.json ] || { timeout 300 python3 benchmark/random_model.py --shape llama3-8b \
      --out /tmp/l8b.part >"$LOG_DIR/gen-bf16.log" 2>&1 && mv /tmp/l8b.part /tmp/l8b; }
    touch /tmp/l8b.lock/done
  fi
  until [ -f /tmp/l8b.lock/done ]; do sleep 5; done
  [ -f /tmp/l8b/config.json ]
}

for step in "$@"; do
  note "=== $step"
  case $step in
    vsite) vllm_site; note "vsite ok=$([ -f /tmp/vsite/.ok ] && echo 1 || echo 0)" ;;
    sweep)
      timeout 900 python3 benchmark/w4a16_gemm.py --gemm-sweep --m 256 128 512 64 16 >"$LOG_DIR/gemm-sweep.log" 2>&1
      note "gemm sweep rc=$?"
      timeout 300 python3 benchmark/w4a16_gemm.py --gemv-sweep --table-only --m 1 2 >"$LOG_DIR/gemv.log" 2>&1
      note "gemv table rc=$?" ;;
    agree)
      timeout 1200 bash benchmark/quant_agree.sh /tmp/vsite /tmp/qa >"$LOG_DIR/agree.log" 2>&1
      note "agree rc=$? $(grep -h 'prompts with equal tokens' "$LOG_DIR/agree.log" | tr '\n' ' ')" ;;
    bf16)
      bf16_model || { note "bf16 gen failed"; continue; }
      ours bf16 /tmp/l8b --latency-first "${WORKLOAD[@]}"
      ours bf16-prefill /tmp/l8b "${PREFILL[@]}" ;;
    awq)
      [ -f /tmp/l8b-awq/config.json ] || timeout 300 python3 benchmark/random_model.py --shape llama3-8b --awq 128 \
        --out /tmp/l8b-awq >"$LOG_DIR/gen-awq.log" 2>&1 || { note "awq gen failed"; continue; }
      ours awq /tmp/l8b-awq --latency-first "${WORKLOAD[@]}" ;;
    awq-vllm) vllm awq-vllm /tmp/l8b-awq ;;
    lite)
      bf16_model || { note "bf16 gen failed"; continue; }
      start=$(date +%s)
      timeout 1800 python3 -m lmdeploy lite auto_awq /tmp/l8b --work-dir /tmp/l8b-lite --calib-samples 128 \
        --calib-seqlen 2048 --no-resume >"$LOG_DIR/lite-awq.log" 2>&1
      note "lite auto_awq 128 x 2048 rc=$? in $(( $(date +%s) - start )) s" ;;
    sq|sq-int8|sq-fp8)
      bf16_model || { note "bf16 gen failed"; continue; }
      dts=(int8 fp8); [ "$step" = sq ] || dts=("${step#sq-}")
      for dt in "${dts[@]}"; do
        timeout 600 python3 -m lmdeploy lite smooth_quant /tmp/l8b --work-dir "/tmp/l8b-$dt" --quant-dtype "$dt" \
          --calib-samples 8 --calib-seqlen 512 >"$LOG_DIR/sq-$dt-gen.log" 2>&1 || { note "sq $dt failed"; continue; }
        ours "sq-$dt" "/tmp/l8b-$dt" "${WORKLOAD[@]}"
        ours "sq-$dt-prefill" "/tmp/l8b-$dt" "${PREFILL[@]}"
        rm -rf "/tmp/l8b-$dt"
      done ;;
    *) note "unknown step $step" ;;
  esac
done
note "=== done"
