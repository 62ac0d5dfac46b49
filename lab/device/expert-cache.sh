#!/usr/bin/env bash
# The expert cache on one H200, in steps that each fit one device command and run back to back while the machine
# stays up (the build and the models live under /root/work; a step rebuilds or regenerates what a fresh machine
# lacks).
#
#   bash lab/device/expert-cache.sh build    # CUDA build of the patched source (.devcache/llama-src.tar.xz, from
#                                            # `orchestrator build --export-source`), W1 models at routing locality
#                                            # default and 0, the GPU correctness test
#   bash lab/device/expert-cache.sh w1-12g LOCALITY [ROUNDS]   # W1 at 12 GiB: plan (19 CPU expert layers) /
#                                            # plan + 4, 8, 12 layers whose VRAM goes to the cache / plan + 8
#                                            # without the cache / --fit on --load-mode none / plan again (A/A)
#   bash lab/device/expert-cache.sh w1-budget GIB PLAN_LAYERS LOCALITY GRID   # the same at another budget
#
# Everything a step writes is packed into $OUT/<step>.tgz.
set -uo pipefail
STEP=${1:?step: build | w1-12g | w1-budget}
W=/root/work
M=$W/models
O=$W/out/$STEP-$(date +%H%M%S)
mkdir -p "$O" "$M"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
finish() { tar czf "${OUT:-/tmp}/$(basename "$O").tgz" -C "$W/out" "$(basename "$O")" 2>/dev/null; }
trap finish EXIT
t0=$(date +%s)
DEADLINE=${DEADLINE:-$(( t0 + 560 ))}   # unix time after which no benchmark configuration starts
log() { echo "[$(( $(date +%s) - t0 ))s] $*"; }
SRC=$W/src
B=$W/build
BIN=$B/bin

build() {
  if [ -x "$BIN/llama-server" ] && [ -x "$BIN/llama-bench" ]; then return 0; fi
  log "build (CUDA sm_90, 16 jobs)"
  if [ ! -f "$SRC/CMakeLists.txt" ]; then
    mkdir -p "$SRC" && tar xJf .devcache/llama-src.tar.xz -C "$SRC" --strip-components=1 || return 1
  fi
  cat "$SRC/ORCHESTRATOR_PATCHES" > "$O/patches.txt" 2>&1
  ( time { cmake -S "$SRC" -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
      -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF \
      -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_USE_PREBUILT_UI=OFF \
      -DLLAMA_BUILD_UI=OFF && cmake --build "$B" --target llama-server llama-bench -j 16; } ) > "$O/build.log" 2>&1
  local rc=$?
  log "build rc=$rc"; tail -3 "$O/build.log"
  return $rc
}

model() {   # model LOCALITY: W1 (Qwen3-30B-A3B shape, q4_0) at that routing locality
  local path=$M/w1-loc-$1.gguf
  local flag=(--locality "$1")
  # before synth-model had --locality, every generated model routed each token independently (locality 0)
  if ! python3 -m orchestrator synth-model --help 2>/dev/null | grep -q -- --locality; then
    [ "$1" = 0 ] || { log "synth-model has no --locality: cannot write locality $1" >&2; return 1; }
    flag=()
  fi
  if [ ! -f "$path" ]; then
    ( time python3 -m orchestrator synth-model "$path" --like qwen3-30b-a3b --quant q4_0 "${flag[@]}" ) \
      >> "$O/synth.log" 2>&1 || { log "synth failed"; tail -5 "$O/synth.log"; }
  fi
  echo "$path"
}

case "$STEP" in
build)
  { nvidia-smi; nproc; free -g; df -h /root; } > "$O/machine.txt" 2>&1
  build &
  BUILD=$!
  model 0 > /dev/null
  model default > /dev/null
  wait $BUILD || exit 1
  "$BIN/llama-server" --help > "$O/help.txt" 2>&1
  grep -A3 -- "--moe-cache-mib" "$O/help.txt"
  log "GPU correctness test"
  LLAMA_SERVER=$BIN/llama-server timeout 300 python3 -m pytest --noconftest -p no:cacheprovider -m gpu -q -s -rs \
    tests/backend/test_expert_cache_gpu.py > "$O/pytest-gpu.txt" 2>&1
  log "pytest rc=$?"; tail -15 "$O/pytest-gpu.txt"
  ;;
w1-12g)
  build || exit 1
  MODEL=$(model "${2:?locality}")
  log "W1 12 GiB, locality $2"
  python3 lab/device/expert_cache_bench.py --server "$BIN/llama-server" --model "$MODEL" --label "W1 locality $2" \
    --budget-gib 12 --plan-layers 19 --grid 4,8,12 --bare 8 --rounds "${3:-2}" --deadline "$DEADLINE" --out "$O" \
    2>&1 | tee "$O/bench.txt"
  ;;
w1-budget)
  build || exit 1
  MODEL=$(model "${4:?locality}")
  log "W1 $2 GiB, plan $3 CPU layers, locality $4, grid $5"
  python3 lab/device/expert_cache_bench.py --server "$BIN/llama-server" --model "$MODEL" --label "W1 locality $4" \
    --budget-gib "$2" --plan-layers "$3" --grid "$5" --rounds 1 --deadline "$DEADLINE" --out "$O" \
    2>&1 | tee "$O/bench.txt"
  ;;
esac
log "done"
