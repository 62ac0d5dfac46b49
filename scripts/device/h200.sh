#!/usr/bin/env bash
# The benchmark session on the GPU machine (one H200), in phases that each fit one 10-minute device command and
# run back to back while the machine stays up (build outputs and models live under /root).
#
#   bash scripts/device/h200.sh a   # CUDA build through `orchestrator build`, models, probe, inspect, llama-bench,
#                                   # W1 (Qwen3-30B-A3B q4_0 under 12 GiB): plan vs --fit vs --cpu-moe, round 1
#   bash scripts/device/h200.sh b   # W1 round 2 and the sweeps, `up` on the GPU, W2 (235B shape, 24 GiB)
#
# The second session (same day), three commands back to back:
#   bash scripts/device/h200.sh c   # build + W1 model, bytecode compiled as pip would, the GPU-marked tests,
#                                   # the memory model's mixed CPU/GPU calibration cases
#   bash scripts/device/h200.sh d   # W1 12 GiB: plan / --fit / plan again (A/A) / --n-cpu-moe 18, two rounds,
#                                   # three tg samples per start; W1 at 8 and 16 GiB: plan / --fit
#   bash scripts/device/h200.sh e   # `up` proof again (ready time), gateway overhead on the GPU, the
#                                   # --n-cpu-moe x -ub sweep around the plan with repeated tg samples
#   bash scripts/device/h200.sh f   # fresh machine, one command: build, `up` with the head started while
#                                   # planning, gateway overhead with 4 and 1 gateway processes, plan vs --fit
#                                   # generation over 5 rounds
#   bash scripts/device/h200.sh g   # nvidia-h200-x2: build, inspect/probe, the 235B shape on 2 GPUs: plan
#                                   # (-sm tensor) vs -sm layer vs --fit; `up` and the gateway there
#   bash scripts/device/h200.sh h   # nvidia-h200-x2, next session: the corrected plan vs --fit (2 rounds), and
#                                   # W1 on two GPUs at 6 GiB each
#
# The third session (evening), three commands back to back on nvidia-h200-x2 (GPU 0 alone stands in for the H200):
#   bash scripts/device/h200.sh i   # mainline + ik_llama.cpp CUDA builds side by side, models; `up` on GPU 0
#                                   # (W1 12 GiB, head started while planning); gateway overhead, 4 and 1 processes
#                                   # (as run on 2026-11-29 the ik build was still compiling during `up` and the
#                                   # gateway runs, which made them CPU-starved: do not measure beside a build;
#                                   # the ik build needs more than 9 minutes with 16 jobs)
#   bash scripts/device/h200.sh j   # W1 12 GiB on GPU 0: plan / --fit / generation threads 8, 16, 24 (3 rounds);
#                                   # W2 on 2 x 12 GiB: the corrected plan (-sm layer) / --fit
#   bash scripts/device/h200.sh k S # W2 on 2 x 12 GiB: ik_llama.cpp's plan (-sm graph) / ik -sm layer / mainline's
#                                   # plan; W1 on 2 x 6 GiB: plan / --fit; ends itself after S seconds
#
# Next x2 session (builds resume now, so a build cut by a command's time limit goes on in the next command):
#   bash scripts/device/h200.sh l   # ik_llama.cpp CUDA build alone (32 jobs), models; nothing is measured beside it
#   bash scripts/device/h200.sh m   # mainline build (32 jobs), then W2 on 2 x 12 GiB: ik plan (-sm graph) / ik
#                                   # -sm layer / mainline plan, and W1 at 2 x 24 GiB (no overflow): the plan
#                                   # (-sm tensor) / -sm layer / --fit
#
# The fourth session (2026-11-29, night), one nvidia-h200, two commands back to back:
#   bash scripts/device/h200.sh n   # build + W1 model; `up` proof (ready time); gateway overhead, 4 and 1 processes
#   bash scripts/device/h200.sh o   # W1 12 GiB: where generation can still gain on the CPU side: plan / --fit /
#                                   # plan --no-host (experts repacked for the CPU, no op offload) / --cpu-strict 1
#                                   # / --prio 2 / --poll 100, 3 interleaved rounds
#   bash scripts/device/h200.sh p   # W1 at 8 and 12 GiB: plan / --fit / plan again (A/A), 3 rounds each
#   bash scripts/device/h200.sh q   # W1 8 GiB: plan / --fit / the plan's placement memory-mapped / --no-host
#   (p and q ran as inline commands with exactly these lines on 2026-11-29)
# Next session (one nvidia-h200):
#   bash scripts/device/h200.sh r   # W1 8 GiB, why --fit generates 4-7% faster than the plan: the plan at -ub 512
#                                   # (fit's), and the plan's 33 CPU expert layers moved to the back (15..47, as
#                                   # --fit places them), 4 rounds; needs the build from n (or s); `r 12`: at 12 GiB
#
# The fifth session (2026-11-29, late night), one nvidia-h200, commands back to back:
#   bash scripts/device/h200.sh s   # build + W1 model; `up` proof with the early start (default) on the CUDA build;
#                                   # gateway overhead with the default (1 gateway process), then 4 if time is left
#   bash scripts/device/h200.sh r   # as above; then `R_SECONDS=540 ... r 12`, `R_SECONDS=400 ... r 8` (again)
#   (then 3 x scripts/bench/gateway_overhead.py --mode ray --rounds 20 --gateway-processes 1 inline, and on a fresh
#   machine scripts/device/gateway-cpu.sh for the new gateway: no time was left for a CUDA build)
#
# Needs .devbundle/ (../shared/device/make-bundle.sh + `orchestrator build --export-source
# .devbundle/llama-src.tar.xz`) carried along. Everything a phase writes is packed into $OUT/<phase>.tgz.
set -uo pipefail
PHASE=${1:?phase: a | b | c | d | e | f | g | h | i | j | k | l | m | n | o | p | q | r | s}
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
ik_args=(--flavor ik_llama.cpp --source .devbundle/ik-src.tar.xz --cuda --cuda-arch 90 --native -j 16)
Q30=$M/qwen3-30b-a3b-q4_0.gguf
Q235=$M/qwen3-235b-a22b-24l-q4_0.gguf
H200=topologies/h200.yaml

