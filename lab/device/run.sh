#!/usr/bin/env bash
# The benchmarks that need the GPU machines, as named steps. Every row of docs/benchmarks.md measured there names
# the step that produced it. Several steps run back to back in one device command while the machine stays up
# (build outputs and models live under /root, and survive to the next command only while the machine is held):
#
#   bash lab/device/run.sh STEP[=ARG] [STEP[=ARG] ...]          e.g.  run.sh build up-proof gateway=1
#   bash lab/device/run.sh help                                  this text
#
# W1 is Qwen3-30B-A3B q4_0 (16.1 GiB), W2 the Qwen3-235B-A22B shape cut to 24 layers (32.1 GiB), both written by
# `orchestrator synth-model` when a step first needs them. topologies/h200.yaml describes both GPU machines.
#
# One H200 (nvidia-h200):
#   build             the CUDA build through `orchestrator build` (16 jobs) beside the synthesis of BUILD_MODELS
#                     (default q30: W1; loc-L, w2-loc-L: W1, W2 at routing locality L), and the bytecode of the
#                     bundle compiled as pip would; ends the command if the build fails
#   machine           nvidia-smi, numactl -H, lscpu; `orchestrator inspect --save`, `probe --refresh`, doctor,
#                     and W1's plans at 8, 12 and 16 GiB (on the x2 too: the recorded h200x2 machine)
#   llama-bench       llama-bench with W1 whole on the GPU (-ngl 99 -fa 1 -p 512 -n 128 -r 3)
#   layer-costs[=LIST]  each family's cost per layer all on the GPU: llama-bench (-ngl 99 -fa 1 -p 512,4096 -n 128) on two
#                     cuts of one shape at full width, interleaved over LAYER_COSTS_ROUNDS rounds (default 3), one
#                     family on disk at a time; LIST of gpt-oss (gpt-oss-20b at 12 and 24 layers, MXFP4 experts, and
#                     the 24 with Q4_0 experts), qwen3 (Qwen3-30B-A3B q4_0 at 24 and 48; W1 if there), deepseek
#                     (DeepSeek-V3 q4_0 at 4 and 6), glm (GLM-4.5-Air q4_0 at 8 and 16), gpt-oss-120b (6 and 12)
#                     (default all, in that order; what does not fit the time left is skipped); the deeper cut of
#                     gpt-oss and qwen3 also with GGML_CUDA_DISABLE_GRAPHS=1. lab/bench/layer_costs.py report OUT_DIR
#                     gives the slopes against the plan's. LAYER_COSTS_BENCH (a llama-bench), LAYER_COSTS_NGL,
#                     LAYER_COSTS_SCALE, LAYER_COSTS_TESTS (default "-p 512,4096 -n 128"), LAYER_COSTS_REPS (default 3),
#                     LAYER_COSTS_ARGS run it elsewhere, e.g. on a CPU build with --scale 0.1 cuts
#   probe-vs-torch    lab.bench_probe: our pinned PCIe copies against torch's, same run
#   calib-gpu         the memory model's 8 mixed CPU/GPU calibration cases (lab.calibrate gpu), then the report
#   live-routing[=L]  W1 written at routing locality L (default: default) and its profile measured, then `up` at
#                     12 GiB for 4 streams with workers.live_routing on: requests one at a time, then four at once,
#                     the live hit rate of each against the plan's, `status`, `down`, and the plan again from the
#                     served routing (lab/device/live-routing.sh)
#   up-proof          `orchestrator up` on the GPU, W1 at 12 GiB: ready time against llama-server's own load,
#                     completions through the gateway, metrics, kill -9 of llama-server, down (lab/device/up-proof.sh)
#   gateway[=N]       gateway overhead, W1 all on the GPU, 16 streams, N gateway processes (default 1);
#                     GATEWAY_ROUNDS rounds (default 10)
#   w1-budgets        W1 at 12 GiB: plan / --fit / the plan again (A/A) / --n-cpu-moe 18, 2 rounds; then at 8 and
#                     16 GiB: plan / --fit
#   w1-why[=GIB]      W1 under GIB (default 8): plan / --fit / the plan at -ub 512 / the plan with its CPU expert
#                     layers at the back (where --fit puts them), 4 rounds, 3 generation samples per start
#   w1-sweep          W1 at 12 GiB: the plan against --n-cpu-moe 18..20 x -ub 512,1024 (3 tg samples per start)
#   w1-offload        W1 at 12 GiB: the plan against --n-cpu-moe x -ub and op-offload never / from 256 tokens
#   w1-cpu-flags      W1 at 12 GiB: plan / --fit / the plan with --no-host, --cpu-strict 1, --prio 2, --poll 100
#   w1-load-modes     W1 at 8 GiB: plan / --fit / the plan memory-mapped / the plan with --no-host
#   w2                W2 under 24 GiB: plan / --fit
#   gpu-tests         the GPU tests of the expert cache and of the router trace (pytest -m gpu
#                     tests/backend/test_expert_cache_gpu.py tests/backend/test_router_trace_gpu.py; GPU_TESTS_K
#                     narrows them, as pytest -k), with
#                     what they print (tokens alike, largest probability difference, counters)
#   routing[=L]       W1 written at routing locality L (0 | default | high; default: default) and its routing profile
#                     measured (`orchestrator model --routing --gpu-layers 99`), as w1-cache begins
#   w1-cache[=L]      W1 written at routing locality L (0 | default | high; default: default), its routing profile
#                     measured (`orchestrator model --routing`), then the plan's own choice of expert layers and
#                     cache at 12, 8 and 16 GiB (as far as RUN_SECONDS allows): plan / fit-pinned / cache-grid
#                     (whose +0 point is the plan's placement without its cache) / the plan with
#                     --moe-cache-cpu-misses / the plan again (A/A, 12 GiB); W1_CACHE_BUDGETS (GiB, default
#                     "12 8 16") and W1_CACHE_CONFIGS (default: all of them) narrow it
#   w2-cache[=L]      the same for W2 written at routing locality L, at W2_CACHE_BUDGETS (default 24 GiB; A/A at
#                     the first), W2_CACHE_CONFIGS; both take CACHE_ROUNDS (default 1) interleaved rounds
#   workload[=L]      the expert cache for the whole workload, W1 written at routing locality L (default: default)
#                     and its profile measured: at each of WORKLOAD_BUDGETS (GiB, default "12 8 16"; empty:
#                     none) the plan / the plan with --moe-cache-prefill off (prompts copy every expert) / fit-pinned (/ the plan
#                     again, A/A, at the first), pp512, pp4096, tg128 and the cache's prefill counters; then at
#                     WORKLOAD_STREAMS_BUDGET (default 12; 0: none) the plan for 4 streams (model.parallel=4)
#                     against fit-pinned with -np 4: aggregate generation of 1, 2 and 4 streams; then W2 (locality
#                     L) at 24 GiB: plan / plan with prefill off / fit-pinned, unless WORKLOAD_W2=0;
#                     WORKLOAD_VARIANT=slots-host makes the one-stream plans' variant the plan with its slots
#                     assigned on the host (--moe-cache-slots host) in place of prefill off; =moves: the plan with
#                     a prompt's experts copied one by one (LLAMA_MOE_CACHE_PREFILL_MOVES=0) and with the host's read
#                     by the device (=2); =moves3: the plan with the host's experts copied in one batch (=3)
#                     (moves and moves3 need a bundle of the lab's patch set: see the lab set below);
#                     =ahead: the plan with its prompts' uncached experts copied ahead into 2 and 3 staging
#                     buffers (LLAMA_MOE_CACHE_PREFILL_AHEAD); WORKLOAD_STREAMS_NO_VARIANT= (empty) runs the
#                     variant at four streams too;
#                     =unstaged: the plan without its prompt staging (--moe-cache-prefill-ahead 0), or where the
#                     plan does not stage, the same plan with it (--moe-cache-prefill-ahead 2);
#                     =min-batch: where the plan stages from a smallest micro-batch, the same plan staging every
#                     micro-batch (--moe-cache-prefill-ahead-min-batch 0) and staging none;
#                     =balanced: the plan made with workers.objective=balanced; =none: no
#                     variant
#   prefetch[=L]      uploads ahead of need, W1 written at routing locality L (default: default) and its profile
#                     measured: at each of PREFETCH_BUDGETS (GiB, default "12 8") the plan for 4 streams
#                     (model.parallel=4) / the same with --moe-cache-prefetch on / fit-pinned with -np 4 (/ the plan
#                     again, A/A, at the first budget of one round), interleaved over PREFETCH_ROUNDS (default 1):
#                     pp512, generation of 1 and 4 streams, and the cache's prefetch counters (accuracy,
#                     uploads ahead, used);
#                     PREFETCH_VARIANTS=1 adds the copy stream not waiting for the layer's own misses, and that
#                     issued at a layer's first expert tensor. Needs a bundle of the lab's patch set (below)
#   gpu-tests-families  the GPU tests of the expert cache on a DeepSeek-V3 and a gpt-oss-120b shape (slots assigned
#                     on the device and on the host, staged prompts; tests/backend/test_expert_cache_families_gpu.py)
#   families[=LIST]   the workload harness for the other families, LIST of w3,w4,w5 (default all), one model on disk
#                     at a time, each written at routing locality default and its profile measured: W3 DeepSeek-V3
#                     cut to 6 layers (3 dense, 3 MoE; q4_0, 20.2 GiB) under W3_BUDGET GiB (default 12), W4
#                     gpt-oss-120b cut to 12 layers (MXFP4 experts, q8_0 around them as llama-quantize's MXFP4_MOE;
#                     20.4 GiB) under W4_BUDGET (default 10), W5 GLM-4.5-Air cut to 16 layers (1 dense, 15 MoE; q4_0,
#                     19.4 GiB) under W5_BUDGET (default 10): the plan / fit-pinned / the plan again (A/A): pp512,
#                     pp4096, tg128, the cache's counters; then the plan for 4 streams (model.parallel=4) against
#                     fit-pinned with -np 4: aggregate generation of 1 and 4 streams (FAMILIES_STREAMS=0: none);
#                     FAMILIES_BIASES=1 adds to W4's bench the plan with the experts' biases placed the other way
#                     (bench/bias_variant.py: with a cache, in host memory as --cpu-moe puts them);
#                     FAMILIES_EXTRA=1 (every family; or a LIST of them, as w3,w4) adds what decides the open
#                     prediction misses: the plan's graph splits (lab/bench/expert_bias_splits.py; for W4 those of
#                     that variant too), the hit rate by
#                     position in the context (bench/routing_by_position.py), and the plan with the whole model on
#                     the GPU (60 GiB)
#   device-slots[=L]  the host's round trip per cached layer, W1 written at routing locality L (default: default) and
#                     its profile measured: at DEVICE_SLOTS_BUDGET GiB (default 12) the plan for 4 streams
#                     (model.parallel=4) / the same with its slots assigned on the device
#                     (--moe-cache-slots device) / the same waiting for the device before each cached split as
#                     before (LLAMA_MOE_CACHE_SPLIT_WAIT=1) / fit-pinned with -np 4 / the plan again (A/A),
#                     interleaved over DEVICE_SLOTS_ROUNDS (default 1): pp512, generation of 1 and 4 streams, counters;
#                     the old wait only with DEVICE_SLOTS_WAIT=1 and a bundle of the lab's patch set (below)
#
# The lab's patch set (lab/llama.cpp-patches: uploads ahead of need, LLAMA_MOE_CACHE_SPLIT_WAIT, _PREFETCH_*,
# _PREFILL_MOVES; see native/llama.cpp-patches/README.md) goes into the bundle instead of the product series with
#   python -m lab.llama_series checkout --lab /tmp/llama-lab
#   python -m orchestrator build --source /tmp/llama-lab --export-source .devbundle/llama-src.tar.xz
#
# Two H200s (nvidia-h200-x2):
#   w1-threads        W1 at 12 GiB on GPU 0 alone: plan / --fit / generation threads 8, 16, 24, 3 rounds
#   w2-x2             W2 at 12 GiB per GPU: plan / --fit, 2 rounds
#   w2-x2-split       W2 at 12 GiB per GPU: plan / -sm layer with the planner's ranges / --fit
#   w1-x2             W1 at 6 GiB per GPU: plan / --fit
#   build-ik          the ik_llama.cpp CUDA build alone (32 jobs; resumes a build cut by the time limit)
#   w2-x2-ik          W2 at 12 GiB per GPU: ik_llama.cpp's plan (-sm graph) / ik -sm layer / mainline's plan
#   w2-x2-cache[=L]   W2 written at routing locality L (default: default), its profile measured, at W2_X2_BUDGET GiB
#                     per GPU (default 12): the plan (-sm layer, the cache split over both GPUs) / fit-pinned / the
#                     plan's -sm layer ranges without the cache / -sm tensor as the planner places it, each as far as
#                     `plan` accepts it (what it refuses is logged); CACHE_ROUNDS rounds. -sm graph is w2-x2-ik's
#                     (after build-ik). What the RPC tests (tests/multigpu) already proved is in docs/multi-gpu.md
#
# Without a CUDA build (a CPU llama-server carried xz-compressed in .devcpu/:
#   mkdir -p .devcpu && xz -c ~/.cache/orchestrator/llama.cpp/mainline-cpu-*/bin/llama-server > .devcpu/llama-server.xz):
#   cpu-up            `up` proof twice with the demo model, then gateway overhead with 1 and 4 gateway processes
#   cpu-early         `up` to ready with and without workers.early_start, W1's shape at 12 layers, --no-mmap
#   sampler-cost[=T]  what llama-server's sampler settings add per token at Qwen3's vocabulary, on this machine's
#                     CPU with T threads (default 16): lab/bench/sampler_cost.py
#   gateway-cpu[=OLD]  gateway overhead against the small generated llama: ray mode twice; stand-in upstream
#                     twice, interleaved with another gateway.py given as OLD (a path in the working tree)
#
# Needs .devbundle/ carried along (`../shared/device/make-bundle.sh .devbundle rich markdown-it-py mdurl pygments`:
# the machine's python3 lacks rich, which the tables need; plus `orchestrator build --export-source
# .devbundle/llama-src.tar.xz`, and ik-src.tar.xz for the ik steps). Each step writes under /root/work/out/STEP
# (DEVICE_WORK moves /root/work elsewhere); all of them are packed into $OUT/device.tgz at the end. RUN_SECONDS
# (default 570) bounds the whole command: the benchmark steps size their --max-minutes to what is left.
set -uo pipefail
cd "$(dirname "$0")/../.."

