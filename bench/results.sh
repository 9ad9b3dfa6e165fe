#!/usr/bin/env bash
# Measures pdserve's batching strategies and the peer servers side by side on this machine, one
# `pdserve bench compare` per stage, then rewrites this machine kind's section of docs/results.md.
#   bash bench/results.sh [OUT_DIR]        (about 45 minutes on 2 CPU cores with the peers)
# The machine kind comes from /proc/cpuinfo: amx (AMX-BF16), avx512-bf16 (AVX512-BF16, no AMX),
# avx512 (AVX-512F) or avx2. The raw run goes to OUT_DIR (default bench/results/<kind>, ignored by
# git); `python -m pdserve.bench.results_page` then renders each stage into its block of the
# kind's section of docs/results.md and copies the picture it shows into docs/results/<kind>/<stage>/.
# Peers: vLLM's CPU build and llama.cpp's llama-server join every table when
# `bash ../shared/peers/setup.sh` has installed them (PEERS_DIR, default ~/.cache/pdserve-peers;
# PEERS_SCRIPTS, default ../shared/peers). bfloat16 rows (pdserve and vLLM) are added only on a
# CPU that computes bfloat16 natively (AVX512-BF16 or AMX-BF16); the other rows pin float32.
# STAGES="saturation rate1 interference" runs a subset; ONLY="vllm mixed chunked" keeps only
# those deployments; SWEEP_RATES=0.8,1.6,2.4 sets the interference sweep's rates; PAGE=FILE renders
# into another copy of the page (a trial run).
# STAGES=shapes (not among the default stages: about 1 3/4 hours on 2 cores) measures real
# models' shapes with random weights, larger than the CPU's cache (python -m pdserve.bench.shapes
# writes them once into SHAPES_DIR, default ~/.cache/pdserve-shapes): for each of SHAPES (default
# "qwen2.5-0.5b llama-3.2-1b"), vLLM-CPU and pdserve mixed, chunked and disaggregated in both
# dtypes (ONLY applies), each started once for the W1 burst (32 requests) and one stream (8
# requests, one at a time), and the decode roofline from pdserve.bench.engine_overhead; on
# SHAPES_SWEPT (default llama-3.2-1b) also an interference mix scaled to the model (SHAPES_MIX)
# swept over SHAPES_RATES with chunked, disaggregated and vLLM in bfloat16 (float32 on a CPU
# without native bfloat16).
set -euo pipefail
cd "$(dirname "$0")/.."
# The command as typed, with the variables that shape the run: the results page shows it.
CMD="bash bench/results.sh${1:+ $1}"
for var in SWEEP_RATES SHAPES_MIX SHAPES_RATES SHAPES_SWEPT SHAPES ONLY STAGES; do
  if [ -n "${!var:-}" ]; then CMD="$var=\"${!var}\" $CMD"; fi
done
case " $(grep -m1 '^flags' /proc/cpuinfo) " in
  *" amx_bf16 "*) KIND=amx ;;
  *" avx512_bf16 "*) KIND=avx512-bf16 ;;
  *" avx512f "*) KIND=avx512 ;;
  *) KIND=avx2 ;;
esac
OUT=${1:-bench/results/$KIND}
CPU=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')
COMMIT=$(git rev-parse --short HEAD)
DATE=$(date -u +%F)
PD=.venv/bin/pdserve
PEERS_DIR=${PEERS_DIR:-$HOME/.cache/pdserve-peers}
PEERS_SCRIPTS=${PEERS_SCRIPTS:-../shared/peers}
STAGES=${STAGES:-saturation rate1 interference concurrency32}
mkdir -p "$OUT"
# Overloaded strategies queue requests for minutes: measure that, don't let the router time them out.
export PDSERVE_REQUEST_TIMEOUT=${PDSERVE_REQUEST_TIMEOUT:-900}
# Exact prompt lengths: count tokens with the served model's own tokenizer.
.venv/bin/python -c "from pdserve.text.loader import load_tokenizer as t; t().tokenizer.save('$OUT/tokenizer.json')"
case $KIND in amx | avx512-bf16) BF16=1 ;; *) BF16=0 ;; esac

stamp() {  # $1: a finished stage's folder. What the results page prints above the stage's table.
  .venv/bin/python -c 'import json, sys; p, cpu, n, c, d, cmd = sys.argv[1:]
open(p, "w").write(json.dumps({"cpu": cpu, "cores": int(n), "commit": c, "date": d, "command": cmd}, indent=2) + "\n")' \
    "$1/run.json" "$CPU" "$(nproc)" "$COMMIT" "$DATE" "$CMD"
}

