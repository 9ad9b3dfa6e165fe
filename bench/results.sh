#!/usr/bin/env bash
# Reproduces docs/results.md: every batching strategy side by side, on this machine, one run.
#   bash bench/results.sh [OUT_DIR]        (about 20 minutes on 2 CPU cores)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-docs/results}
PD=.venv/bin/pdserve
mkdir -p "$OUT"
# Exact prompt lengths: count tokens with the served model's own tokenizer.
.venv/bin/python -c "from tests.helpers.tiny_llama import default_tokenizer as t; t().save('$OUT/tokenizer.json')"
DEPLOY=(
  --deployment "static=pdserve up --colocated --policy static --port {port}"
  --deployment "prefill-first=pdserve up --colocated --policy prefill-first --port {port}"
  --deployment "mixed=pdserve up --colocated --policy mixed --port {port}"
  --deployment "chunked=pdserve up --colocated --policy chunked --max-num-batched-tokens 128 --port {port}"
  --deployment "disaggregated=pdserve up --port {port}"
)
COMMON=(--endpoint completions --tokenizer "$OUT/tokenizer.json" --seed 0 --warmup 2 --no-progress)

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