usage() { sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }
STEPS=(build gpu-tests gpu-tests-families families routing live-routing machine llama-bench layer-costs probe-vs-torch calib-gpu up-proof gateway w1-budgets w1-why w1-sweep w1-offload
       w1-cpu-flags w1-load-modes w2 w1-cache w2-cache workload prefetch device-slots w1-threads w2-x2 w2-x2-split w1-x2 build-ik w2-x2-ik
       w2-x2-cache cpu-up cpu-early
       gateway-cpu sampler-cost)
known() { local s; for s in "${STEPS[@]}"; do [ "$s" = "$1" ] && return 0; done; return 1; }

[ $# -gt 0 ] || { usage >&2; exit 2; }
[ "$1" = help ] && { usage; exit 0; }
for a in "$@"; do known "${a%%=*}" || { echo "run.sh: unknown step '${a%%=*}' (run.sh help lists them)" >&2; exit 2; }; done

W=${DEVICE_WORK:-/root/work}   # elsewhere: a scratch directory (the layer-costs step on a CPU build)
M=$W/models
t0=$(date +%s)
DEADLINE=$(( t0 + ${RUN_SECONDS:-570} ))
mkdir -p "$M" "$W/out"
source .devbundle/on-device.sh .devbundle >/dev/null
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export ORCHESTRATOR_CACHE=/root/.cache/orchestrator
# which host measured: the GPU's UUID tells two machines of the same kind apart when runs of different days meet
{ nvidia-smi -L; lscpu | grep -E '^Model name|^CPU\(s\)'; cat /etc/machine-id; } > "$W/out/host.txt" 2>&1
finish() { tar czf "${OUT:-/tmp}/device.tgz" -C "$W/out" . 2>/dev/null; }
trap finish EXIT
log() { echo "[$(( $(date +%s) - t0 ))s] $*"; }
left() { echo $(( DEADLINE - $(date +%s) )); }      # seconds left in this command
mins() { python3 -c "print(max(0.3, ($(left) - ${1:-12}) / 60))"; }   # --max-minutes that leaves $1 s
orch() { python3 -m orchestrator "$@"; }
build_args=(--source .devbundle/llama-src.tar.xz --cuda --cuda-arch 90 --native -j 16)
Q30=$M/qwen3-30b-a3b-q4_0.gguf
Q235=$M/qwen3-235b-a22b-24l-q4_0.gguf
H200=topologies/h200.yaml
BENCH=(python3 -m orchestrator bench "$H200" --progress plain)   # `timeout` needs a program, not a function
SERVER=${CUDA_SERVER:-}   # a CUDA llama-server built elsewhere (series-regression.sh's new-bin) instead of `build`'s
if [ -z "$SERVER" ] && [ -n "${CUDA_PREBUILT:-}" ]; then   # cross-build.sh's, carried along: used when it runs here
  PB=$W/prebuilt/bin; mkdir -p "$PB"
  for t in llama-server llama-bench; do   # each ~42 MB: one per command fits what a command carries (64 MiB)
    [ -x "$PB/$t" ] || [ ! -f "$CUDA_PREBUILT/$t.xz" ] || { xz -dc "$CUDA_PREBUILT/$t.xz" > "$PB/$t.partial" \
      && chmod +x "$PB/$t.partial" && mv "$PB/$t.partial" "$PB/$t"; }
  done
  # cuBLAS and the CUDA runtime: the device toolkit's (the same CUDA major as the build's)
  _nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
  export LD_LIBRARY_PATH=$(dirname "$(readlink -f "$_nvcc")")/../lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  if "$PB/llama-server" --list-devices > "$W/out/prebuilt.txt" 2>&1 && grep -q "CUDA0" "$W/out/prebuilt.txt"; then
    SERVER=$PB/llama-server; cp "$CUDA_PREBUILT/build.json" "$W/out/prebuilt-build.json" 2>/dev/null
    echo "[0s] server: the cross-built $SERVER"
  else
    echo "[0s] the cross-built llama-server does not run here ($W/out/prebuilt.txt): build it"; tail -3 "$W/out/prebuilt.txt"
  fi
fi
[ -n "$SERVER" ] && export LLAMA_SERVER=$SERVER    # for plan, bench and the tests alike

synth() {   # synth q30 | q235 | loc-L | w2-loc-L (W1 or W2 at routing locality L): write the model unless there
  case "$1" in
    q30) [ -f "$Q30" ] || ( time orch synth-model "$Q30" --like qwen3-30b-a3b --quant q4_0 ) >> "$O/synth.log" 2>&1 ;;
    loc-*) [ -f "$M/w1-$1.gguf" ] || ( time orch synth-model "$M/w1-$1.gguf" --like qwen3-30b-a3b --quant q4_0 \
             --locality "${1#loc-}" ) >> "$O/synth.log" 2>&1 ;;
    w2-loc-*) [ -f "$M/$1.gguf" ] || ( time orch synth-model "$M/$1.gguf" --like qwen3-235b-a22b --layers 24 \
             --quant q4_0 --locality "${1#w2-loc-}" ) >> "$O/synth.log" 2>&1 ;;
    q235) [ -f "$Q235" ] || ( time orch synth-model "$Q235" --like qwen3-235b-a22b --layers 24 --quant q4_0 ) \
            >> "$O/synth.log" 2>&1 ;;
  esac
}
need_server() {   # SERVER = the CUDA llama-server `build` made (instant: from the cache)
  [ -n "$SERVER" ] && return 0
  SERVER=$(orch build "${build_args[@]}" 2>/dev/null) || { echo "no CUDA build on this machine: run the build step first"; exit 1; }
}
cpu_server() {   # the CPU llama-server of .devcpu/ as LLAMA_SERVER, and the bundle's bytecode compiled
  mkdir -p models /root/bin
  xz -dc .devcpu/llama-server.xz > /root/bin/llama-server && chmod +x /root/bin/llama-server
  export LLAMA_SERVER=/root/bin/llama-server
  ( time python3 -m compileall -q -j 16 /tmp/site "$PWD/orchestrator" ) > "$O/compileall.log" 2>&1; log "bytecode"
}
routing_profile() {   # routing_profile L [w1|w2]: the model at routing locality L, written unless there, and its
                      # profile measured
  local mdl=$M/${2:-w1}-loc-$1.gguf
  synth "$( [ "${2:-w1}" = w2 ] && echo "w2-loc-$1" || echo "loc-$1" )"
  # W1 and W2 fit the GPU: traced there in seconds; on the CPU (minutes) if that fails
  local out=$O/routing-${2:-w1}-$1
  ( time timeout 180 python3 -m orchestrator model "$mdl" --routing --gpu-layers 99 ) > "$out.txt" 2>&1 || \
    ( time timeout $(( $(left) - 30 )) python3 -m orchestrator model "$mdl" --routing ) >> "$out.txt" 2>&1
  log "routing profile (${2:-w1}, $1) rc=$?"; tail -6 "$out.txt"
  # the profile itself beside its summary (one per model: W2's must not overwrite W1's): the tests replan the
  # runs with the curve the plan ran with
  local saved; saved=$(grep -oE '^(saved|cached): .*\.json$' "$out.txt" | tail -1 | cut -d' ' -f2-)
  [ -n "$saved" ] && xz -c "$saved" > "$out.profile.json.xz"
  return 0
}
gateway_on_gpu() {   # gateway_on_gpu PROCESSES ROUNDS
  need_server; synth q30
  log "gateway overhead, $1 gateway process(es), $2 rounds ($(left) s left)"
  timeout $(( $(left) - 8 )) python3 lab/bench/gateway_overhead.py --mode ray --rounds "$2" --model "$Q30" \
    --binary "$SERVER" --ngl 99 --threads 8 --gateway-processes "$1" --json > "$O/gateway-$1.txt" 2>&1
}

