#!/usr/bin/env bash
# Reproduces docs/results.md: every batching strategy side by side, on this machine, one run.
#   bash bench/results.sh [OUT_DIR]        (about 35 minutes on 2 CPU cores)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-docs/results}
PD=.venv/bin/pdserve
mkdir -p "$OUT"
# Overloaded strategies queue requests for minutes: measure that, don't let the router time them out.
export PDSERVE_REQUEST_TIMEOUT=${PDSERVE_REQUEST_TIMEOUT:-900}
# Exact prompt lengths: count tokens with the served model's own tokenizer.
.venv/bin/python -c "from tests.helpers.tiny_llama import default_tokenizer as t; t().save('$OUT/tokenizer.json')"
DEPLOY=(
  --deployment "static=pdserve up --colocated --policy static --port {port}"
  --deployment "prefill-first=pdserve up --colocated --policy prefill-first --port {port}"
  --deployment "mixed=pdserve up --colocated --policy mixed --port {port}"
  --deployment "chunked=pdserve up --colocated --policy chunked --max-num-batched-tokens 128 --port {port}"
  --deployment "disaggregated=pdserve up --port {port}"
  # The same two best strategies in bfloat16 (this CPU has AMX): not the float32 comparison.
  --deployment "mixed-bf16=pdserve up --colocated --policy mixed --dtype bfloat16 --port {port}"
  --deployment "disaggregated-bf16=pdserve up --dtype bfloat16 --port {port}"
)
# The client runs on core 0 with the router and the prefill worker: decode workers own core 1.
COMMON=(--endpoint completions --tokenizer "$OUT/tokenizer.json" --seed 0 --warmup 2 --no-progress --client-cpus 0)

# 1. The peer's workload: 256-token prompts, 64 output tokens, 1 request/s (vLLM CPU: TBT p99 1.4 s).
$PD bench compare "${DEPLOY[@]}" "${COMMON[@]}" --workload random --input-len 256 --output-len 64 \
  --range-ratio 0 --request-rate 1 --num-requests 40 --slo ttft=2s,tbt_p99=200ms --output-dir "$OUT/rate1"
# 2. Saturation: the same requests offered faster than any deployment serves them -> throughput.
$PD bench compare "${DEPLOY[@]}" "${COMMON[@]}" --workload random --input-len 256 --output-len 64 \
  --range-ratio 0 --request-rate 4 --num-requests 48 --slo ttft=5s,tbt_p99=200ms --output-dir "$OUT/saturation"
# 3. Interference: short chats streaming while long prompts arrive (where prefill stalls decode).
$PD bench compare "${DEPLOY[@]}" "${COMMON[@]}" --workload interference --input-len 96 --output-len 64 \
  --request-rate 0.8 --num-requests 48 --long-input-len 768 --long-output-len 8 --long-interval 6 \
  --slo ttft=3s,tbt_p99=200ms --output-dir "$OUT/interference"
# 4. 32 concurrent streaming chats (closed loop), disaggregated next to colocated chunked.
$PD bench compare "${COMMON[@]}" --endpoint chat --workload conversation --concurrency 32 --num-requests 64 \
  --deployment "chunked=pdserve up --colocated --policy chunked --max-num-batched-tokens 128 --port {port}" \
  --deployment "disaggregated=pdserve up --port {port}" --slo ttft=3s,tbt_p99=200ms --output-dir "$OUT/concurrency32"
