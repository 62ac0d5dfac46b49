#!/usr/bin/env bash
# Two llama.cpp builds' CPU speed on the same host, one after the other: the CUDA build compiled for this CPU
# (`orchestrator build --cuda --native`, what run.sh's build step makes) with the GPU hidden, and the portable CPU
# build (`orchestrator build`, carried in .devcpu/). The CPU speed model prices a machine by what `orchestrator probe`
# measures with the llama-bench beside the llama-server it will run; this says how far the two builds differ there.
#
#   bash lab/device/cpu-builds.sh NATIVE_BINDIR        (on the device, from the project root; results under $OUT)
#
# Needs .devbundle/ (its on-device.sh) and .devcpu/llama-{server,bench}.xz (see lab/device/cpu-calib.sh). Per build:
# `orchestrator probe --refresh --json` with that build's llama-server (the probe's one-core prompt point), then
# lab.cpu_speed measure: the demo's model at 1 and 16 threads (pp512, pp4096, tg64) and W1 at 16 threads (pp512,
# tg64), CPU_BUILDS_REPS (default 2) repetitions; the two builds alternate over CPU_BUILDS_ROUNDS (default 1).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/cpu-builds-out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/log.txt") 2>&1
t0=$(date +%s)
log() { echo "[$(( $(date +%s) - t0 ))s] $*"; }
die() { log "cpu-builds.sh: $*"; exit 2; }
NATIVE=${1:-}
[ -x "$NATIVE/llama-bench" ] && [ -x "$NATIVE/llama-server" ] || die "usage: cpu-builds.sh NATIVE_BINDIR (with llama-bench and llama-server)"
for t in llama-server llama-bench; do [ -f ".devcpu/$t.xz" ] || die ".devcpu/$t.xz is missing"; done
source .devbundle/on-device.sh .devbundle >/dev/null
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES=
W=${CPU_BUILDS_WORK:-/root/work/cpu-builds}
mkdir -p "$W/portable" "$W/models"
for t in llama-server llama-bench; do
  [ -x "$W/portable/$t" ] || { xz -dc ".devcpu/$t.xz" > "$W/portable/$t" && chmod +x "$W/portable/$t"; }
done
orch() { python3 -m orchestrator "$@"; }
W1=${CPU_BUILDS_W1:-/root/work/models/qwen3-30b-a3b-q4_0.gguf}
DEMO=$W/models/demo-moe.gguf
[ -f "$W1" ] || orch synth-model "$W1" --like qwen3-30b-a3b --quant q4_0 | tail -1
[ -f "$DEMO" ] || orch synth-model "$DEMO" --like qwen3-30b-a3b --scale 0.125 --quant q8_0 | tail -1
lscpu > "$OUT/lscpu.txt" 2>&1
REPS=${CPU_BUILDS_REPS:-2}
for r in $(seq 1 "${CPU_BUILDS_ROUNDS:-1}"); do
  for b in native portable; do
    dir=$NATIVE; [ $b = portable ] && dir=$W/portable
    log "round $r, $b: probe"
    ORCHESTRATOR_CACHE=$W/cache-$b LLAMA_SERVER=$dir/llama-server timeout 180 \
      python3 -m orchestrator probe --refresh --json > "$OUT/probe-$b-r$r.json" 2> "$OUT/probe-$b-r$r.err"
    log "round $r, $b: the demo at 1 and 16 threads"
    timeout 300 python3 -m lab.cpu_speed measure --bench "$dir/llama-bench" --model "$DEMO" --threads 1,16 \
      --rounds 1 --reps "$REPS" --gen 64 --prompts 512,4096 --out "$OUT/demo-$b-r$r.json" | tail -3
    log "round $r, $b: W1 at 16 threads"
    timeout 300 python3 -m lab.cpu_speed measure --bench "$dir/llama-bench" --model "$W1" --threads 16 \
      --rounds 1 --reps "$REPS" --gen 64 --prompts 512 --out "$OUT/w1-$b-r$r.json" | tail -3
  done
done
log "done"