cache_runs() {   # cache_runs w1|w2 LOCALITY "BUDGETS" CONFIGS: the plan's choice of whole expert layers and cache at
                 # each budget (GiB), beside fit-pinned, the cache grid, CPU misses and (at the first budget) A/A
  need_server
  local model=$1 loc=$2 budgets=$3 configs=$4 first=${3%% *}
  local mdl=$M/$model-loc-$loc.gguf
  routing_profile "$loc" "$model"
  local b cfg
  for b in $budgets; do
    [ "$(left)" -gt 150 ] || { log "no time left for ${b} GiB"; break; }
    orch plan "$H200" --set "model.path=$mdl" --set "nodes.0.vram_limit=${b}GiB" > "$O/plan-${b}g.txt" 2>&1
    orch plan "$H200" --set "model.path=$mdl" --set "nodes.0.vram_limit=${b}GiB" --json > "$O/plan-${b}g.json" 2>&1
    cfg=plan,fit-pinned,cache-grid; [ "$b" = "$first" ] && cfg=$cfg,control
    cfg=${configs:-$cfg}
    local V=()     # the plan's placement and cache with rarely used experts on the CPU
    [[ ,$cfg, == *,plan,* ]] && grep -q -- '--moe-cache-mib' "$O/plan-${b}g.json" && \
      V=(--config "$(python3 lab/device/plan-config.py plan-cpu-misses "$O/plan-${b}g.json" --add=--moe-cache-cpu-misses)")
    timeout $(( $(left) - 5 )) "${BENCH[@]}" --set "model.path=$mdl" --vram-budget ${b}GiB --configs "$cfg" "${V[@]}" \
      --rounds "${CACHE_ROUNDS:-1}" --pp 512,4096 --pp-reps 1 --tg-depths 0 --tg-reps 2 --concurrency 1 \
      --ttft-requests 6 --max-minutes "$(mins 10)" --out "$O/$model-${b}g" > "$O/$model-${b}g.log" 2>&1
    log "${b} GiB rc=$?"; tail -25 "$O/$model-${b}g.log"
  done
}

