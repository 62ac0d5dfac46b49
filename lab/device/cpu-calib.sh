#!/usr/bin/env bash
# The CPU speed model on the GPU machine's CPU, in one command: W1 planned without its GPU, that plan's prediction
# against llama-bench with the plan's own threads and micro-batch, and the runs the CPU constants are fitted on.
#
#   bash lab/device/cpu-calib.sh            (on the device, from the project root; results under $OUT)
#
# Needs, carried along with the working tree (nothing else is installed there, and there is no network):
#   .devbundle/   ../shared/device/make-bundle.sh .devbundle   (gguf for synth-model; its on-device.sh)
#   .devcpu/      mkdir -p .devcpu && for t in llama-server llama-bench; do
#                   xz -c ~/.cache/orchestrator/llama.cpp/mainline-cpu-*/bin/$t > .devcpu/$t.xz; done
#                 (the portable CPU build `orchestrator build` makes by default; static binaries). Without it the
#                 script builds that CPU build there from .devbundle/llama-src.tar.xz (16 jobs; 341 s on 2 cores here).
# Writes: $OUT/plan-w1-cpu.json (the plan, `plan --json`), $OUT/cpu-speed.json (lab.cpu_speed's record: the probe's
# host bandwidth by thread count, every llama-bench row with its argv), $OUT/fit.txt (lab.cpu_speed fit on it),
# $OUT/serve-w1.json (the plan's worker argv through llama-server, timed by the server),
# $OUT/summary.json (predicted and measured tg and pp512 of the plan), $OUT/log.txt. CPU_CALIB_ROUNDS (default 3)
# interleaved rounds. CPU_CALIB_W1=FILE plans and measures that model instead of writing W1 (a small one tries the
# script out on another machine), CPU_CALIB_SMALL_THREADS (default 1,4) the thread counts of the small models,
# CPU_CALIB_PROMPTS (default 32,512,4096: the prompt lengths, 4096 for attention's growth with the context) and
# CPU_CALIB_REPS (default 3) llama-bench's repetitions per run.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/cpu-calib-out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/log.txt") 2>&1
t0=$(date +%s)
log() { echo "[$(( $(date +%s) - t0 ))s] $*"; }
die() { log "cpu-calib.sh: $*"; exit 2; }

[ -f .devbundle/on-device.sh ] || die ".devbundle/ is missing (see the head of this script)"
carried=1
for t in llama-server llama-bench; do [ -f ".devcpu/$t.xz" ] || carried=0; done
[ $carried = 1 ] || [ -f .devbundle/llama-src.tar.xz ] \
  || die ".devcpu/llama-server.xz is missing, and no .devbundle/llama-src.tar.xz to build from (see the head of this script)"
source .devbundle/on-device.sh .devbundle >/dev/null
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
W=${CPU_CALIB_WORK:-/root/work/cpu-calib}
mkdir -p "$W/bin" "$W/models"
export ORCHESTRATOR_CACHE=$W/cache ORCHESTRATOR_STATE=$W/state
orch() { python3 -m orchestrator "$@"; }
if [ $carried = 1 ]; then
  for t in llama-server llama-bench; do
    [ -x "$W/bin/$t" ] || { xz -dc ".devcpu/$t.xz" > "$W/bin/$t.tmp" && chmod +x "$W/bin/$t.tmp" && mv "$W/bin/$t.tmp" "$W/bin/$t"; }
  done
else
  log "building the portable CPU llama.cpp from .devbundle/llama-src.tar.xz"
  server=$(orch build --source .devbundle/llama-src.tar.xz --cpu -j "$(nproc)" | tail -1) || die "the CPU build failed"
  for t in llama-server llama-bench; do ln -sf "$(dirname "$server")/$t" "$W/bin/$t"; done
fi
export LLAMA_SERVER=$W/bin/llama-server

W1=${CPU_CALIB_W1:-$W/models/qwen3-30b-a3b-q4_0.gguf}
DEMO=$W/models/demo-moe.gguf
DEMO24=$W/models/demo-moe-24l.gguf
log "models"
[ -f "$W1" ] || orch synth-model "$W1" --like qwen3-30b-a3b --quant q4_0 | tail -1
[ -f "$DEMO" ] || orch synth-model "$DEMO" --like qwen3-30b-a3b --scale 0.125 --quant q8_0 | tail -1
[ -f "$DEMO24" ] || orch synth-model "$DEMO24" --like qwen3-30b-a3b --scale 0.125 --layers 24 --quant q8_0 | tail -1
[ -f "$W1" ] && [ -f "$DEMO" ] && [ -f "$DEMO24" ] || die "synth-model failed"
lscpu > "$OUT/lscpu.txt" 2>&1