left() { echo $(( DEADLINE - $(date +%s) )); }   # seconds left in this phase
# a fresh machine: the CUDA build and the bytecode of the bundle (as pip install would compile it) in the background
start_build() {
  ( time orch build "${build_args[@]}" ) > "$O/build.log" 2>&1 &
  BUILD=$!
  ( time python3 -m compileall -q -j 4 /tmp/site "$PWD/orchestrator" ) > "$O/compileall.log" 2>&1 &
}
synth() {   # synth q30 | q235: write a model (beside the build)
  case "$1" in
    q30) ( time orch synth-model "$Q30" --like qwen3-30b-a3b --quant q4_0 ) >> "$O/synth.log" 2>&1 ;;
    q235) ( time orch synth-model "$Q235" --like qwen3-235b-a22b --layers 24 --quant q4_0 ) >> "$O/synth.log" 2>&1 ;;
  esac
}
finish_build() {   # wait for start_build; end the phase when the build failed; SERVER = the built llama-server
  wait $BUILD; rc=$?; log "build rc=$rc"; tail -3 "$O/build.log"
  [ $rc -eq 0 ] || exit 1
  wait
  SERVER=$(orch build "${build_args[@]}" 2>/dev/null)
}

w1_2x6g() {   # W1 on two GPUs held to 6 GiB each: plan / --fit, one round, until the phase's deadline
  log "W1 on 2 GPUs x 6 GiB: plan / --fit ($(left) s left)"
  mins=$(python3 -c "print(max(0.3, ($(left) - 12) / 60))")
  timeout $(( $(left) - 3 )) python3 -m orchestrator bench "$H200" --set "model.path=$Q30" --progress plain \
    --vram-budget 6GiB --configs plan,fit --rounds 1 --pp 32,512,4096 --pp-reps 1 --tg-depths 0 --tg-reps 3 \
    --concurrency none --max-minutes "$mins" --out "$O/w1-2x6g" > "$O/w1-2x6g.log" 2>&1
}

w2_ik_vs_mainline() {   # W2 on 2 GPUs x 12 GiB: ik plan / ik -sm layer / mainline plan ($IK, $SERVER), one run;
                        # leaves $1 seconds of the phase for what follows
  orch plan "$H200" --set "model.path=$Q235" --set nodes.0.vram_limit=12GiB --set "backend.binary=$IK" \
    > "$O/plan-w2-ik.txt" 2>&1
  orch plan "$H200" --set "model.path=$Q235" --set nodes.0.vram_limit=12GiB --set "backend.binary=$IK" \
    --set workers.split_mode=layer --json > "$O/plan-w2-ik-layer.json" 2>&1
  orch plan "$H200" --set "model.path=$Q235" --set nodes.0.vram_limit=12GiB --set "backend.binary=$SERVER" \
    --json > "$O/plan-w2.json" 2>&1
  IKLAYER=$(python3 scripts/device/plan-config.py ik-layer "$O/plan-w2-ik-layer.json")
  MAIN=$(python3 scripts/device/plan-config.py mainline-plan "$O/plan-w2.json" --server)
  log "W2 on 2 GPUs x 12 GiB: ik plan / ik -sm layer / mainline plan ($(left) s left)"
  timeout $(( $(left) - $1 )) python3 -m orchestrator bench "$H200" --set "model.path=$Q235" \
    --set "backend.binary=$IK" --progress plain --vram-budget 12GiB --configs plan --config "$IKLAYER" \
    --config "$MAIN" --rounds 1 --pp 32,512,4096 --pp-reps 1 --tg-depths 0,4096 --tg-reps 2 --concurrency none \
    --max-minutes $(python3 -c "print(max(0.3, ($(left) - $1 - 10) / 60))") --out "$O/w2-2x12g-ik" \
    > "$O/w2-2x12g-ik.log" 2>&1
}

