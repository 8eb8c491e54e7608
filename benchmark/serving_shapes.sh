#!/usr/bin/env bash
# Online serving on a GPU machine, this server and vLLM's with the same client and the issue's settings
# (Llama-3-8B shape, random bf16 weights, session / model length 4096, batch 256, cache 0.8 / 0.9), every
# workload shape of benchmark/serving.py. Logs and JSON lines go to $LOG_DIR (default ./serve-logs).
#
#   bash benchmark/serving_shapes.sh start-lmdeploy [PORT GPU [TREE]]   # in the background; waits until healthy
#                                                  # TREE: another checkout's root (e.g. an earlier version)
#   bash benchmark/serving_shapes.sh start-vllm [PORT GPU]       # needs PYTHONPATH with ../shared/peers' site
#   bash benchmark/serving_shapes.sh run URL LABEL "SHAPES" "RATES" [NUM]   # one serving.py run per shape
#   bash benchmark/serving_shapes.sh stop PORT
#
# TP=N (default 1): both servers with tensor parallelism over the GPUs given (e.g. GPU "0,1" with TP=2).
# run: rates ascending; a shape stops at the first rate whose TTFT p99 is above 1 s ($STOP_MS), so the last
# line of each shape brackets the highest rate under it. NUM requests a rate (default 800).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
LOG_DIR=${LOG_DIR:-serve-logs}
MODEL=${MODEL:-/tmp/l8b}
mkdir -p "$LOG_DIR"

healthy() {  # URL TIMEOUT_S
  for _ in $(seq "$2"); do curl -sf "$1/health" >/dev/null && return 0; sleep 1; done
  return 1
}

case ${1:-} in
  start-lmdeploy)
    port=${2:-8000}; gpu=${3:-0}; tree=${4:-.}
    [ -f "$MODEL/config.json" ] || python3 benchmark/random_model.py --shape llama3-8b --out "$MODEL"
    t0=$(date +%s); log=$(realpath "$LOG_DIR")/lmdeploy-$port.log
    (cd "$tree" && CUDA_VISIBLE_DEVICES=$gpu setsid python3 -m lmdeploy serve api_server "$MODEL" \
      --server-name 127.0.0.1 --server-port "$port" --device cuda --session-len 4096 --max-batch-size 256 \
      --cache-max-entry-count 0.8 --tp "${TP:-1}" --log-level WARNING >"$log" 2>&1 &)
    healthy "http://127.0.0.1:$port" 900 && echo "lmdeploy on $port ready in $(( $(date +%s) - t0 )) s" ;;
  start-vllm)
    port=${2:-8001}; gpu=${3:-0}
    [ -f "$MODEL/config.json" ] || python3 benchmark/random_model.py --shape llama3-8b --out "$MODEL"
    t0=$(date +%s)
    CUDA_VISIBLE_DEVICES=$gpu VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 \
      setsid python3 -m vllm.entrypoints.openai.api_server --model "$MODEL" --host 127.0.0.1 --port "$port" \
      --max-model-len 4096 --max-num-seqs 256 --gpu-memory-utilization 0.9 --tensor-parallel-size "${TP:-1}" \
      >"$LOG_DIR/vllm-$port.log" 2>&1 &
    healthy "http://127.0.0.1:$port" 900 && echo "vllm on $port ready in $(( $(date +%s) - t0 )) s" ;;
  run)
    url=$2; label=$3; shapes=$4; rates=$5; num=${6:-800}
    for shape in $shapes; do
      echo "=== $label $shape $(date +%T)"
      python3 benchmark/serving.py --url "$url" --tokenizer "$MODEL" --shape "$shape" --num-prompts "$num" \
        --request-rate $rates --stop-above "${STOP_MS:-1000}" --timeout 300 \
        --json "$LOG_DIR/$label.jsonl" 2>&1 | grep -v Warning | tee -a "$LOG_DIR/$label.log" |
        grep -E '^(====|completed|TTFT|TPOT|server|error)'
    done ;;
  stop)
    pkill -f -- "--server-port ${2} " ; pkill -f -- "--port ${2} " ; sleep 5 ;;
  *) echo "usage: $0 start-lmdeploy|start-vllm|run|stop ..." >&2; exit 2 ;;
esac
