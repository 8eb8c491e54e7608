#!/bin/bash
# Issue 38's cross-engine check on the GPU machine: lite's AWQ, GPTQ and GPTQ act-order checkpoints of a small
# random Llama, greedy-decoded by this engine and by vLLM (its site unpacked in $1), then compared; the bf16
# model itself first, as the control.
#   bash benchmark/quant_agree.sh /tmp/vsite /tmp/qa
set -u
VSITE=${1:?vLLM site dir}; OUT=${2:-/tmp/qa}
cd "$(dirname "$0")/.." || exit
PYTHONPATH=$PWD python3 benchmark/quant_agree.py make --out "$OUT" || exit 1
status=0
for fmt in base awq gptq gptq_act; do  # (base: the bf16 model itself, the control)
  PYTHONPATH=$PWD python3 benchmark/quant_agree.py ours --model "$OUT/$fmt" --json "$OUT/$fmt.ours.json" \
    > "$OUT/$fmt.ours.log" 2>&1 || { echo "$fmt: this engine failed (see $OUT/$fmt.ours.log)"; status=1; continue; }
  (cd benchmark && PYTHONPATH=$VSITE VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 \
    HF_HUB_OFFLINE=1 python3 quant_agree.py vllm --model "$OUT/$fmt" --json "$OUT/$fmt.vllm.json") \
    > "$OUT/$fmt.vllm.log" 2>&1 || { echo "$fmt: vLLM failed (see $OUT/$fmt.vllm.log)"; status=1; continue; }
  python3 benchmark/quant_agree.py compare "$OUT/$fmt.ours.json" "$OUT/$fmt.vllm.json" || status=1
done
exit $status