PEERS=()
if [ -x "$PEERS_DIR/vllmvenv/bin/vllm" ]; then
  PEERS+=(--deployment "vllm=bash $PEERS_SCRIPTS/serve.sh vllm {port}")
  [ "$BF16" = 1 ] && PEERS+=(--deployment "vllm-bf16=bash $PEERS_SCRIPTS/serve.sh vllm-bf16 {port}")
fi
[ -x "$PEERS_DIR/bin/llama-server" ] && PEERS+=(--deployment "llama-f32=bash $PEERS_SCRIPTS/serve.sh llama-f32 {port}")
[ ${#PEERS[@]} = 0 ] && echo "no peers installed (bash $PEERS_SCRIPTS/setup.sh): pdserve rows only" >&2

F32=(--dtype float32)
DEPLOY=(
  "${PEERS[@]}"
  --deployment "static=pdserve up --colocated --policy static ${F32[*]} --port {port}"
  --deployment "prefill-first=pdserve up --colocated --policy prefill-first ${F32[*]} --port {port}"
  --deployment "mixed=pdserve up --colocated --policy mixed ${F32[*]} --port {port}"
  --deployment "chunked=pdserve up --colocated --policy chunked --max-num-batched-tokens 512 ${F32[*]} --port {port}"
  --deployment "disaggregated=pdserve up ${F32[*]} --port {port}"
)
if [ "$BF16" = 1 ]; then
  DEPLOY+=(
    --deployment "mixed-bf16=pdserve up --colocated --policy mixed --dtype bfloat16 --port {port}"
    --deployment "chunked-bf16=pdserve up --colocated --policy chunked --max-num-batched-tokens 512 --dtype bfloat16 --port {port}"
    --deployment "disaggregated-bf16=pdserve up --dtype bfloat16 --port {port}"
  )
fi
only() {  # the --deployment pairs of "$@" whose name is in ONLY (all of them without ONLY), NUL-separated
  local i name
  for ((i = 1; i < $#; i += 2)); do
    name=${@:i+1:1}
    name=${name%%=*}
    if [[ -z "${ONLY:-}" || " $ONLY " == *" $name "* ]]; then printf '%s\0' "${@:i:2}"; fi
  done
}
mapfile -d '' DEPLOY < <(only "${DEPLOY[@]}")
# The client runs on core 0 with the router and the prefill worker: decode workers own core 1.
COMMON=(--endpoint completions --tokenizer "$OUT/tokenizer.json" --seed 0 --warmup 2 --no-progress --client-cpus 0)

SHAPES=${SHAPES:-qwen2.5-0.5b llama-3.2-1b}
SHAPES_DIR=${SHAPES_DIR:-$HOME/.cache/pdserve-shapes}
SHAPES_SWEPT=${SHAPES_SWEPT:-llama-3.2-1b}
# The interference stage's chats, with long prompts costing the compute per second its own cost
# SmolLM2: a 1B model's prefill costs 9 times SmolLM2's a token, so 256 tokens every 20 s stand
# for 768 every 6 s (each about 1.3 s of both cores in bfloat16, 2.5 s of the disaggregated
# prefill worker's one core; 768 tokens would hold that core past the TTFT limit every time).
SHAPES_MIX=${SHAPES_MIX:---input-len 96 --output-len 64 --long-input-len 256 --long-output-len 8 --long-interval 20 --num-requests 24}
SHAPES_RATES=${SHAPES_RATES:-0.1,0.2,0.4}
shapes_stage() {  # $1: the stage's folder, one folder per shape in it
  local dtypes=(float32) fast=float32 sfx shape dir out dt deps runs swept
  [ "$BF16" = 1 ] && dtypes+=(bfloat16) && fast=bfloat16
  for shape in $SHAPES; do
    dir=$SHAPES_DIR/$shape out=$1/$shape
    .venv/bin/python -m pdserve.bench.shapes write "$shape" "$dir"
    mkdir -p "$out" && cp "$dir/shape.json" "$out/"
    deps=()
    for dt in "${dtypes[@]}"; do
      sfx=; [ "$dt" = bfloat16 ] && sfx=-bf16
      .venv/bin/python -m pdserve.bench.engine_overhead --model "$dir" --dtype "$dt" --threads 2 --prefill 256 \
        --json "$out/roofline-$dt.json" | tee "$out/roofline-$dt.txt"
      [ -x "$PEERS_DIR/vllmvenv/bin/vllm" ] &&
        deps+=(--deployment "vllm$sfx=bash $PEERS_SCRIPTS/serve.sh vllm$sfx {port} $dir")
      deps+=(
        --deployment "mixed$sfx=pdserve up --colocated --policy mixed --model $dir --dtype $dt --port {port}"
        --deployment "chunked$sfx=pdserve up --colocated --policy chunked --max-num-batched-tokens 512 --model $dir --dtype $dt --port {port}"
        --deployment "disaggregated$sfx=pdserve up --model $dir --dtype $dt --port {port}"
      )
    done
    mapfile -d '' deps < <(only "${deps[@]}")
    # The stream has its own seed: the burst's prompts would be prefix-cache hits on every server.
    runs=(
      --run "burst=--workload random --input-len 256 --output-len 64 --range-ratio 0 --request-rate inf --num-requests 32"
      --run "stream=--workload random --input-len 256 --output-len 64 --range-ratio 0 --concurrency 1 --num-requests 8 --warmup 1 --seed 1"
    )
    sfx=; [ "$fast" = bfloat16 ] && sfx=-bf16
    swept=()  # the deployments of the sweep that the run has
    for n in "chunked$sfx" "disaggregated$sfx" "vllm$sfx"; do
      if [[ " ${deps[*]} " == *" $n="* ]]; then swept+=("$n"); fi
    done
    if [[ " $SHAPES_SWEPT " == *" $shape "* && ${#swept[@]} -gt 0 ]]; then
      runs+=(--run "interference=--workload interference $SHAPES_MIX --slo ttft=3s,tbt_p99=200ms --rates $SHAPES_RATES"
        --only "interference=$(IFS=,; echo "${swept[*]}")")
    fi
    # Exit status 1: a deployment failed, and its rows say so; anything else stops the run.
    .venv/bin/python -m pdserve.bench.multi_compare "${deps[@]}" "${runs[@]}" "${COMMON[@]}" --output-dir "$out" ||
      [ $? = 1 ]
  done
}

for stage in $STAGES; do
  rm -rf "${OUT:?}/$stage"  # a stage's folder holds one run
  case $stage in
  saturation)  # W1: 64 prompts of 256 tokens, 64 output tokens, all sent at once -> throughput
    $PD bench compare "${DEPLOY[@]}" "${COMMON[@]}" --workload random --input-len 256 --output-len 64 \
      --range-ratio 0 --request-rate inf --num-requests 64 --slo ttft=5s,tbt_p99=200ms --output-dir "$OUT/saturation" ;;
  rate1)  # the same requests at 1 request/s: the latency point
    $PD bench compare "${DEPLOY[@]}" "${COMMON[@]}" --workload random --input-len 256 --output-len 64 \
      --range-ratio 0 --request-rate 1 --num-requests 40 --slo ttft=2s,tbt_p99=200ms --output-dir "$OUT/rate1" ;;
  interference)  # short chats streaming while long prompts arrive, then the SLO-capacity sweep
    $PD bench compare "${DEPLOY[@]}" "${COMMON[@]}" --workload interference --input-len 96 --output-len 64 \
      --request-rate 0.8 --num-requests 48 --long-input-len 768 --long-output-len 8 --long-interval 6 \
      --slo ttft=3s,tbt_p99=200ms --rates "${SWEEP_RATES:-0.4,0.8,1.2,1.6}" --output-dir "$OUT/interference" ;;
  concurrency32)  # 32 concurrent streaming chats (closed loop)
    $PD bench compare "${COMMON[@]}" --endpoint chat --workload conversation --concurrency 32 --num-requests 64 \
      "${PEERS[@]}" \
      --deployment "chunked=pdserve up --colocated --policy chunked --max-num-batched-tokens 512 ${F32[*]} --port {port}" \
      --deployment "disaggregated=pdserve up ${F32[*]} --port {port}" --slo ttft=3s,tbt_p99=200ms \
      --output-dir "$OUT/concurrency32" ;;
  shapes)  # real models' shapes, larger than the cache: one start per deployment for every workload
    shapes_stage "$OUT/shapes" ;;
  *) echo "unknown stage $stage" >&2; exit 2 ;;
  esac
  stamp "$OUT/$stage"
done
# shellcheck disable=SC2086  # one argument per stage
.venv/bin/python -m pdserve.bench.results_page --kind "$KIND" --run-dir "$OUT" --stages $STAGES --page "${PAGE:-docs/results.md}"