gateway_4_and_1() {   # gateway overhead, W1 all on the GPU, with 4 then 1 gateway processes: TIMEOUT ROUNDS each
  for n in 4 1; do
    log "gateway overhead, $n gateway process(es) ($(left) s left)"
    timeout "$1" python3 scripts/bench/gateway_overhead.py --mode ray --rounds "$2" --model "$Q30" --binary "$SERVER" \
      --ngl 99 --threads 8 --gateway-processes $n --json > "$O/gateway-$n.txt" 2>&1
  done
}

case "$PHASE" in
a)
  DEADLINE=$(( t0 + 470 ))
  log "machine"
  { nvidia-smi; nvidia-smi topo -m; numactl -H; lscpu; free -g; df -h /root; uname -a; } > "$O/machine.txt" 2>&1
  log "build (background) + models"
  ( time orch build "${build_args[@]}" ) > "$O/build.log" 2>&1 &
  BUILD=$!
  ( time orch synth-model "$Q30" --like qwen3-30b-a3b --quant q4_0 ) > "$O/synth.log" 2>&1
  ( time orch synth-model "$Q235" --like qwen3-235b-a22b --layers 24 --quant q4_0 ) >> "$O/synth.log" 2>&1
  wait $BUILD; rc=$?; log "build rc=$rc"; tail -3 "$O/build.log"
  [ $rc -eq 0 ] || exit 1
  SERVER=$(orch build "${build_args[@]}" 2>/dev/null)     # the cache: instant
  BIN=$(dirname "$SERVER")
  log "server $SERVER"
  orch doctor > "$O/doctor.txt" 2>&1
  log "llama-bench, whole model on the GPU"
  timeout 60 "$BIN/llama-bench" -m "$Q30" -ngl 99 -fa 1 -p 512 -n 128 -r 3 -o jsonl > "$O/llama-bench.jsonl" 2>"$O/llama-bench.err"
  log "probe"
  timeout 60 python3 -m orchestrator probe --refresh --json > "$O/probe.json" 2>"$O/probe.err"; orch probe > "$O/probe.txt" 2>&1
  orch inspect --json --save "$O/h200.tar.gz" > "$O/inspect.json" 2>"$O/inspect.err"; orch inspect > "$O/inspect.txt" 2>&1
  for b in 8 12 16; do
    orch plan "$H200" --set "model.path=$Q30" --set "nodes.0.vram_limit=${b}GiB" --json > "$O/plan-q30-${b}g.json" 2>&1
  done
  orch plan "$H200" --set "model.path=$Q30" > "$O/plan-q30-12g.txt" 2>&1
  log "up / status / down on the GPU ($(left) s left)"
  timeout $(( $(left) - 60 )) bash scripts/device/up-proof.sh "$H200" "$Q30" "$O/up" > "$O/up-proof.log" 2>&1
  log "probe vs torch ($(left) s left)"
  timeout $(( $(left) - 3 )) python3 -m lab.bench_probe --backends nvcc --allocs register,hostalloc \
    --json "$O/bench_probe.json" > "$O/bench_probe.txt" 2>&1
  log "done"
  ;;
b)
  DEADLINE=$(( t0 + 440 ))
  log "W1 12 GiB: plan / fit / cpu-moe"
  timeout 170 python3 -m orchestrator bench "$H200" --set "model.path=$Q30" --progress plain --vram-budget 12GiB \
    --configs plan,fit,cpu-moe --rounds 1 --pp 8,32,64,128,512,4096 --pp-reps 2 --tg-depths 0,4096 \
    --concurrency 1,4 --ttft-requests 4 --max-minutes 2.6 --out "$O/w1-12g" > "$O/w1-12g.log" 2>&1
  log "W1 12 GiB sweeps: --n-cpu-moe x -ub (pinned), op-offload threshold ($(left) s left)"
  timeout 200 python3 -m orchestrator bench "$H200" --set "model.path=$Q30" --progress plain --vram-budget 12GiB \
    --configs plan,ncmoe-sweep,offload-sweep --load-modes pinned --offload never,256 --rounds 1 \
    --pp 8,32,64,128,512,4096 --pp-reps 1 --tg-depths 0 --concurrency none --max-minutes 3.1 \
    --out "$O/w1-12g-sweep" > "$O/w1-12g-sweep.log" 2>&1
  log "W2: Qwen3-235B-A22B shape (24 layers) under 24 GiB ($(left) s left)"
  mins=$(python3 -c "print(max(0.3, ($(left) - 15) / 60))")
  timeout $(( $(left) - 3 )) python3 -m orchestrator bench "$H200" --set "model.path=$Q235" --progress plain --vram-budget 24GiB \
    --configs plan,fit --rounds 1 --pp 32,512,4096 --pp-reps 1 --tg-depths 0 --concurrency none \
    --max-minutes "$mins" --out "$O/w2-24g" > "$O/w2-24g.log" 2>&1
  log "done"
  ;;
