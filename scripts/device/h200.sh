#!/usr/bin/env bash
# The benchmark session on the GPU machine (one H200), in phases that each fit one 10-minute device command and
# run back to back while the machine stays up (build outputs and models live under /root).
#
#   bash scripts/device/h200.sh setup   # CUDA build through `orchestrator build`, models, probe, inspect, llama-bench
#   bash scripts/device/h200.sh w1      # W1: Qwen3-30B-A3B q4_0 under a 12 GiB budget: plan vs --fit vs sweeps
#   bash scripts/device/h200.sh w2      # W2 (235B shape, 24 GiB), 8/16 GiB plans, routing, `up` on the GPU
#
# Needs .devbundle/ (../shared/device/make-bundle.sh + `orchestrator build --export-source
# .devbundle/llama-src.tar.xz`) carried along. Everything a phase writes is packed into $OUT/<phase>.tgz.
set -uo pipefail
PHASE=${1:?phase: setup | w1 | w2}
W=/root/work
M=$W/models
O=$W/out/$PHASE
mkdir -p "$O" "$M"
source .devbundle/on-device.sh .devbundle >/dev/null
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export ORCHESTRATOR_CACHE=/root/.cache/orchestrator
finish() { tar czf "${OUT:-/tmp}/$PHASE.tgz" -C "$W/out" "$PHASE" 2>/dev/null; }
trap finish EXIT
t0=$(date +%s)
log() { echo "[$(( $(date +%s) - t0 ))s] $*"; }
orch() { python3 -m orchestrator "$@"; }
build_args=(--source .devbundle/llama-src.tar.xz --cuda --cuda-arch 90 --native -j 16)
Q30=$M/qwen3-30b-a3b-q4_0.gguf
Q235=$M/qwen3-235b-a22b-24l-q4_0.gguf
H200=topologies/h200.yaml

case "$PHASE" in
setup)
  log "machine"
  { nvidia-smi; nvidia-smi topo -m; numactl -H; lscpu; free -g; df -h /root; uname -a; } > "$O/machine.txt" 2>&1
  log "build (background) + models"
  ( time orch build "${build_args[@]}" ) > "$O/build.log" 2>&1 &
  BUILD=$!
  ( time orch synth-model "$Q30" --like qwen3-30b-a3b --quant q4_0 ) > "$O/synth.log" 2>&1
  ( time orch synth-model "$Q235" --like qwen3-235b-a22b --layers 24 --quant q4_0 ) >> "$O/synth.log" 2>&1
  timeout 60 python3 -m orchestrator.bench.ballast --budget 12GiB --gpu 0 --hold 3 > "$O/ballast.txt" 2>&1
  wait $BUILD; log "build rc=$?"; tail -3 "$O/build.log"
  SERVER=$(orch build "${build_args[@]}" 2>/dev/null)
  BIN=$(dirname "$SERVER")
  log "server $SERVER"
  orch doctor > "$O/doctor.txt" 2>&1
  log "probe"
  timeout 120 python3 -m orchestrator.hardware.bench_probe --host --json "$O/bench_probe.json" > "$O/bench_probe.txt" 2>&1
  timeout 60 orch probe --refresh --json > "$O/probe.json" 2>"$O/probe.err"; orch probe > "$O/probe.txt" 2>&1
  orch inspect --json --save "$O/h200.tar.gz" > "$O/inspect.json" 2>"$O/inspect.err"; orch inspect > "$O/inspect.txt" 2>&1
  log "llama-bench, whole model on the GPU"
  timeout 120 "$BIN/llama-bench" -m "$Q30" -ngl 99 -fa 1 -p 512 -n 128 -r 3 -o jsonl > "$O/llama-bench.jsonl" 2>"$O/llama-bench.err"
  log "plans"
  for b in 8 12 16; do
    orch plan "$H200" --set "model.path=$Q30" --set "nodes.0.vram_limit=${b}GiB" --json > "$O/plan-q30-${b}g.json" 2>&1
    orch plan "$H200" --set "model.path=$Q30" --set "nodes.0.vram_limit=${b}GiB" > "$O/plan-q30-${b}g.txt" 2>&1
  done
  orch plan "$H200" --set "model.path=$Q235" --set "nodes.0.vram_limit=24GiB" > "$O/plan-q235-24g.txt" 2>&1
  log "done"
  ;;
w1)
  common=(--set "model.path=$Q30" --progress plain --server-verbosity 4)
  log "W1 12 GiB: plan / fit / cpu-moe, 2 rounds"
  timeout 300 orch bench "$H200" "${common[@]}" --vram-budget 12GiB --configs plan,fit,cpu-moe --rounds 2 \
    --pp 8,32,64,128,512,4096 --tg-depths 0,4096 --concurrency 1,4 --ttft-requests 4 --max-minutes 4.5 \
    --out "$O/w1-12g" > "$O/w1-12g.log" 2>&1
  log "W1 12 GiB: sweeps (placement x ubatch x load mode; op-offload threshold), 1 round"
  timeout 290 orch bench "$H200" "${common[@]}" --vram-budget 12GiB --configs plan,ncmoe-sweep,offload-sweep \
    --rounds 1 --pp 8,32,64,128,512,4096 --pp-reps 2 --tg-depths 0 --concurrency none --max-minutes 4.4 \
    --out "$O/w1-12g-sweep" > "$O/w1-12g-sweep.log" 2>&1
  log "done"
  ;;
w2)
  common=(--progress plain --server-verbosity 4 --rounds 1 --pp 32,512,4096 --pp-reps 2 --tg-depths 0 --concurrency none)
  log "W1 at 8 and 16 GiB: the plan loads and runs a full micro-batch"
  for b in 8 16; do
    timeout 75 orch bench "$H200" --set "model.path=$Q30" "${common[@]}" --vram-budget ${b}GiB --configs plan \
      --out "$O/w1-${b}g" > "$O/w1-${b}g.log" 2>&1
  done
  log "W2: Qwen3-235B-A22B shape (24 layers) under 24 GiB"
  timeout 200 orch bench "$H200" --set "model.path=$Q235" "${common[@]}" --vram-budget 24GiB \
    --configs plan,fit --max-minutes 3 --out "$O/w2-24g" > "$O/w2-24g.log" 2>&1
  log "routing through llama.cpp (CUDA)"
  timeout 90 python3 -m orchestrator.model.routing "$Q30" -ngl 99 > "$O/routing.txt" 2>&1
  log "up / status / down on the GPU"
  timeout 150 bash scripts/device/up-proof.sh "$H200" "$Q30" "$O" > "$O/up-proof.log" 2>&1
  log "done"
  ;;
*) echo "unknown phase $PHASE" >&2; exit 2 ;;
esac