workload_run() {   # workload_run MODEL.gguf GIB NAME CONFIGS [bench options]: plan (and its prefill-off variant),
                   # fit-pinned, ... at one budget
  local mdl=$1 b=$2 name=$3 cfg=$4; shift 4
  orch plan "$H200" --set "model.path=$mdl" --set "nodes.0.vram_limit=${b}GiB" "${SETS[@]}" > "$O/plan-$name.txt" 2>&1
  orch plan "$H200" --set "model.path=$mdl" --set "nodes.0.vram_limit=${b}GiB" "${SETS[@]}" --json \
    > "$O/plan-$name.json" 2>&1
  local V=()
  if grep -q -- '--moe-cache-mib' "$O/plan-$name.json" && [ -z "${NO_VARIANT:-}" ]; then
    case "${WORKLOAD_VARIANT:-prefill-off}" in
      prefill-off) V=(--config "$(python3 lab/device/plan-config.py plan-prefill-off "$O/plan-$name.json" \
                                  --add='--moe-cache-prefill off')") ;;
      slots-host) grep -q -- '--moe-cache-slots' "$O/plan-$name.json" && \
        V=(--config "$(python3 lab/device/plan-config.py plan-slots-host "$O/plan-$name.json" \
                        --replace=--moe-cache-slots=host)") ;;
      moves) V=(--config "$(python3 lab/device/plan-config.py plan-moves0 "$O/plan-$name.json" \
                             --env LLAMA_MOE_CACHE_PREFILL_MOVES=0)"
                --config "$(python3 lab/device/plan-config.py plan-moves2 "$O/plan-$name.json" \
                             --env LLAMA_MOE_CACHE_PREFILL_MOVES=2)") ;;
      moves3) V=(--config "$(python3 lab/device/plan-config.py plan-moves3 "$O/plan-$name.json" \
                              --env LLAMA_MOE_CACHE_PREFILL_MOVES=3)") ;;
      ahead) V=(--config "$(python3 lab/device/plan-config.py plan-ahead2 "$O/plan-$name.json" \
                             --env LLAMA_MOE_CACHE_PREFILL_AHEAD=2)"
                --config "$(python3 lab/device/plan-config.py plan-ahead3 "$O/plan-$name.json" \
                             --env LLAMA_MOE_CACHE_PREFILL_AHEAD=3)") ;;
      unstaged)
        if grep -q -- '--moe-cache-prefill-ahead' "$O/plan-$name.json"; then
          V=(--config "$(python3 lab/device/plan-config.py plan-unstaged "$O/plan-$name.json" \
                          --replace=--moe-cache-prefill-ahead=0)")
        else
          V=(--config "$(python3 lab/device/plan-config.py plan-staged "$O/plan-$name.json" \
                          --add='--moe-cache-prefill-ahead 2')")
        fi ;;
      min-batch)   # the plan's staging from its smallest micro-batch, against staging every one and none
        if grep -q -- '--moe-cache-prefill-ahead-min-batch' "$O/plan-$name.json"; then
          V=(--config "$(python3 lab/device/plan-config.py plan-any-batch "$O/plan-$name.json" \
                          --replace=--moe-cache-prefill-ahead-min-batch=0)"
             --config "$(python3 lab/device/plan-config.py plan-unstaged "$O/plan-$name.json" \
                          --replace=--moe-cache-prefill-ahead=0)")
        fi ;;
      balanced)
        orch plan "$H200" --set "model.path=$mdl" --set "nodes.0.vram_limit=${b}GiB" "${SETS[@]}" \
          --set workers.objective=balanced > "$O/plan-$name-balanced.txt" 2>&1
        orch plan "$H200" --set "model.path=$mdl" --set "nodes.0.vram_limit=${b}GiB" "${SETS[@]}" \
          --set workers.objective=balanced --json > "$O/plan-$name-balanced.json" 2>&1
        V=(--config "$(python3 lab/device/plan-config.py plan-balanced "$O/plan-$name-balanced.json")") ;;
      biases) V=(--config "$(python3 lab/bench/bias_variant.py "$O/plan-$name.json")") ;;
    esac
  fi
  timeout $(( $(left) - 5 )) "${BENCH[@]}" --set "model.path=$mdl" "${SETS[@]}" --vram-budget ${b}GiB \
    --configs "$cfg" "${V[@]}" --rounds "${CACHE_ROUNDS:-1}" --max-minutes "$(mins 10)" --out "$O/$name" "$@" \
    > "$O/$name.log" 2>&1
  log "$name rc=$?"; tail -22 "$O/$name.log"
}

layer_cost_run() {   # layer_cost_run MODEL.gguf VARIANT ROUND [VAR=VALUE ...]: one llama-bench of MODEL in the
                     # environment given, its rows labelled with the variant and the round, added to layer-costs.jsonl
  local mdl=$1 variant=$2 round=$3; shift 3
  [ "$(left)" -gt "${LAYER_COSTS_RUN_S:-20}" ] || \
    { log "layer-costs: no time left for $(basename "$mdl") $variant"; return 1; }
  # shellcheck disable=SC2086   # the tests and extra arguments are lists of words
  env "$@" timeout $(( $(left) - 5 )) "$LC_BENCH" -m "$mdl" -ngl "${LAYER_COSTS_NGL:-99}" -fa 1 \
    ${LAYER_COSTS_TESTS:--p 512,4096 -n 128} -r "${LAYER_COSTS_REPS:-3}" ${LAYER_COSTS_ARGS:-} -o jsonl \
    > "$O/run.jsonl" 2>> "$O/llama-bench.err"
  local rc=$?
  # whole rows only (a run cut by the time limit may leave half a line)
  sed -n "/^{.*}\$/s/^{/{\"variant\": \"$variant\", \"round\": $round, /p" "$O/run.jsonl" >> "$O/layer-costs.jsonl"
  log "$(basename "$mdl") $variant round $round rc=$rc: $(python3 lab/bench/layer_costs.py brief "$O/run.jsonl")"
}

LC_FAMILIES="gpt-oss, qwen3, deepseek, glm, gpt-oss-120b"
layer_family() {   # layer_family NAME: the family's shape (LC_LIKE), depths (LC_CUTS), synth-model options (LC_QUANT),
                   # estimated seconds on the H200 (LC_EST, as the step's comment adds them up) and whether its
                   # deeper cut also runs without CUDA graphs (LC_GRAPHS)
  case "$1" in
    gpt-oss)      LC_LIKE=gpt-oss-20b   LC_CUTS="12 24" LC_QUANT=()             LC_EST=130 LC_GRAPHS=1 ;;
    qwen3)        LC_LIKE=qwen3-30b-a3b LC_CUTS="24 48" LC_QUANT=(--quant q4_0) LC_EST=108 LC_GRAPHS=1 ;;
    deepseek)     LC_LIKE=deepseek-v3   LC_CUTS="4 6"   LC_QUANT=(--quant q4_0) LC_EST=82  LC_GRAPHS= ;;
    glm)          LC_LIKE=glm-4.5-air   LC_CUTS="8 16"  LC_QUANT=(--quant q4_0) LC_EST=82  LC_GRAPHS= ;;
    gpt-oss-120b) LC_LIKE=gpt-oss-120b  LC_CUTS="6 12"  LC_QUANT=()             LC_EST=82  LC_GRAPHS= ;;
    *) return 1 ;;
  esac
}

layer_cut() {   # layer_cut FAMILY LIKE LAYERS [synth-model options]: a cut of LIKE written under $M, described in
                # models.jsonl; its path in CUT
  local f=$1 like=$2 n=$3; shift 3
  CUT=$M/lc-$like-${n}l$(printf '%s' "$*" | sed -n 's/.*--expert-quant \([a-z0-9_]*\).*/-\1x/p').gguf
  if [ "$like" = qwen3-30b-a3b ] && [ "$n" = 48 ] && [ "${LAYER_COSTS_SCALE:-1}" = 1 ] && [ -f "$Q30" ]; then
    CUT=$Q30                                   # W1 is that cut: written by the build step beside the compiler
  else
    ( time orch synth-model "$CUT" --like "$like" --layers "$n" --scale "${LAYER_COSTS_SCALE:-1}" "$@" ) \
      >> "$O/synth-$f.log" 2>&1
    local rc=$?
    log "$f: $(basename "$CUT") rc=$rc ($(du -BM "$CUT" 2>/dev/null | cut -f1))"
    [ $rc -eq 0 ] || { tail -2 "$O/synth-$f.log"; return 1; }
  fi
  python3 lab/bench/layer_costs.py describe "$CUT" >> "$O/models.jsonl"
}