c)
  DEADLINE=$(( t0 + 545 ))
  { nvidia-smi; numactl -H; nproc; free -g; df -h /root; } > "$O/machine.txt" 2>&1
  log "build (background), bytecode (background, as pip install does), W1 model, GPU-marked tests without llama-server"
  start_build
  synth q30
  timeout 150 python3 -m pytest -m gpu -p no:cacheprovider -q -rs tests/hardware/test_probe.py \
    tests/hardware/test_live.py tests/cluster/test_cluster_metrics.py tests/bench/test_ballast.py \
    tests/bench/test_sampler.py > "$O/pytest-gpu.txt" 2>&1
  log "pytest rc=$?"; tail -2 "$O/pytest-gpu.txt"
  finish_build
  log "server $SERVER"
  log "GPU-marked bench test with the CUDA llama-server"
  LLAMA_SERVER=$SERVER timeout 60 python3 -m pytest -m gpu -p no:cacheprovider -q -rs tests/bench/test_runner.py \
    > "$O/pytest-gpu-runner.txt" 2>&1
  log "pytest rc=$?"; tail -2 "$O/pytest-gpu-runner.txt"
  log "memory model: mixed CPU/GPU calibration cases ($(left) s left)"
  timeout $(( $(left) - 12 )) python3 -m lab.calibrate gpu --server "$SERVER" --out "$O/calib-gpu" \
    --models "$W/calib-models" --only cpu-moe-c --timeout 120 > "$O/calib-gpu.log" 2>&1
  log "calibration rc=$?"
  timeout 8 python3 -m lab.calibrate report "$O/calib-gpu" --models "$W/calib-models" \
    > "$O/calib-gpu-report.txt" 2>&1
  tail -4 "$O/calib-gpu-report.txt"
  log "done"
  ;;
d)
  DEADLINE=$(( t0 + 500 ))
  SERVER=$(ls "$ORCHESTRATOR_CACHE"/llama.cpp/mainline-cuda-*/bin/llama-server 2>/dev/null | head -1)
  [ -n "$SERVER" ] || { echo "no CUDA build on this machine (run phase c first)"; exit 1; }
  [ -f "$Q30" ] || { echo "no W1 model on this machine"; exit 1; }
  log "W1 12 GiB: plan / fit / plan again / --n-cpu-moe 18, 2 rounds, 3 tg samples per start"
  timeout 320 python3 -m orchestrator bench "$H200" --set "model.path=$Q30" --progress plain --vram-budget 12GiB \
    --configs plan,fit,control,ncmoe-sweep --ncmoe 18 --ub 1024 --load-modes pinned --rounds 2 \
    --pp 8,32,128,512,4096 --pp-reps 2 --tg-depths 0,4096 --tg-reps 3 --concurrency none --max-minutes 5.2 \
    --out "$O/w1-12g" > "$O/w1-12g.log" 2>&1
  log "W1 8 GiB: plan / fit ($(left) s left)"
  timeout 100 python3 -m orchestrator bench "$H200" --set "model.path=$Q30" --progress plain --vram-budget 8GiB \
    --configs plan,fit --rounds 1 --pp 32,512,4096 --pp-reps 1 --tg-depths 0 --tg-reps 2 --concurrency none \
    --max-minutes 1.5 --out "$O/w1-8g" > "$O/w1-8g.log" 2>&1
  log "W1 16 GiB: plan / fit ($(left) s left)"
  timeout $(( $(left) - 3 )) python3 -m orchestrator bench "$H200" --set "model.path=$Q30" --progress plain \
    --vram-budget 16GiB --configs plan,fit --rounds 1 --pp 32,512,4096 --pp-reps 1 --tg-depths 0 --tg-reps 2 \
    --concurrency none --max-minutes 1.5 --out "$O/w1-16g" > "$O/w1-16g.log" 2>&1
  log "done"
  ;;
