#!/usr/bin/env bash
# What benchmark/RESULTS.md records for a CUDA GPU, in one go: the kernel and
# end-to-end tests at full size, the op self-test, the issue's throughput
# workload twice (the first run on a cold Triton cache), batch-1 latency, and
# the decode-GEMM comparison. Logs go to $LOG_DIR (default ./gpu-logs).
#
#   bash benchmark/gpu_suite.sh                 # everything (~10 minutes on an H100)
#   bash benchmark/gpu_suite.sh tests tp lat    # some steps: tests check tp lat gemm trace refill lt floor
#                                               #   mixed serve prefill lat8k kvq kvlong kvlat kvattn
#
# trace: one throughput run with a 2 s kernel trace from 12 s in (trace.json.gz; read it with
# benchmark/trace_gaps.py); refill: throughput with each of $REFILL_SLOTS (default 16 64) free slots
# calling for a prefill step; lt: the decode and prefill GEMMs through each algorithm cuBLASLt suggests;
# floor: the workload's schedule with each step's kernels timed back to back (KV capacity $KV_TOKENS, the
# tp run's: 312000 on an H100 80GB); mixed: host and device time of steps with prompt rows (replayed in
# pieces vs eager); serve: the online workload through the API server at $RATES (default 20 35 50) req/s;
# prefill: 300 prompts of 3,000 tokens at once; lat8k: batch 1 with an 8,000-token prompt.
# For each KV quant_policy in $POLICIES (default 0 8 4): kvq: the throughput workload; kvlong: 200
# requests of 128 prompt and 1,500 output tokens; kvlat: batch-1 latency; kvattn: decode attention alone.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
LOG_DIR=${LOG_DIR:-gpu-logs}
MODEL=${MODEL:-/tmp/l8b}
mkdir -p "$LOG_DIR"
steps=${*:-tests check tp lat gemm}

model() {
  [ -f "$MODEL/config.json" ] || python3 benchmark/random_model.py --shape llama3-8b --out "$MODEL"
}

throughput() {
  python3 benchmark/throughput.py --model "$MODEL" --device cuda --num-requests 2000 --input-len 150 \
    --output-len 140 --input-sigma 0.9 --output-sigma 0.9 --max-input-len 2000 --max-output-len 1000 \
    --max-batch-size 256 "$@"
}

for step in $steps; do
  echo "=== $step $(date +%T)"
  case $step in
    tests) LMDEPLOY_TEST_FULL=1 python3 -m pytest -q tests/test_cuda_kernels.py tests/test_cuda_e2e.py 2>&1 |
             tee "$LOG_DIR/tests.log" | tail -5 ;;
    check) python3 -m lmdeploy check_env 2>&1 | tee "$LOG_DIR/check_env.log" | tail -20 ;;
    tp) model; for run in 1 2; do throughput 2>&1 | grep -v Warning | tee "$LOG_DIR/throughput-$run.log" | tail -6; done ;;
    lat) model; python3 benchmark/latency.py --model "$MODEL" --device cuda --input-len 512 --output-len 256 2>&1 |
           tee "$LOG_DIR/latency.log" | tail -3 ;;
    trace) model; throughput --profile-at 12 --profile-len 2 --trace "$LOG_DIR/trace.json.gz" 2>&1 |
             grep -v Warning | tee "$LOG_DIR/throughput-trace.log" | tail -12 ;;
    refill) model; for slots in ${REFILL_SLOTS:-16 64}; do throughput --refill-slots $slots 2>&1 | grep -v Warning |
              tee "$LOG_DIR/throughput-refill-$slots.log" | tail -6; done ;;
    gemm) python3 benchmark/gemm_sweep.py --shapes gate_up,down,qkv,o 2>&1 | tee "$LOG_DIR/gemm.log" | tail -25 ;;
    lt) python3 benchmark/cublaslt_algos.py --m 256,4800 2>&1 | tee "$LOG_DIR/cublaslt.log" | tail -45 ;;
    floor) python3 benchmark/step_floor.py --measure --kv-tokens ${KV_TOKENS:-312000} 2>&1 | grep -v Writing |
             tee "$LOG_DIR/floor.log" | tail -8 ;;
    mixed) model; python3 benchmark/mixed_step.py --model "$MODEL" 2>&1 | grep -v Warning |
             tee "$LOG_DIR/mixed_step.log" | tail -20 ;;
    serve) model; python3 benchmark/serving.py --launch "$MODEL" --device cuda --num-prompts 800 \
             --request-rate ${RATES:-20 35 50} --json "$LOG_DIR/serving.jsonl" --save-requests 2>&1 | grep -v Warning |
             tee "$LOG_DIR/serving.log" | tail -40 ;;
    prefill) model; python3 benchmark/throughput.py --model "$MODEL" --device cuda --num-requests 300 --input-len 3000 --max-input-len 4000 \
               --output-len 64 --max-batch-size 256 2>&1 | grep -v Warning | tee "$LOG_DIR/prefill.log" | tail -6 ;;
    lat8k) model; python3 benchmark/latency.py --model "$MODEL" --device cuda --input-len 8000 --output-len 16 2>&1 |
             tee "$LOG_DIR/latency-8k.log" | tail -3 ;;
    kvq) model; for qp in ${POLICIES:-0 8 4}; do throughput --quant-policy $qp 2>&1 | grep -v Warning |
           tee "$LOG_DIR/throughput-kv$qp.log" | tail -6; done ;;
    kvlong) model; for qp in ${POLICIES:-0 8 4}; do python3 benchmark/throughput.py --model "$MODEL" --device cuda \
              --num-requests 200 --input-len 128 --output-len 1500 --max-batch-size 256 --quant-policy $qp 2>&1 |
              grep -v Warning | tee "$LOG_DIR/long-decode-kv$qp.log" | tail -6; done ;;
    kvlat) model; for qp in ${POLICIES:-0 8 4}; do python3 benchmark/latency.py --model "$MODEL" --device cuda \
             --input-len 512 --output-len 256 --quant-policy $qp 2>&1 | tee "$LOG_DIR/latency-kv$qp.log" | tail -1; done ;;
    kvattn) python3 benchmark/kv_quant_attn.py --policy ${POLICIES:-0 8 4} 2>&1 | tee "$LOG_DIR/kv_quant_attn.log" | tail -40 ;;
    *) echo "unknown step $step (tests check tp lat gemm trace refill lt floor mixed serve prefill lat8k kvq kvlong kvlat kvattn)"
       exit 2 ;;
  esac
done
echo "=== done $(date +%T); logs in $LOG_DIR"