log "plan of W1 without the GPU (the probe runs at first use)"
CPU_ONLY=(--set "model.path=$W1" --set nodes.0.gpus=none --set nodes.0.vram_limit=auto)
orch plan topologies/h200.yaml "${CPU_ONLY[@]}" --json > "$OUT/plan-w1-cpu.json" || die "plan failed"
orch plan topologies/h200.yaml "${CPU_ONLY[@]}" > "$OUT/plan-w1-cpu.txt" 2>&1
# the plan's threads, micro-batch and flash attention, as llama-bench flags
read -r T UB FA < <(python3 - "$OUT/plan-w1-cpu.json" <<'EOF'
import json, sys
a = json.load(open(sys.argv[1]))["workers"][0]["args"]
get = lambda f, d: a[a.index(f) + 1] if f in a else d
print(get("-t", "16"), get("-ub", "512"), get("-fa", "auto"))
EOF
)
log "plan: -t $T -ub $UB -fa $FA"

ROUNDS=${CPU_CALIB_ROUNDS:-3}
PROMPTS=${CPU_CALIB_PROMPTS:-32,512,4096}
REPS=${CPU_CALIB_REPS:-3}
log "the plan's configuration: llama-bench -t $T -ub $UB -fa $FA, $ROUNDS rounds, interleaved with the small models"
python3 -m lab.cpu_speed measure --bench "$W/bin/llama-bench" --model "$W1" --model "$DEMO" --model "$DEMO24" \
  --threads "$T" --rounds "$ROUNDS" --reps "$REPS" --gen 64 --prompts "$PROMPTS" --ubatch "$UB" --flash-attn "$FA" \
  --out "$OUT/cpu-speed.json" || die "measure failed"
SMALL_THREADS=${CPU_CALIB_SMALL_THREADS:-1,4}
log "small models at $SMALL_THREADS threads (the overhead-bound regime)"
python3 -m lab.cpu_speed measure --bench "$W/bin/llama-bench" --model "$DEMO" --model "$DEMO24" --threads "$SMALL_THREADS" \
  --rounds "$ROUNDS" --reps "$REPS" --gen 64 --prompts "$PROMPTS" --out "$OUT/cpu-speed-small.json" || die "measure failed"
python3 -m lab.cpu_speed fit "$OUT/cpu-speed.json" "$OUT/cpu-speed-small.json" > "$OUT/fit.txt" 2>&1
cat "$OUT/fit.txt"
log "the plan's worker as up starts it, timed by llama-server"
python3 -m lab.cpu_speed serve "$OUT/plan-w1-cpu.json" --rounds 5 --tokens 64 --out "$OUT/serve-w1.json" \
  || log "serve failed (the llama-bench numbers above stand)"

python3 - "$OUT" "$W1" <<'EOF'
import json, statistics, sys
from pathlib import Path
out, w1 = Path(sys.argv[1]), Path(sys.argv[2]).name
plan = json.loads((out / "plan-w1-cpu.json").read_text())["workers"][0]["predicted"]
runs = [r for r in json.loads((out / "cpu-speed.json").read_text())["runs"] if r["model"] == w1]
def samples(pred):
    return [s for r in runs if pred(r) for s in r["samples_ts"]]
tg = samples(lambda r: r["n_gen"] and not r["n_prompt"])
pp = samples(lambda r: r["n_prompt"] == 512)
summary = {"predicted": {"tg": plan["tg"], "pp512": plan["pp"]["512"]},
           "measured": {"tg_median": statistics.median(tg), "tg_range": [min(tg), max(tg)],
                        "pp512_median": statistics.median(pp), "pp512_range": [min(pp), max(pp)]}}
summary["ratio"] = {"tg": plan["tg"] / summary["measured"]["tg_median"],
                    "pp512": plan["pp"]["512"] / summary["measured"]["pp512_median"]}
if (out / "serve-w1.json").exists():
    served = [r["tg"] for r in json.loads((out / "serve-w1.json").read_text())["rounds"]]
    summary["measured"]["server_tg_median"] = statistics.median(served)
    summary["ratio"]["server_tg"] = plan["tg"] / statistics.median(served)
(out / "summary.json").write_text(json.dumps(summary, indent=1))
print(json.dumps(summary, indent=1))
EOF
log "done"