e)
  DEADLINE=$(( t0 + 480 ))
  SERVER=$(ls "$ORCHESTRATOR_CACHE"/llama.cpp/mainline-cuda-*/bin/llama-server 2>/dev/null | head -1)
  [ -n "$SERVER" ] || { echo "no CUDA build on this machine (run phase c first)"; exit 1; }
  [ -f "$Q30" ] || { echo "no W1 model on this machine"; exit 1; }
  log "up / status / down on the GPU (bytecode compiled)"
  timeout 150 bash scripts/device/up-proof.sh "$H200" "$Q30" "$O/up" > "$O/up-proof.log" 2>&1
  log "gateway overhead, 16 streams, whole model on the GPU ($(left) s left)"
  timeout 150 python3 scripts/bench/gateway_overhead.py --mode ray --rounds 12 --model "$Q30" --binary "$SERVER" \
    --ngl 99 --threads 8 --json > "$O/gateway.txt" 2>&1
  log "W1 12 GiB sweep around the plan, 3 tg samples per start ($(left) s left)"
  mins=$(python3 -c "print(max(0.3, ($(left) - 15) / 60))")
  timeout $(( $(left) - 3 )) python3 -m orchestrator bench "$H200" --set "model.path=$Q30" --progress plain \
    --vram-budget 12GiB --configs plan,ncmoe-sweep --ncmoe 18,19,20 --ub 512,1024 --load-modes pinned --rounds 1 \
    --pp 32,512,4096 --pp-reps 1 --tg-depths 0 --tg-reps 3 --concurrency none --max-minutes "$mins" \
    --out "$O/w1-12g-sweep" > "$O/w1-12g-sweep.log" 2>&1
  log "done"
  ;;
f)
  # one command on a fresh machine: build, then `up` (head started while planning, gateway processes),
  # gateway overhead with 1 and with auto (4) gateway processes, and plan vs --fit generation, 5 rounds
  DEADLINE=$(( t0 + 555 ))
  log "build (background), bytecode (background), W1 model"
  start_build
  synth q30
  python3 -c "import uvloop; print('uvloop', uvloop.__version__)" > "$O/uvloop.txt" 2>&1
  finish_build
  log "up / status / down on the GPU ($(left) s left)"
  timeout 120 bash scripts/device/up-proof.sh "$H200" "$Q30" "$O/up" > "$O/up-proof.log" 2>&1
  gateway_4_and_1 75 10
  log "W1 12 GiB: plan / --fit generation, 5 rounds ($(left) s left)"
  mins=$(python3 -c "print(max(0.3, ($(left) - 12) / 60))")
  timeout $(( $(left) - 3 )) python3 -m orchestrator bench "$H200" --set "model.path=$Q30" --progress plain \
    --vram-budget 12GiB --configs plan,fit --rounds 5 --pp 512 --pp-reps 1 --tg-depths 0 --tg-reps 3 \
    --concurrency none --max-minutes "$mins" --out "$O/w1-12g-tg" > "$O/w1-12g-tg.log" 2>&1
  log "done"
  ;;
g)
  # nvidia-h200-x2, one command on a fresh machine: build, the machine recorded (inspect, probe), the 235B
  # shape on two GPUs held to 12 GiB each: the plan (-sm tensor) vs -sm layer (the planner's own, balanced
  # -ot ranges) vs --fit; then `up` and the gateway overhead there
  DEADLINE=$(( t0 + 555 ))
  log "build (background), bytecode (background), models"
  start_build
  synth q235
  synth q30
  { nvidia-smi; nvidia-smi topo -m; numactl -H; nproc; free -g; } > "$O/machine.txt" 2>&1
  finish_build
  log "inspect, probe"
  orch inspect --json --save "$O/h200x2.tar.gz" > "$O/inspect.json" 2>"$O/inspect.err"; orch inspect > "$O/inspect.txt" 2>&1
  timeout 90 python3 -m orchestrator probe --refresh --json > "$O/probe.json" 2>"$O/probe.err"; orch probe > "$O/probe.txt" 2>&1
  orch plan "$H200" --set "model.path=$Q235" --json > "$O/plan-x2.json" 2>&1
  orch plan "$H200" --set "model.path=$Q235" > "$O/plan-x2.txt" 2>&1
  orch plan "$H200" --set "model.path=$Q235" --set workers.split_mode=layer --json > "$O/plan-x2-layer.json" 2>&1
  LAYER=$(python3 scripts/device/plan-config.py sm-layer "$O/plan-x2-layer.json")
  echo "$LAYER" > "$O/layer-config.txt"
  log "W2 on 2 GPUs x 12 GiB: plan / -sm layer / --fit ($(left) s left)"
  timeout 240 python3 -m orchestrator bench "$H200" --set "model.path=$Q235" --progress plain --vram-budget 12GiB \
    --configs plan,fit --config "$LAYER" --rounds 1 --pp 32,512,4096 --pp-reps 1 --tg-depths 0,4096 --tg-reps 2 \
    --concurrency none --max-minutes 3.8 --out "$O/w2-2x12g" > "$O/w2-2x12g.log" 2>&1
  log "up / status / down on two GPUs ($(left) s left)"
  [ "$(left)" -gt 90 ] && timeout 110 bash scripts/device/up-proof.sh "$H200" "$Q30" "$O/up" > "$O/up-proof.log" 2>&1
  log "gateway overhead, 4 gateway processes ($(left) s left)"
  [ "$(left)" -gt 50 ] && timeout $(( $(left) - 3 )) python3 scripts/bench/gateway_overhead.py --mode ray --rounds 8 \
    --model "$Q30" --binary "$SERVER" --ngl 99 --threads 8 --gateway-processes 4 --json > "$O/gateway-4.txt" 2>&1
  log "done"
  ;;
