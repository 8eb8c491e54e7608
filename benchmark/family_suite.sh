#!/usr/bin/env bash
# Issue 37's runs on one GPU: each family's shape (random bf16 weights, family_model.py) through this engine and
# vLLM 0.25.1 in the same lease, on the README's 2000 requests and batch 1 (512 in / 256 out). Each step logs to
# $LOG_DIR (default ./family-logs) and appends a timed line to $LOG_DIR/progress; every run has a time limit.
#
#   bash benchmark/family_suite.sh vsite gemma2-9b internlm2.5-7b
#
# Steps:
#   vsite    unpack vLLM's site from $VPARTS (default /tmp/vparts: ../shared/peers/build_vllm_site.sh's parts,
#            carried over one part a call) into /tmp/vsite, once (suite_common.sh's vllm_site)
#   FAMILY   a family of tests/test_cuda_families.py (gemma2-9b, internlm2.5-7b, phi-3-mini-4k, glm-4-9b, ...):
#            its checkpoint in /tmp/FAMILY (and the family's own layout in /tmp/FAMILY-engine where it differs,
#            which both engines then load: vLLM reads InternLM2's config through the module family_model.py
#            writes), this engine (batch 1, then the 2000 requests, one load), then vLLM, then the checkpoint is
#            deleted (the disk holds one 9B model at a time)
set -uo pipefail
SUITE_LOGS=family-logs
# shellcheck source=benchmark/suite_common.sh
source "$(dirname "$0")/suite_common.sh"

for step in "$@"; do
  note "=== $step"
  case $step in
    vsite) vllm_site; note "vsite ok=$([ -f /tmp/vsite/.ok ] && echo 1 || echo 0)" ;;
    *)
      dir=/tmp/$step
      [ -f "$dir/config.json" ] || timeout 600 python3 benchmark/family_model.py --family "$step" --out "$dir" \
        --engine-layout "$dir-engine" >"$LOG_DIR/$step-gen.log" 2>&1 || { note "$step gen failed"; continue; }
      model=$dir; remote=()
      if [ -d "$dir-engine" ] && [ "$(readlink -f "$dir-engine")" != "$(readlink -f "$dir")" ]; then
        model=$dir-engine; remote=(--trust-remote-code)
      fi
      timeout 600 python3 benchmark/throughput.py --device cuda --max-batch-size 256 --model "$model" \
        --latency-first "${WORKLOAD[@]}" >"$LOG_DIR/$step-ours.log" 2>&1
      note "$step ours rc=$? $(grep -hE '^\[(lmdeploy|latency)' "$LOG_DIR/$step-ours.log" | tr '\n' ' ')"
      if [ -f /tmp/vsite/.ok ]; then
        vllm_run "$LOG_DIR/$step-vllm.log" --model "$model" "${remote[@]}"
        note "$step vllm rc=$? $(grep -h '^\[vllm' "$LOG_DIR/$step-vllm.log" | tr '\n' ' ')"
      fi
      [ -n "${KEEP:-}" ] || rm -rf "$dir" "$dir-engine" ;;
  esac
done
note "=== done"
