#!/usr/bin/env bash
# Cross-checks pdserve's benchmark client against vLLM's own, `vllm bench serve` from the peers'
# venv (bash ../shared/peers/setup.sh vllm): both measure the same server with the same workload
# shape, one after the other. Output tokens must agree exactly; mean TTFT and mean TPOT within 10%.
#   bash bench/peer_client_check.sh [OUT_DIR]
# The server is `pdserve up --colocated` on a free port (SERVER="..." with {port} to change it).
# Requests go one at a time (vLLM: --max-concurrency 1 at rate inf; pdserve: --concurrency 1):
# with open-loop Poisson arrivals each client draws its own arrival times, and the queueing they
# cause differs more between two runs than the 10% being checked.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-/tmp/pdserve-peer-client-check}
P=${PEERS_DIR:-$HOME/.cache/pdserve-peers}
N=${NUM_PROMPTS:-16}
[ -x "$P/vllmvenv/bin/vllm" ] || { echo "vLLM is not installed: bash ../shared/peers/setup.sh vllm" >&2; exit 2; }
mkdir -p "$OUT"
port=$(.venv/bin/python -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
server=${SERVER:-.venv/bin/pdserve up --colocated --policy chunked --port {port}}
setsid bash -c "${server//\{port\}/$port}" > "$OUT/server.log" 2>&1 &
pid=$!
trap 'kill -TERM -- -$pid 2>/dev/null || true; wait $pid 2>/dev/null || true' EXIT
until curl -sf "http://127.0.0.1:$port/ready" >/dev/null || curl -sf "http://127.0.0.1:$port/health" >/dev/null; do
  kill -0 $pid 2>/dev/null || { tail -20 "$OUT/server.log"; exit 1; }
  sleep 1
done
model=$(curl -s "http://127.0.0.1:$port/v1/models" | .venv/bin/python -c "import json, sys; print(json.load(sys.stdin)['data'][0]['id'])")

PYTHONPATH=$P/vllm_shim "$P/vllmvenv/bin/vllm" bench serve --backend openai --base-url "http://127.0.0.1:$port" \
  --endpoint /v1/completions --model "$model" --tokenizer "$P/smollm2-hf" --dataset-name random \
  --random-input-len 256 --random-output-len 64 --random-range-ratio 0 --num-prompts "$N" --request-rate inf \
  --max-concurrency 1 --ignore-eos --seed 0 --save-result --result-dir "$OUT" --result-filename vllm.json > "$OUT/vllm_bench.log" 2>&1 ||
  { tail -30 "$OUT/vllm_bench.log"; exit 1; }
.venv/bin/pdserve bench run --base-url "http://127.0.0.1:$port" --endpoint completions --workload random \
  --input-len 256 --output-len 64 --range-ratio 0 --num-requests "$N" --concurrency 1 --seed 0 --warmup 0 \
  --tokenizer "$P/smollm2-hf/tokenizer.json" --no-progress --no-plots --output-dir "$OUT/pdserve" > "$OUT/pdserve_bench.log" 2>&1

.venv/bin/python - "$OUT" <<'EOF'
import json, sys
out = sys.argv[1]
v = json.load(open(f"{out}/vllm.json"))
p = json.load(open(f"{out}/pdserve/summary.json"))
rows = [("output tokens", v["total_output_tokens"], p["total_output_tokens"], 0.0),
        ("mean TTFT ms", v["mean_ttft_ms"], p["mean_ttft_ms"], 0.10),
        ("mean TPOT ms", v["mean_tpot_ms"], p["mean_tpot_ms"], 0.10),
        ("median TPOT ms", v["median_tpot_ms"], p["median_tpot_ms"], None)]
ok = True
print(f"{'':<16}{'vllm bench':>12}{'pdserve bench':>15}{'ratio':>8}  bound")
for name, a, b, bound in rows:
    ratio = b / a if a else float("nan")
    good = bound is None or abs(ratio - 1) <= bound
    ok &= good
    print(f"{name:<16}{a:>12.1f}{b:>15.1f}{ratio:>8.3f}  {'-' if bound is None else f'±{bound:.0%}'} {'ok' if good else 'FAIL'}")
sys.exit(0 if ok else 1)
EOF