h)
  # nvidia-h200-x2 again, after the planner's split-mode rule: the corrected plan (-sm layer when experts
  # overflow) against --fit with 2 rounds on the 235B shape (2 x 12 GiB), and W1 on two GPUs held to 6 GiB each
  DEADLINE=$(( t0 + 555 ))
  log "build (background), bytecode (background), models"
  start_build
  synth q235
  synth q30
  finish_build
  orch plan "$H200" --set "model.path=$Q235" > "$O/plan-w2.txt" 2>&1
  log "W2 on 2 GPUs x 12 GiB: plan / --fit, 2 rounds ($(left) s left)"
  timeout 260 python3 -m orchestrator bench "$H200" --set "model.path=$Q235" --progress plain --vram-budget 12GiB \
    --configs plan,fit --rounds 2 --pp 32,512,4096 --pp-reps 1 --tg-depths 0,4096 --tg-reps 2 \
    --concurrency none --max-minutes 4.2 --out "$O/w2-2x12g" > "$O/w2-2x12g.log" 2>&1
  w1_2x6g
  log "done"
  ;;
i)
  DEADLINE=$(( t0 + 545 ))
  { nvidia-smi; nvidia-smi topo -m; numactl -H; nproc; free -g; df -h /root; } > "$O/machine.txt" 2>&1
  log "builds (background: mainline and ik_llama.cpp, 16 jobs each), bytecode, models"
  start_build
  ( time orch build "${ik_args[@]}" ) > "$O/build-ik.log" 2>&1 &
  IKB=$!
  synth q30
  synth q235
  wait $BUILD; rc=$?; log "mainline build rc=$rc"; tail -3 "$O/build.log"
  [ $rc -eq 0 ] || exit 1
  SERVER=$(orch build "${build_args[@]}" 2>/dev/null)
  log "up / status / down, W1 12 GiB on GPU 0 ($(left) s left)"
  timeout 120 bash scripts/device/up-proof.sh "$H200" "$Q30" "$O/up" --set "nodes.0.gpus=[0]" > "$O/up-proof.log" 2>&1
  gateway_4_and_1 70 8
  log "waiting for the ik_llama.cpp build ($(left) s left; left running if it is not done)"
  while kill -0 $IKB 2>/dev/null && [ "$(left)" -gt 5 ]; do sleep 2; done
  kill -0 $IKB 2>/dev/null && log "ik build still running" || { wait $IKB; log "ik build rc=$?"; }
  tail -3 "$O/build-ik.log"
  log "done"
  ;;
j)
  DEADLINE=$(( t0 + 560 ))
  SERVER=$(orch build "${build_args[@]}" 2>/dev/null) || { echo "no CUDA build on this machine"; exit 1; }
  log "W1 12 GiB on GPU 0: plan / --fit / -t 8, 16, 24, 3 rounds"
  timeout 250 python3 -m orchestrator bench "$H200" --set "model.path=$Q30" --set "nodes.0.gpus=[0]" --gpus 0 \
    --progress plain --vram-budget 12GiB --configs plan,fit,threads-sweep --threads 8,16,24 --rounds 3 --pp 512 \
    --pp-reps 1 --tg-depths 0 --tg-reps 3 --concurrency none --max-minutes 4.0 --out "$O/w1-12g-threads" \
    > "$O/w1-12g-threads.log" 2>&1
  orch plan "$H200" --set "model.path=$Q235" --set nodes.0.vram_limit=12GiB > "$O/plan-w2.txt" 2>&1
  log "W2 on 2 GPUs x 12 GiB: plan / --fit ($(left) s left)"
  mins=$(python3 -c "print(max(0.3, ($(left) - 12) / 60))")
  timeout $(( $(left) - 3 )) python3 -m orchestrator bench "$H200" --set "model.path=$Q235" --progress plain \
    --vram-budget 12GiB --configs plan,fit --rounds 2 --pp 32,512,4096 --pp-reps 1 --tg-depths 0,4096 --tg-reps 2 \
    --concurrency none --max-minutes "$mins" --out "$O/w2-2x12g" > "$O/w2-2x12g.log" 2>&1
  log "done"
  ;;
