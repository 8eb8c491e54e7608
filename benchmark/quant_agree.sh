#!/bin/bash
# Issue 38's cross-engine check on the GPU machine: lite's AWQ, GPTQ and GPTQ act-order checkpoints of a small
# random Llama, greedy-decoded by this engine and by vLLM (its site unpacked in $1), then compared; the bf16
# model itself first, as the control.
#   bash benchmark/quant_agree.sh /tmp/vsite /tmp/qa
set -uo pipefail
VSITE=${1:?vLLM site dir}; OUT=${2:-/tmp/qa}
SUITE_LOGS=$OUT
# shellcheck source=benchmark/suite_common.sh
source "$(dirname "$0")/suite_common.sh"
python3 benchmark/quant_agree.py make --out "$OUT" || exit 1
status=0
for fmt in base awq gptq gptq_act; do  # (base: the bf16 model itself, the control)
  python3 benchmark/quant_agree.py ours --model "$OUT/$fmt" --json "$OUT/$fmt.ours.json" \
    > "$OUT/$fmt.ours.log" 2>&1 || { echo "$fmt: this engine failed (see $OUT/$fmt.ours.log)"; status=1; continue; }
  (cd benchmark && vllm_env python3 quant_agree.py vllm --model "$OUT/$fmt" --json "$OUT/$fmt.vllm.json") \
    > "$OUT/$fmt.vllm.log" 2>&1 || { echo "$fmt: vLLM failed (see $OUT/$fmt.vllm.log)"; status=1; continue; }
  python3 benchmark/quant_agree.py compare "$OUT/$fmt.ours.json" "$OUT/$fmt.vllm.json" || status=1
done
exit $status
