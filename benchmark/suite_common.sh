#!/usr/bin/env bash
# What benchmark/quant_suite.sh, family_suite.sh, tp_suite.sh and quant_agree.sh share; sourced (after `set -uo pipefail`) with
# SUITE_LOGS, the default log folder's name. Sets the repository root as the working directory and PYTHONPATH,
# LOG_DIR (absolute; $LOG_DIR, else ./$SUITE_LOGS), WORKLOAD (the README's 2000 requests) and these functions:
#   note TEXT...            a timed line on stdout and in $LOG_DIR/progress
#   vllm_site               vLLM's site unpacked from $VPARTS (default /tmp/vparts) into /tmp/vsite, once: the first
#                           caller unpacks (waiting up to 15 minutes for the last part, copied in while a suite
#                           runs), others wait for it
#   vllm_env CMD ARGS...    CMD with vLLM's site ($VSITE, default /tmp/vsite) on the path and vLLM's environment
#                           (no FlashInfer sampler, no usage stats, offline)
#   vllm_run LOG ARGS...    benchmark/vllm_offline.py ARGS under vllm_env, 10 minutes at most
# shellcheck disable=SC2034  # (WORKLOAD: the sourcing suite's)
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
LOG_DIR=$(mkdir -p "${LOG_DIR:-$SUITE_LOGS}" && cd "${LOG_DIR:-$SUITE_LOGS}" && pwd)
WORKLOAD=(--num-requests 2000 --input-len 150 --output-len 140 --input-sigma 0.9 --output-sigma 0.9
  --max-input-len 2000 --max-output-len 1000)

note() { echo "$(date +%T) $*" | tee -a "$LOG_DIR/progress"; }

vllm_site() {
  local parts=${VPARTS:-/tmp/vparts}
  if mkdir /tmp/vsite.lock 2>/dev/null; then
    for _ in $(seq 180); do [ -f "$parts/vllm-site.tgz.part04" ] && break; sleep 5; done
    sleep 5  # (the last part's copy finishing)
    [ -f /tmp/vsite/.ok ] || { mkdir -p /tmp/vsite && cat "$parts"/vllm-site.tgz.part* | tar -xz -C /tmp/vsite &&
      touch /tmp/vsite/.ok; }
    touch /tmp/vsite.lock/done
  fi
  until [ -f /tmp/vsite.lock/done ]; do sleep 5; done
}

vllm_env() {
  PYTHONPATH=${VSITE:-/tmp/vsite} VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 \
    "$@"
}

vllm_run() {
  local log=$1; shift
  (cd benchmark && vllm_env timeout 600 python3 vllm_offline.py "$@") >"$log" 2>&1
}