k)
  DEADLINE=$(( t0 + ${2:-560} ))
  SERVER=$(orch build "${build_args[@]}" 2>/dev/null) || { echo "no CUDA build on this machine"; exit 1; }
  while pgrep -f "[f]lavor ik_llama.cpp" > /dev/null && [ "$(left)" -gt 300 ]; do sleep 2; done   # phase i's build
  IK=$(ls "$ORCHESTRATOR_CACHE"/llama.cpp/ik_llama.cpp-cuda-*/bin/llama-server 2>/dev/null | head -1)
  log "ik_llama.cpp server: ${IK:-none} ($(left) s left)"
  if [ -n "$IK" ]; then
    w2_ik_vs_mainline 130
  else
    log "no ik_llama.cpp CUDA build"
  fi
  w1_2x6g
  log "done"
  ;;
l)
  DEADLINE=$(( t0 + 560 ))
  log "ik_llama.cpp CUDA build alone, 32 jobs (resumed if a previous command was cut); models beside it"
  ( time timeout $(( DEADLINE - $(date +%s) - 10 )) python3 -m orchestrator build --flavor ik_llama.cpp \
      --source .devbundle/ik-src.tar.xz --cuda --cuda-arch 90 --native -j 32 ) > "$O/build-ik.log" 2>&1 &
  IKB=$!
  synth q235
  synth q30
  wait $IKB; log "ik build rc=$? (124: cut by the time limit; the next phase resumes it)"; tail -3 "$O/build-ik.log"
  log "done"
  ;;
m)
  DEADLINE=$(( t0 + 570 ))
  mainline_args=(--source .devbundle/llama-src.tar.xz --cuda --cuda-arch 90 --native -j 32)
  log "ik build (resumed or cached), then mainline (32 jobs), one after the other"
  ( time timeout 300 python3 -m orchestrator build --flavor ik_llama.cpp --source .devbundle/ik-src.tar.xz --cuda \
      --cuda-arch 90 --native -j 32 ) > "$O/build-ik.log" 2>&1
  log "ik rc=$?"; tail -2 "$O/build-ik.log"
  ( time orch build "${mainline_args[@]}" ) > "$O/build.log" 2>&1; log "mainline rc=$?"; tail -2 "$O/build.log"
  SERVER=$(orch build "${mainline_args[@]}" 2>/dev/null)
  IK=$(ls "$ORCHESTRATOR_CACHE"/llama.cpp/ik_llama.cpp-cuda-*/bin/llama-server 2>/dev/null | head -1)
  if [ -n "$IK" ] && [ "$(left)" -gt 200 ]; then
    w2_ik_vs_mainline 100
  fi
  orch plan "$H200" --set "model.path=$Q30" --set nodes.0.vram_limit=24GiB --set "backend.binary=$SERVER" \
    --set workers.split_mode=layer --json > "$O/plan-w1-layer.json" 2>&1
  LAYER=$(python3 scripts/device/plan-config.py sm-layer "$O/plan-w1-layer.json")
  log "W1 on 2 GPUs x 24 GiB (fits): plan (-sm tensor) / -sm layer / --fit ($(left) s left)"
  mins=$(python3 -c "print(max(0.3, ($(left) - 12) / 60))")
  timeout $(( $(left) - 3 )) python3 -m orchestrator bench "$H200" --set "model.path=$Q30" --set "backend.binary=$SERVER" \
    --progress plain --vram-budget 24GiB --configs plan,fit --config "$LAYER" --rounds 1 --pp 32,512,4096 \
    --pp-reps 1 --tg-depths 0,4096 --tg-reps 2 --concurrency none --max-minutes "$mins" --out "$O/w1-2x24g" \
    > "$O/w1-2x24g.log" 2>&1
  log "done"
  ;;
n)
  DEADLINE=$(( t0 + 570 ))
  log "build (background), bytecode (background), W1 model"
  start_build
  synth q30
  finish_build
  log "up / status / down on the GPU ($(left) s left)"
  timeout 130 bash scripts/device/up-proof.sh "$H200" "$Q30" "$O/up" > "$O/up-proof.log" 2>&1
  log "gateway overhead ($(left) s left)"
  if [ "$(left)" -gt 170 ]; then gateway_4_and_1 $(( ($(left) - 20) / 2 )) 10
  else timeout $(( $(left) - 10 )) python3 scripts/bench/gateway_overhead.py --mode ray --rounds 10 --model "$Q30" \
    --binary "$SERVER" --ngl 99 --threads 8 --json > "$O/gateway-auto.txt" 2>&1; fi
  log "done"
  ;;
