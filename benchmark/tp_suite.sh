#!/usr/bin/env bash
# Issue 36's runs on a machine of 2 or 4 GPUs, this engine and vLLM 0.25.1 in the same lease. Each step logs
# to $LOG_DIR (default ./tp-logs) and appends a timed line to $LOG_DIR/progress; every run has a time limit.
#
#   bash benchmark/tp_suite.sh vsite gen8 tests pair          # 2 GPUs: the 8B shape, tp=2 against vLLM tp=2
#   bash benchmark/tp_suite.sh vsite gen70 ours70 vllm70      # 4 GPUs: the 70B shape at tp=4
#
# Steps:
#   vsite   unpack vLLM's site from $VPARTS (default /tmp/vparts: ../shared/peers/build_vllm_site.sh's parts,
#           carried over one part a call) into /tmp/vsite, once (suite_common.sh's vllm_site)
#   gen8    the Llama-3-8B shape in /tmp/l8b;  gen70: the Llama-3-70B shape in /tmp/l70b (132 GB, ~3.5 min)
#   tests   tests/test_cuda_tp.py for every tp the GPUs allow (4 layers at full width; ~5 min for tp=4)
#   pair    the 8B shape at tp=2: this engine's 2000 requests (with batch 1 first, one load) and 200 x 128 / 1,500,
#           then vLLM's; on 4 GPUs the two engines run side by side (GPUs 0,1 and 2,3)
#   ours70 / vllm70   the 70B shape at tp=4: batch 1 and the 2000 requests from one load each
set -uo pipefail
SUITE_LOGS=tp-logs
# shellcheck source=benchmark/suite_common.sh
source "$(dirname "$0")/suite_common.sh"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
GPUS=$(nvidia-smi -L | wc -l)
LONG=(--num-requests 200 --input-len 128 --output-len 1500 --max-input-len 2000 --max-output-len 2000)

ours() {  # LOG TIMEOUT ARGS...: throughput.py on the GPUs CUDA_VISIBLE_DEVICES names
  local log=$1 limit=$2; shift 2
  timeout "$limit" python3 benchmark/throughput.py --device cuda --max-batch-size 256 "$@" >"$LOG_DIR/$log" 2>&1
  note "$log rc=$? $(grep -hE '^\[(lmdeploy|latency)' "$LOG_DIR/$log" | tr '\n' ' ')"
}

vllm() {  # LOG TIMEOUT ARGS...: vllm_offline.py (batch 1, then the workload ARGS give)
  local log=$1 limit=$2; shift 2
  (cd benchmark && vllm_env timeout "$limit" python3 vllm_offline.py "$@") >"$LOG_DIR/$log" 2>&1
  note "$log rc=$? $(grep -h '^\[vllm' "$LOG_DIR/$log" | tr '\n' ' ')"
}

for step in "$@"; do
  note "=== $step"
  case $step in
    vsite) vllm_site; note "vsite ok=$([ -f /tmp/vsite/.ok ] && echo 1 || echo 0)" ;;
    gen8) [ -f /tmp/l8b/config.json ] || python3 benchmark/random_model.py --shape llama3-8b --out /tmp/l8b \
            >"$LOG_DIR/gen8.log" 2>&1 ;;
    gen70) [ -f /tmp/l70b/model.safetensors.index.json ] || python3 benchmark/random_model.py --shape llama3-70b \
             --out /tmp/l70b >"$LOG_DIR/gen70.log" 2>&1 ;;
    tests) sel="2-0 or 2-8 or 2-4"; [ "$GPUS" -ge 4 ] && sel="$sel or 4-0 or 4-8 or 4-4"
           timeout 900 python3 -m pytest -q -s -p no:cacheprovider tests/test_cuda_tp.py -k "$sel" \
             >"$LOG_DIR/tests.log" 2>&1
           note "tests rc=$? $(tail -1 "$LOG_DIR/tests.log")" ;;
    pair)
      if [ "$GPUS" -ge 4 ]; then
        (CUDA_VISIBLE_DEVICES=0,1 ours ours8-tp2.log 400 --model /tmp/l8b --tp 2 --latency-first "${WORKLOAD[@]}"
         CUDA_VISIBLE_DEVICES=0,1 ours ours8-tp2-long.log 300 --model /tmp/l8b --tp 2 "${LONG[@]}") &
        (CUDA_VISIBLE_DEVICES=2,3 vllm vllm8-tp2.log 500 --model /tmp/l8b --tp 2
         CUDA_VISIBLE_DEVICES=2,3 vllm vllm8-tp2-long.log 400 --model /tmp/l8b --tp 2 --runs 1 --input-sigma 0 \
           --output-sigma 0 "${LONG[@]}") &
        wait
      else
        ours ours8-tp2.log 400 --model /tmp/l8b --tp 2 --latency-first "${WORKLOAD[@]}"
        ours ours8-tp2-long.log 300 --model /tmp/l8b --tp 2 "${LONG[@]}"
        vllm vllm8-tp2.log 500 --model /tmp/l8b --tp 2
        vllm vllm8-tp2-long.log 400 --model /tmp/l8b --tp 2 --runs 1 --input-sigma 0 --output-sigma 0 "${LONG[@]}"
      fi ;;
    ours70) ours ours70-tp4.log 600 --model /tmp/l70b --tp 4 --latency-first "${WORKLOAD[@]}" ;;
    vllm70) vllm vllm70-tp4.log 900 --model /tmp/l70b --tp 4 ;;
    *) echo "unknown step $step (vsite gen8 gen70 tests pair ours70 vllm70)" >&2; exit 2 ;;
  esac
done
note "=== done"
