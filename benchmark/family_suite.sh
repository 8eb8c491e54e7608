#!/usr/bin/env bash
# Issue 37's runs on one GPU: each family's shape (random bf16 weights, family_model.py) through this engine and
# vLLM 0.25.1 in the same lease, on the README's 2000 requests and batch 1 (512 in / 256 out). Each step logs to
# $LOG_DIR (default ./family-logs) and appends a timed line to $LOG_DIR/progress; every run has a time limit.
#
#   bash benchmark/family_suite.sh vsite gemma2-9b internlm2.5-7b
#
# Steps:
#   vsite    unpack vLLM's site from $VPARTS (default /tmp/vparts: ../shared/peers/build_vllm_site.sh's parts,
#            carried over one part a call) into /tmp/vsite, once
#   FAMILY   a family of tests/test_cuda_families.py (gemma2-9b, internlm2.5-7b, phi-3-mini-4k, glm-4-9b, ...):
#            its checkpoint in /tmp/FAMILY (and the family's own layout in /tmp/FAMILY-engine where it differs,
#            which both engines then load: vLLM reads InternLM2's config through the module family_model.py
#            writes), this engine (batch 1, then the 2000 requests, one load), then vLLM, then the checkpoint is
#            deleted (the disk holds one 9B model at a time)
set -uo pipefail
cd "$(dirname "$0")/.." || exit
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
LOG_DIR=$(mkdir -p "${LOG_DIR:-family-logs}" && cd "${LOG_DIR:-family-logs}" && pwd)
WORKLOAD=(--num-requests 2000 --input-len 150 --output-len 140 --input-sigma 0.9 --output-sigma 0.9
  --max-input-len 2000 --max-output-len 1000)

note() { echo "$(date +%T) $*" | tee -a "$LOG_DIR/progress"; }

for step in "$@"; do
  note "=== $step"
  case $step in
    vsite) [ -f /tmp/vsite/.ok ] || { mkdir -p /tmp/vsite && cat "${VPARTS:-/tmp/vparts}"/vllm-site.tgz.part* |
             tar -xz -C /tmp/vsite && touch /tmp/vsite/.ok; } ;;
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
        (cd benchmark && PYTHONPATH=/tmp/vsite VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 \
          HF_HUB_OFFLINE=1 timeout 600 python3 vllm_offline.py --model "$model" "${remote[@]}") \
          >"$LOG_DIR/$step-vllm.log" 2>&1
        note "$step vllm rc=$? $(grep -h '^\[vllm' "$LOG_DIR/$step-vllm.log" | tr '\n' ' ')"
      fi
      [ -n "${KEEP:-}" ] || rm -rf "$dir" "$dir-engine" ;;
  esac
done
note "=== done"