step() {   # step NAME [ARG]
  local name=$1 arg=${2:-}
  O=$W/out/$name${arg:+-$arg}
  mkdir -p "$O"
  log "step $name${arg:+=$arg} ($(left) s left)"
  case "$name" in
  build)
    ( time orch build "${build_args[@]}" ) > "$O/build.log" 2>&1 &
    local b=$!
    ( time python3 -m compileall -q -j 4 /tmp/site "$PWD/orchestrator" ) > "$O/compileall.log" 2>&1 &
    local m; for m in ${BUILD_MODELS:-q30}; do synth "$m"; done
    wait $b; local rc=$?; log "build rc=$rc"; tail -3 "$O/build.log"
    [ $rc -eq 0 ] || exit 1
    wait
    need_server; log "server $SERVER"
    ;;
  machine)
    { nvidia-smi; nvidia-smi topo -m; numactl -H; lscpu; nproc; free -g; df -h /root; uname -a; } > "$O/machine.txt" 2>&1
    orch doctor > "$O/doctor.txt" 2>&1
    orch inspect --json --save "$O/machine.tar.gz" > "$O/inspect.json" 2>"$O/inspect.err"; orch inspect > "$O/inspect.txt" 2>&1
    timeout 90 python3 -m orchestrator probe --refresh --json > "$O/probe.json" 2>"$O/probe.err"
    orch probe > "$O/probe.txt" 2>&1
    synth q30
    for b in 8 12 16; do
      orch plan "$H200" --set "model.path=$Q30" --set "nodes.0.vram_limit=${b}GiB" --json > "$O/plan-q30-${b}g.json" 2>&1
    done
    ;;
  llama-bench)
    need_server; synth q30
    timeout 60 "$(dirname "$SERVER")/llama-bench" -m "$Q30" -ngl 99 -fa 1 -p 512 -n 128 -r 3 -o jsonl \
      > "$O/llama-bench.jsonl" 2>"$O/llama-bench.err"
    ;;
  layer-costs)
    # Time on the H200 (synth-model writes ~1.7 GB/s there: a 17 GB file in 8-10 s; llama-bench starts CUDA and loads a
    # model from the page cache in a few seconds; pp512 + 3 x tg128 take 1-3 s, 3 x pp4096 about 2 s more: ~70 s over
    # the step's ~36 runs, counted below), 3 rounds, in the default order:
    #   gpt-oss       gpt-oss-20b 12 + 24 layers + 24 with Q4_0 experts (6.7 + 12.1 + 12.7 GB): write ~20 s; a round
    #                 is 12, 24, 24 q4_0, 24 without CUDA graphs, ~8-10 s each: ~110 s; ~130 s in all
    #   qwen3         Qwen3-30B-A3B q4_0 24 + 48 (8.9 + 17.3 GB; the 48 is W1, none to write if the build wrote it):
    #                 write ~17 s; a round is 24, 48, 48 without graphs: ~91 s; ~108 s in all
    #   deepseek      DeepSeek-V3 q4_0 4 + 6 (8.7 + 21.7 GB): write ~19 s; rounds ~63 s; ~82 s in all
    #   glm           GLM-4.5-Air q4_0 8 + 16 (10.2 + 20.8 GB): write ~19 s; rounds ~63 s; ~82 s in all
    #   gpt-oss-120b  6 + 12 (11.6 + 21.9 GB: the 12 is W4's shape): write ~20 s; rounds ~62 s; ~82 s in all
    # ~405 s for all five without the 4096-token prompts, ~475 s with them (gpt-oss-120b, last, is the one skipped
    # when the machine is slower); the disk holds one family at a time (at most 33.5 GB; W1, when there, goes with qwen3,
    # then first). A family starts only with its estimate left (LAYER_COSTS_MIN_LEFT overrides it), a run only with
    # 20 s left.
    local f n r m cut_paths=() families
    families=$(echo "${arg:-gpt-oss,qwen3,deepseek,glm,gpt-oss-120b}" | tr ',' ' ')
    for f in $families; do layer_family "$f" || { log "layer-costs: unknown family '$f' ($LC_FAMILIES)"; return; }; done
    # W1 already on the disk is qwen3's deeper cut: its family first, so that W1 is gone before the others are written
    # (W1 beside gpt-oss's three cuts would be 49 GB)
    if [ -f "$Q30" ] && [ "${LAYER_COSTS_SCALE:-1}" = 1 ] && [[ " $families " == *" qwen3 "* ]]; then
      families="qwen3 $(echo " $families " | sed 's/ qwen3 / /')"
    fi
    if [ -n "${LAYER_COSTS_BENCH:-}" ]; then LC_BENCH=$LAYER_COSTS_BENCH
    else need_server; LC_BENCH=$(dirname "$SERVER")/llama-bench; fi
    : > "$O/layer-costs.jsonl"; : > "$O/models.jsonl"
    for f in $families; do
      layer_family "$f"
      [ "$(left)" -gt "${LAYER_COSTS_MIN_LEFT:-$LC_EST}" ] || \
        { log "layer-costs: no time left for $f (~$LC_EST s)"; continue; }
      rm -f "$M"/lc-*.gguf                       # one family on disk at a time
      cut_paths=()
      for n in $LC_CUTS; do
        layer_cut "$f" "$LC_LIKE" "$n" "${LC_QUANT[@]}" || { log "$f: skipped"; rm -f "$M"/lc-*.gguf; continue 2; }
        cut_paths+=("$CUT")
      done
      [ "$f" = gpt-oss ] && layer_cut "$f" "$LC_LIKE" "${LC_CUTS##* }" "${LC_QUANT[@]}" --expert-quant q4_0 && \
        cut_paths+=("$CUT")
      for r in $(seq 1 "${LAYER_COSTS_ROUNDS:-3}"); do   # A B (C) A B (C) ...: a slow moment falls on every cut
        for m in "${cut_paths[@]}"; do layer_cost_run "$m" default "$r" || break 2; done
        if [ -n "$LC_GRAPHS" ] && [ ${#cut_paths[@]} -ge 2 ]; then
          layer_cost_run "${cut_paths[1]}" graphs-off "$r" GGML_CUDA_DISABLE_GRAPHS=1 || break
        fi
      done
      rm -f "$M"/lc-*.gguf
      [ "${cut_paths[1]:-}" = "$Q30" ] && rm -f "$Q30"   # W1 too (17 GB): `synth q30` writes it again
    done
    rm -f "$O/run.jsonl"
    python3 lab/bench/layer_costs.py report "$O" --json > "$O/report.json" 2>&1
    python3 lab/bench/layer_costs.py report "$O" > "$O/report.txt" 2>&1; log "report rc=$?"; cat "$O/report.txt"
    ;;
  probe-vs-torch)
    timeout $(( $(left) - 3 )) python3 -m lab.bench_probe --backends nvcc --allocs register,hostalloc \
      --json "$O/bench_probe.json" > "$O/bench_probe.txt" 2>&1
    ;;
  calib-gpu)
    need_server
    timeout $(( $(left) - 12 )) python3 -m lab.calibrate gpu --server "$SERVER" --out "$O/calib-gpu" \
      --models "$W/calib-models" --only cpu-moe-c --timeout 120 > "$O/calib-gpu.log" 2>&1
    log "calibration rc=$?"
    timeout 8 python3 -m lab.calibrate report "$O/calib-gpu" --models "$W/calib-models" > "$O/calib-gpu-report.txt" 2>&1
    tail -4 "$O/calib-gpu-report.txt"
    ;;
  live-routing)
    need_server; routing_profile "${arg:-default}"
    timeout $(( $(left) - 5 )) bash lab/device/live-routing.sh "$H200" "$M/w1-loc-${arg:-default}.gguf" "$O/live" \
      --set nodes.0.vram_limit=12GiB --set model.parallel=4 > "$O/live-routing.log" 2>&1
    log "live routing rc=$?"; tail -12 "$O/live-routing.log"
    ;;
  up-proof)
    need_server; synth q30
    timeout 130 bash lab/device/up-proof.sh "$H200" "$Q30" "$O/up" > "$O/up-proof.log" 2>&1
    ;;
  gateway)
    gateway_on_gpu "${arg:-1}" "${GATEWAY_ROUNDS:-10}"
    ;;
  w1-budgets)
    need_server; synth q30
    timeout 320 "${BENCH[@]}" --set "model.path=$Q30" --vram-budget 12GiB \
      --configs plan,fit,control,ncmoe-sweep --ncmoe 18 --ub 1024 --load-modes pinned --rounds 2 \
      --pp 8,32,128,512,4096 --pp-reps 2 --tg-depths 0,4096 --tg-reps 3 --concurrency none --max-minutes 5.2 \
      --out "$O/w1-12g" > "$O/w1-12g.log" 2>&1
    for b in 8 16; do
      timeout 100 "${BENCH[@]}" --set "model.path=$Q30" --vram-budget ${b}GiB \
        --configs plan,fit --rounds 1 --pp 32,512,4096 --pp-reps 1 --tg-depths 0 --tg-reps 2 --concurrency none \
        --max-minutes 1.5 --out "$O/w1-${b}g" > "$O/w1-${b}g.log" 2>&1
    done
    ;;
  w1-why)
    need_server; synth q30
    local gib=${arg:-8}
    orch plan "$H200" --set "model.path=$Q30" --set nodes.0.vram_limit=${gib}GiB --json > "$O/plan-w1.json"
    local n back A B
    n=$(python3 -c "import json,re,sys; a=json.load(open(sys.argv[1]))['workers'][0]['args']; \
print(len(re.search(r'\(([\d|]+)\)', a[a.index('-ot') + 1]).group(1).split('|')))" "$O/plan-w1.json")
    back=$(python3 -c "import sys; n=int(sys.argv[1]); print('|'.join(str(i) for i in range(48 - n, 48)))" "$n")
    A=$(python3 lab/device/plan-config.py plan-ub512 "$O/plan-w1.json" --replace=-ub=512)
    B=$(python3 lab/device/plan-config.py plan-back "$O/plan-w1.json" \
        --replace="-ot=blk\.($back)\.ffn_(up|down|gate|gate_up)_(ch|)exps=CPU")
    timeout $(( $(left) - 3 )) "${BENCH[@]}" --set "model.path=$Q30" --vram-budget ${gib}GiB --configs plan,fit \
      --config "$A" --config "$B" --rounds 4 --pp 512 --pp-reps 1 --tg-depths 0 --tg-reps 3 --concurrency none \
      --max-minutes "$(mins)" --out "$O/w1-${gib}g-why" > "$O/w1-${gib}g-why.log" 2>&1
    ;;
  w1-sweep)
    need_server; synth q30
    timeout $(( $(left) - 3 )) "${BENCH[@]}" --set "model.path=$Q30" --vram-budget 12GiB --configs plan,ncmoe-sweep \
      --ncmoe 18,19,20 --ub 512,1024 --load-modes pinned --rounds 1 --pp 32,512,4096 --pp-reps 1 --tg-depths 0 \
      --tg-reps 3 --concurrency none --max-minutes "$(mins 15)" --out "$O/w1-12g-sweep" > "$O/w1-12g-sweep.log" 2>&1
    ;;
  w1-offload)
    need_server; synth q30
    timeout $(( $(left) - 3 )) "${BENCH[@]}" --set "model.path=$Q30" --vram-budget 12GiB \
      --configs plan,ncmoe-sweep,offload-sweep --load-modes pinned --offload never,256 --rounds 1 \
      --pp 8,32,64,128,512,4096 --pp-reps 1 --tg-depths 0 --concurrency none --max-minutes "$(mins 15)" \
      --out "$O/w1-12g-sweep" > "$O/w1-12g-sweep.log" 2>&1
    ;;
  w1-cpu-flags)
    need_server; synth q30
    orch plan "$H200" --set "model.path=$Q30" --set nodes.0.vram_limit=12GiB --json > "$O/plan-w1-12g.json" 2>&1
    local V=() v
    for v in "no-host:--no-host" "cpu-strict:--cpu-strict 1" "prio2:--prio 2" "poll100:--poll 100"; do
      V+=(--config "$(python3 lab/device/plan-config.py "plan-${v%%:*}" "$O/plan-w1-12g.json" --add="${v#*:}")")
    done
    timeout $(( $(left) - 3 )) "${BENCH[@]}" --set "model.path=$Q30" --vram-budget 12GiB --configs plan,fit "${V[@]}" \
      --rounds 3 --pp 512 --pp-reps 1 --tg-depths 0 --tg-reps 3 --concurrency none --max-minutes "$(mins)" \
      --out "$O/w1-12g-cpu" > "$O/w1-12g-cpu.log" 2>&1
    ;;
  w1-load-modes)
    need_server; synth q30
    orch plan "$H200" --set "model.path=$Q30" --set nodes.0.vram_limit=8GiB --json > "$O/plan-w1-8g.json"
    local A B
    A=$(python3 lab/device/plan-config.py plan-mmap "$O/plan-w1-8g.json" --add="--load-mode mmap")
    B=$(python3 lab/device/plan-config.py plan-no-host "$O/plan-w1-8g.json" --add="--no-host")
    timeout 400 "${BENCH[@]}" --set "model.path=$Q30" --vram-budget 8GiB --configs plan,fit --config "$A" --config "$B" \
      --rounds 3 --pp 512 --pp-reps 1 --tg-depths 0 --tg-reps 3 --concurrency none --max-minutes 6 \
      --out "$O/w1-8g-mem" > "$O/w1-8g-mem.log" 2>&1
    ;;
  gpu-tests)
    need_server
    LLAMA_SERVER=$SERVER timeout $(( $(left) - 5 )) python3 -m pytest --noconftest -p no:cacheprovider -m gpu -v -s ${GPU_TESTS_K:+-k "$GPU_TESTS_K"} \
      --basetemp "$W/pytest" tests/backend/test_expert_cache_gpu.py tests/backend/test_router_trace_gpu.py \
      > "$O/pytest.log" 2>&1
    log "gpu tests rc=$?"; tail -6 "$O/pytest.log"
    ;;
  routing)
    need_server; routing_profile "${arg:-default}"
    ;;
  w1-cache)
    cache_runs w1 "${arg:-default}" "${W1_CACHE_BUDGETS:-12 8 16}" "${W1_CACHE_CONFIGS:-}"
    ;;
  w2-cache)
    cache_runs w2 "${arg:-default}" "${W2_CACHE_BUDGETS:-24}" "${W2_CACHE_CONFIGS:-}"
    ;;
  workload)
    need_server
    local loc=${arg:-default} b first SETS=()
    routing_profile "$loc" w1
    first=${WORKLOAD_BUDGETS-12 8 16}; first=${first%% *}
    for b in ${WORKLOAD_BUDGETS-12 8 16}; do
      [ "$(left)" -gt 150 ] || { log "no time left for ${b} GiB"; break; }
      workload_run "$M/w1-loc-$loc.gguf" "$b" "w1-${b}g" "plan,fit-pinned$([ "$b" = "$first" ] && echo ,control)" \
        --pp 512,4096 --pp-reps 1 --tg-depths 0 --tg-reps 2 --concurrency 1 --ttft-requests 4
    done
    b=${WORKLOAD_STREAMS_BUDGET:-12}
    if [ "$b" != 0 ] && [ "$(left)" -gt 150 ]; then
      SETS=(--set model.parallel=4)
      NO_VARIANT=${WORKLOAD_STREAMS_NO_VARIANT-1} workload_run "$M/w1-loc-$loc.gguf" "$b" "w1-${b}g-4streams" plan,fit-pinned \
        --pp 512 --pp-reps 1 --tg-depths none --tg-reps 2 --tg-streams 1,2,4 --concurrency 4 --ttft-requests 4
      SETS=()
    fi
    if [ "${WORKLOAD_W2:-1}" != 0 ] && [ "$(left)" -gt 200 ]; then
      routing_profile "$loc" w2
      workload_run "$M/w2-loc-$loc.gguf" 24 "w2-24g" plan,fit-pinned --pp 512,4096 --pp-reps 1 --tg-depths 0 \
        --tg-reps 2 --concurrency 1 --ttft-requests 4
    fi
    ;;
  gpu-tests-families)
    need_server
    LLAMA_SERVER=$SERVER timeout $(( $(left) - 5 )) python3 -m pytest --noconftest -p no:cacheprovider -m gpu -v -s \
      --basetemp "$W/pytest-families" tests/backend/test_expert_cache_families_gpu.py > "$O/pytest.log" 2>&1
    log "gpu tests (families) rc=$?"; tail -8 "$O/pytest.log"
    ;;
  families)
    need_server
    local f like layers quant b mdl out saved SETS=()
    for f in $(echo "${arg:-w3,w4,w5}" | tr ',' ' '); do
      case "$f" in
        w3) like=deepseek-v3 layers=6 quant=(--quant q4_0) b=${W3_BUDGET:-12} ;;
        w4) like=gpt-oss-120b layers=12 quant=() b=${W4_BUDGET:-10} ;;
        w5) like=glm-4.5-air layers=16 quant=(--quant q4_0) b=${W5_BUDGET:-10} ;;
        *) log "families: unknown family '$f' (w3, w4, w5)"; continue ;;
      esac
      [ "$(left)" -gt "${FAMILY_MIN_LEFT:-200}" ] || { log "no time left for $f"; break; }
      rm -f "$M"/fam-*.gguf                      # one model on disk at a time (64 GiB with the build)
      mdl=$M/fam-$like-${layers}l.gguf
      ( time orch synth-model "$mdl" --like "$like" --layers "$layers" "${quant[@]}" --locality default ) \
        >> "$O/synth-$f.log" 2>&1
      log "$f: $like, $layers layers rc=$?"
      out=$O/routing-$f
      ( time timeout 180 python3 -m orchestrator model "$mdl" --routing --gpu-layers 99 ) > "$out.txt" 2>&1
      log "$f: routing profile rc=$?"; tail -7 "$out.txt"
      saved=$(grep -oE '^(saved|cached): .*\.json$' "$out.txt" | tail -1 | cut -d' ' -f2-)
      [ -n "$saved" ] && xz -c "$saved" > "$out.profile.json.xz"
      SETS=()
      if [ "$f" = w4 ] && [ -n "${FAMILIES_BIASES:-}" ]; then   # gpt-oss: and its biases placed the other way
        WORKLOAD_VARIANT=biases workload_run "$mdl" "$b" "$f-${b}g" plan,fit-pinned,control \
          --pp 512,4096 --pp-reps 1 --tg-depths 0 --tg-reps 2 --concurrency 1 --ttft-requests 4
      else
        NO_VARIANT=1 workload_run "$mdl" "$b" "$f-${b}g" plan,fit-pinned,control \
          --pp 512,4096 --pp-reps 1 --tg-depths 0 --tg-reps 2 --concurrency 1 --ttft-requests 4
      fi
      if [[ ",${FAMILIES_EXTRA:-}," == *",1,"* || ",${FAMILIES_EXTRA:-}," == *",$f,"* ]]; then
        python3 lab/bench/expert_bias_splits.py --plan "$O/plan-$f-${b}g.json" --tokens 64 --dir "$O/splits-$f" | tail -2
        if [ "$f" = w4 ]; then                 # gpt-oss: the splits with its biases placed the other way
          c=$(python3 lab/bench/bias_variant.py "$O/plan-$f-${b}g.json")
          python3 lab/bench/expert_bias_splits.py --plan "$O/plan-$f-${b}g.json" --config "$c" --tokens 64 \
            --dir "$O/splits-$f-b" | tail -2
        fi
        python3 lab/bench/routing_by_position.py "$mdl" --tokens 1024 --gpu-layers 99 \
          --slots "$(case $f in w3) echo 94;; w4) echo 44;; w5) echo 46;; esac)" > "$O/position-$f.txt" 2>&1
        timeout $(( $(left) - 5 )) "${BENCH[@]}" --set "model.path=$mdl" --vram-budget 60GiB --configs plan --rounds 1 \
          --out "$O/$f-allgpu" --pp 512 --pp-reps 1 --tg-depths 0 --tg-reps 2 --concurrency 1 > "$O/$f-allgpu.log" 2>&1
      fi
      if [ "${FAMILIES_STREAMS:-1}" != 0 ] && [ "$(left)" -gt 120 ]; then
        SETS=(--set model.parallel=4)
        NO_VARIANT=1 workload_run "$mdl" "$b" "$f-${b}g-4streams" plan,fit-pinned \
          --pp 512 --pp-reps 1 --tg-depths none --tg-reps 2 --tg-streams 1,4 --concurrency 4 --ttft-requests 4
        SETS=()
      fi
      rm -f "$mdl"
    done
    ;;
  device-slots)
    need_server
    local loc=${arg:-default} b=${DEVICE_SLOTS_BUDGET:-12} SETS=(--set model.parallel=4)
    routing_profile "$loc" w1
    local mdl=$M/w1-loc-$loc.gguf name=w1-${b}g-device-slots c V=()
    orch plan "$H200" --set "model.path=$mdl" --set "nodes.0.vram_limit=${b}GiB" "${SETS[@]}" > "$O/plan-$name.txt" 2>&1
    orch plan "$H200" --set "model.path=$mdl" --set "nodes.0.vram_limit=${b}GiB" "${SETS[@]}" --json \
      > "$O/plan-$name.json" 2>&1
    c=$(python3 lab/device/plan-config.py device "$O/plan-$name.json" --add='--moe-cache-slots device'); V+=(--config "$c")
    [ "${DEVICE_SLOTS_WAIT:-0}" = 1 ] && { c=$(python3 lab/device/plan-config.py split-wait "$O/plan-$name.json")
      V+=(--config "${c/=/=LLAMA_MOE_CACHE_SPLIT_WAIT=1 }"); }
    timeout $(( $(left) - 5 )) "${BENCH[@]}" --set "model.path=$mdl" "${SETS[@]}" --vram-budget ${b}GiB \
      --configs "plan,fit-pinned,control" "${V[@]}" --rounds "${DEVICE_SLOTS_ROUNDS:-1}" --max-minutes "$(mins 10)" \
      --out "$O/$name" --pp 512 --pp-reps 1 --tg-depths none --tg-reps 3 --tg-streams 1,4 --concurrency none \
      > "$O/$name.log" 2>&1
    log "$name rc=$?"; tail -22 "$O/$name.log"
    ;;
  prefetch)
    need_server
    local loc=${arg:-default} b first SETS=(--set model.parallel=4)
    routing_profile "$loc" w1
    first=${PREFETCH_BUDGETS:-12 8}; first=${first%% *}
    for b in ${PREFETCH_BUDGETS:-12 8}; do
      [ "$(left)" -gt 150 ] || { log "no time left for ${b} GiB"; break; }
      local mdl=$M/w1-loc-$loc.gguf name=w1-${b}g-prefetch
      orch plan "$H200" --set "model.path=$mdl" --set "nodes.0.vram_limit=${b}GiB" "${SETS[@]}" > "$O/plan-$name.txt" 2>&1
      orch plan "$H200" --set "model.path=$mdl" --set "nodes.0.vram_limit=${b}GiB" "${SETS[@]}" --json \
        > "$O/plan-$name.json" 2>&1
      local V=(--config "$(python3 lab/device/plan-config.py plan-prefetch "$O/plan-$name.json" \
                            --add='--moe-cache-prefetch on')")
      if [ -n "${PREFETCH_VARIANTS:-}" ]; then   # the copy stream not waiting / also issued at a layer's first bank
        local c; c=$(python3 lab/device/plan-config.py pf-unordered "$O/plan-$name.json" --add='--moe-cache-prefetch on')
        V+=(--config "${c/=/=LLAMA_MOE_CACHE_PREFETCH_ORDERED=0 }")
        c=$(python3 lab/device/plan-config.py pf-early "$O/plan-$name.json" --add='--moe-cache-prefetch on')
        V+=(--config "${c/=/=LLAMA_MOE_CACHE_PREFETCH_ORDERED=0 LLAMA_MOE_CACHE_PREFETCH_EARLY=1 }")
      fi
      timeout $(( $(left) - 5 )) "${BENCH[@]}" --set "model.path=$mdl" "${SETS[@]}" --vram-budget ${b}GiB \
        --configs "plan,fit-pinned$([ "$b" = "$first" ] && [ "${PREFETCH_ROUNDS:-1}" = 1 ] && echo ,control)" "${V[@]}" \
        --rounds "${PREFETCH_ROUNDS:-1}" --max-minutes "$(mins 10)" --out "$O/$name" \
        --pp 512 --pp-reps 1 --tg-depths none --tg-reps 3 --tg-streams 1,4 --concurrency none \
        > "$O/$name.log" 2>&1
      log "$name rc=$?"; tail -22 "$O/$name.log"
    done
    ;;
  w2)
    need_server; synth q235
    timeout $(( $(left) - 3 )) "${BENCH[@]}" --set "model.path=$Q235" --vram-budget 24GiB --configs plan,fit --rounds 1 \
      --pp 32,512,4096 --pp-reps 1 --tg-depths 0 --concurrency none --max-minutes "$(mins 15)" \
      --out "$O/w2-24g" > "$O/w2-24g.log" 2>&1
    ;;
  w1-threads)
    need_server; synth q30
    timeout 250 "${BENCH[@]}" --set "model.path=$Q30" --set "nodes.0.gpus=[0]" --gpus 0 --vram-budget 12GiB \
      --configs plan,fit,threads-sweep --threads 8,16,24 --rounds 3 --pp 512 --pp-reps 1 --tg-depths 0 --tg-reps 3 \
      --concurrency none --max-minutes 4.0 --out "$O/w1-12g-threads" > "$O/w1-12g-threads.log" 2>&1
    ;;
  w2-x2)
    need_server; synth q235
    orch plan "$H200" --set "model.path=$Q235" --set nodes.0.vram_limit=12GiB > "$O/plan-w2.txt" 2>&1
    timeout $(( $(left) - 3 )) "${BENCH[@]}" --set "model.path=$Q235" --vram-budget 12GiB --configs plan,fit --rounds 2 \
      --pp 32,512,4096 --pp-reps 1 --tg-depths 0,4096 --tg-reps 2 --concurrency none --max-minutes "$(mins)" \
      --out "$O/w2-2x12g" > "$O/w2-2x12g.log" 2>&1
    ;;
  w2-x2-split)
    need_server; synth q235
    orch plan "$H200" --set "model.path=$Q235" --set nodes.0.vram_limit=12GiB --set workers.split_mode=layer \
      --json > "$O/plan-x2-layer.json" 2>&1
    local LAYER
    LAYER=$(python3 lab/device/plan-config.py sm-layer "$O/plan-x2-layer.json")
    echo "$LAYER" > "$O/layer-config.txt"
    timeout 240 "${BENCH[@]}" --set "model.path=$Q235" --vram-budget 12GiB --configs plan,fit --config "$LAYER" --rounds 1 \
      --pp 32,512,4096 --pp-reps 1 --tg-depths 0,4096 --tg-reps 2 --concurrency none --max-minutes 3.8 \
      --out "$O/w2-2x12g" > "$O/w2-2x12g.log" 2>&1
    ;;
  w2-x2-cache)
    need_server
    local loc=${arg:-default} b=${W2_X2_BUDGET:-12} V=() sm
    local mdl=$M/w2-loc-$loc.gguf
    routing_profile "$loc" w2
    orch plan "$H200" --set "model.path=$mdl" --set "nodes.0.vram_limit=${b}GiB" > "$O/plan.txt" 2>&1
    for sm in layer tensor; do    # the alternatives the plan did not take, placed by the planner
      if orch plan "$H200" --set "model.path=$mdl" --set "nodes.0.vram_limit=${b}GiB" --set workers.split_mode=$sm \
           --set workers.expert_cache=off --json > "$O/plan-sm-$sm.json" 2> "$O/plan-sm-$sm.err"; then
        V+=(--config "$(python3 lab/device/plan-config.py "sm-$sm" "$O/plan-sm-$sm.json")")
      else
        log "no -sm $sm plan: $(tail -1 "$O/plan-sm-$sm.err")"
      fi
    done
    timeout $(( $(left) - 5 )) "${BENCH[@]}" --set "model.path=$mdl" --vram-budget ${b}GiB --configs plan,fit-pinned \
      "${V[@]}" --rounds "${CACHE_ROUNDS:-1}" --pp 512,4096 --pp-reps 1 --tg-depths 0 --tg-reps 2 --concurrency 1 \
      --ttft-requests 4 --max-minutes "$(mins 10)" --out "$O/w2-2x${b}g" > "$O/w2-2x${b}g.log" 2>&1
    log "w2 2 x ${b} GiB rc=$?"; tail -25 "$O/w2-2x${b}g.log"
    ;;
  w1-x2)
    need_server; synth q30
    timeout $(( $(left) - 3 )) "${BENCH[@]}" --set "model.path=$Q30" --vram-budget 6GiB --configs plan,fit --rounds 1 \
      --pp 32,512,4096 --pp-reps 1 --tg-depths 0 --tg-reps 3 --concurrency none --max-minutes "$(mins)" \
      --out "$O/w1-2x6g" > "$O/w1-2x6g.log" 2>&1
    ;;
  build-ik)
    ( time timeout $(( $(left) - 10 )) python3 -m orchestrator build --flavor ik_llama.cpp \
        --source .devbundle/ik-src.tar.xz --cuda --cuda-arch 90 --native -j 32 ) > "$O/build-ik.log" 2>&1 &
    local b=$!
    synth q235
    synth q30
    wait $b; log "ik build rc=$? (124: cut by the time limit; the next build-ik resumes it)"; tail -3 "$O/build-ik.log"
    ;;
  w2-x2-ik)
    need_server; synth q235
    local IK IKLAYER MAIN
    IK=$(ls "$ORCHESTRATOR_CACHE"/llama.cpp/ik_llama.cpp-cuda-*/bin/llama-server 2>/dev/null | head -1)
    [ -n "$IK" ] || { log "no ik_llama.cpp CUDA build: run build-ik first"; return; }
    orch plan "$H200" --set "model.path=$Q235" --set nodes.0.vram_limit=12GiB --set "backend.binary=$IK" \
      > "$O/plan-w2-ik.txt" 2>&1
    orch plan "$H200" --set "model.path=$Q235" --set nodes.0.vram_limit=12GiB --set "backend.binary=$IK" \
      --set workers.split_mode=layer --json > "$O/plan-w2-ik-layer.json" 2>&1
    orch plan "$H200" --set "model.path=$Q235" --set nodes.0.vram_limit=12GiB --set "backend.binary=$SERVER" \
      --json > "$O/plan-w2.json" 2>&1
    IKLAYER=$(python3 lab/device/plan-config.py ik-layer "$O/plan-w2-ik-layer.json")
    MAIN=$(python3 lab/device/plan-config.py mainline-plan "$O/plan-w2.json" --server)
    timeout $(( $(left) - 3 )) "${BENCH[@]}" --set "model.path=$Q235" --set "backend.binary=$IK" --vram-budget 12GiB \
      --configs plan --config "$IKLAYER" --config "$MAIN" --rounds 1 --pp 32,512,4096 --pp-reps 1 \
      --tg-depths 0,4096 --tg-reps 2 --concurrency none --max-minutes "$(mins)" --out "$O/w2-2x12g-ik" \
      > "$O/w2-2x12g-ik.log" 2>&1
    ;;
  cpu-up)
    cpu_server
    python3 -m orchestrator synth-model models/demo-moe.gguf --like qwen3-30b-a3b --scale 0.125 --quant q8_0 \
      > "$O/synth.log" 2>&1; log "demo model rc=$?"
    local run n
    for run in 1 2; do
      timeout 100 bash lab/device/up-proof.sh topologies/demo.yaml models/demo-moe.gguf "$O/up$run" \
        --set nodes.0.gpus=none > "$O/up-proof-$run.log" 2>&1
      log "up-proof $run rc=$?"; grep -E "direct_load|ready in|left:" "$O/up-proof-$run.log"
    done
    for n in 1 4; do
      timeout 60 python3 lab/bench/gateway_overhead.py --mode ray --rounds 8 --gateway-processes $n --json \
        > "$O/gateway-$n.txt" 2>&1; log "gateway, $n process(es)"; tail -2 "$O/gateway-$n.txt" | cut -c1-300
    done
    ;;
  cpu-early)
    cpu_server
    python3 -m orchestrator synth-model models/q30-12l.gguf --like qwen3-30b-a3b --layers 12 > "$O/synth.log" 2>&1
    log "model rc=$?"
    timeout $(( $(left) - 5 )) bash lab/bench/up_ready.sh topologies/demo.yaml models/q30-12l.gguf 3 \
      --set workers.replicas=1 --set workers.load_mode=pinned --set nodes.0.gpus=none 2>&1 | tee "$O/up_ready.log"
    log "left: llama-server $(pgrep -xc llama-server) keeper $(pgrep -fc '[o]rchestrator.cluster.keeper')"
    ;;
  sampler-cost)
    cpu_server
    timeout $(( $(left) - 5 )) python3 lab/bench/sampler_cost.py --server "$LLAMA_SERVER" --threads "${arg:-16}" \
      --rounds 3 --json > "$O/sampler-cost.txt" 2>&1
    log "sampler cost rc=$?"; head -6 "$O/sampler-cost.txt"
    ;;
  gateway-cpu)
    cpu_server
    local i v cmd
    for i in 1 2; do
      log "ray mode, run $i"
      timeout 70 python3 lab/bench/gateway_overhead.py --mode ray --rounds 20 --threads 8 --json > "$O/ray-$i.txt" 2>&1
      grep -v '^{' "$O/ray-$i.txt" | tail -10
    done
    for i in 1 2; do
      for v in new ${arg:+old}; do
        log "stand-in upstream, $v gateway, run $i"
        cmd=()
        [ "$v" = old ] && cmd=(--gateway-cmd "python3 $arg --port {port} --replica bench={upstream}")
        timeout 40 python3 lab/bench/gateway_overhead.py --mode fake --rounds 12 "${cmd[@]}" --json \
          > "$O/fake-$v-$i.txt" 2>&1
        grep -E 'first token p50|total p50|tokens/s|CPU' "$O/fake-$v-$i.txt"
      done
    done
    ;;
  esac
}

for a in "$@"; do
  case "$a" in *=*) step "${a%%=*}" "${a#*=}" ;; *) step "$a" ;; esac
done
log "done"