o)
  DEADLINE=$(( t0 + 575 ))
  SERVER=$(orch build "${build_args[@]}" 2>/dev/null) || { echo "no CUDA build on this machine"; exit 1; }
  orch plan "$H200" --set "model.path=$Q30" --set nodes.0.vram_limit=12GiB --json > "$O/plan-w1-12g.json" 2>&1
  V=()
  for v in "no-host:--no-host" "cpu-strict:--cpu-strict 1" "prio2:--prio 2" "poll100:--poll 100"; do
    V+=(--config "$(python3 scripts/device/plan-config.py "plan-${v%%:*}" "$O/plan-w1-12g.json" --add="${v#*:}")")
  done
  log "W1 12 GiB: plan / --fit / plan with --no-host, --cpu-strict 1, --prio 2, --poll 100; 3 rounds"
  mins=$(python3 -c "print(max(0.3, ($(left) - 12) / 60))")
  timeout $(( $(left) - 3 )) python3 -m orchestrator bench "$H200" --set "model.path=$Q30" --progress plain \
    --vram-budget 12GiB --configs plan,fit "${V[@]}" --rounds 3 --pp 512 --pp-reps 1 --tg-depths 0 --tg-reps 3 \
    --concurrency none --max-minutes "$mins" --out "$O/w1-12g-cpu" > "$O/w1-12g-cpu.log" 2>&1
  log "done"
  ;;
p)
  for b in 8 12; do
    timeout 270 python3 -m orchestrator bench "$H200" --set "model.path=$Q30" --progress plain --vram-budget ${b}GiB \
      --configs plan,fit,control --rounds 3 --pp 512 --pp-reps 1 --tg-depths 0 --tg-reps 3 --concurrency none \
      --max-minutes 4.2 --out "$O/w1-${b}g-tg" > "$O/w1-${b}g-tg.log" 2>&1
  done
  ;;
q)
  orch plan "$H200" --set "model.path=$Q30" --set nodes.0.vram_limit=8GiB --json > "$O/plan-w1-8g.json"
  A=$(python3 scripts/device/plan-config.py plan-mmap "$O/plan-w1-8g.json" --add="--load-mode mmap")
  B=$(python3 scripts/device/plan-config.py plan-no-host "$O/plan-w1-8g.json" --add="--no-host")
  timeout 400 python3 -m orchestrator bench "$H200" --set "model.path=$Q30" --progress plain --vram-budget 8GiB \
    --configs plan,fit --config "$A" --config "$B" --rounds 3 --pp 512 --pp-reps 1 --tg-depths 0 --tg-reps 3 \
    --concurrency none --max-minutes 6 --out "$O/w1-8g-mem" > "$O/w1-8g-mem.log" 2>&1
  ;;
r)
  GIB=${2:-8}
  DEADLINE=$(( t0 + ${R_SECONDS:-560} ))
  O=$O/${GIB}g; mkdir -p "$O"
  orch plan "$H200" --set "model.path=$Q30" --set nodes.0.vram_limit=${GIB}GiB --json > "$O/plan-w1.json"
  n=$(python3 -c "import json,re,sys; a=json.load(open(sys.argv[1]))['workers'][0]['args']; \
print(len(re.search(r'\(([\d|]+)\)', a[a.index('-ot') + 1]).group(1).split('|')))" "$O/plan-w1.json")
  back=$(python3 -c "import sys; n=int(sys.argv[1]); print('|'.join(str(i) for i in range(48 - n, 48)))" "$n")
  A=$(python3 scripts/device/plan-config.py plan-ub512 "$O/plan-w1.json" --replace=-ub=512)
  B=$(python3 scripts/device/plan-config.py plan-back "$O/plan-w1.json" \
      --replace="-ot=blk\.($back)\.ffn_(up|down|gate|gate_up)_(ch|)exps=CPU")
  log "W1 $GIB GiB: plan / --fit / plan -ub 512 / plan with its $n CPU layers at the back, 4 rounds"
  mins=$(python3 -c "print(max(0.3, ($(left) - 12) / 60))")
  timeout $(( $(left) - 3 )) python3 -m orchestrator bench "$H200" --set "model.path=$Q30" --progress plain \
    --vram-budget ${GIB}GiB --configs plan,fit --config "$A" --config "$B" --rounds 4 --pp 512 --pp-reps 1 --tg-depths 0 \
    --tg-reps 3 --concurrency none --max-minutes "$mins" --out "$O/w1-${GIB}g-why" > "$O/w1-${GIB}g-why.log" 2>&1
  log "done"
  ;;
s)
  DEADLINE=$(( t0 + 575 ))
  log "build (background), bytecode (background), W1 model"
  start_build
  synth q30
  finish_build
  log "up / status / down on the GPU, early start on ($(left) s left)"
  timeout 130 bash scripts/device/up-proof.sh "$H200" "$Q30" "$O/up" > "$O/up-proof.log" 2>&1
  for n in 1 4; do
    [ "$(left)" -gt 100 ] || break
    log "gateway overhead, $n gateway process(es) ($(left) s left)"
    timeout $(( $(left) - 8 )) python3 scripts/bench/gateway_overhead.py --mode ray --rounds 10 --model "$Q30" \
      --binary "$SERVER" --ngl 99 --threads 8 --gateway-processes $n --json > "$O/gateway-$n.txt" 2>&1
  done
  log "done"
  ;;
*) echo "unknown phase $PHASE" >&2; exit 2 ;;
esac
