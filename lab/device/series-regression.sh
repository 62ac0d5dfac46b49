#!/usr/bin/env bash
# The llama.cpp patch series as it was (the commit given as OLD, default fe45b4e: one scheduler block per feature
# inside ggml-backend.cpp) against the series of this checkout (the cache in files of its own behind hooks): the
# same plans, old and new builds interleaved with an A/A control, and the GPU correctness tests on the new build.
#
#   bash lab/device/series-regression.sh prepare [OLD]   here: writes .devbundle/series-old.tar.xz and
#                                                        .devbundle/series-new.tar.xz (the pinned source with each
#                                                        series applied; about 5 MiB each) from the cached sdist
#   bash lab/device/series-regression.sh run             on the H200 (one command, RUN_SECONDS, default 570):
#     1. builds the old tree (CUDA, sm_90, static, 16 jobs) under /root/series/build, copies its llama-server
#        aside, overwrites the source files the new series changes and rebuilds in the same build
#        folder (only what they touch recompiles), while W1 and W2 are written (synth-model, as run.sh does);
#     2. for W1 at 12 GiB and W2 at 24 GiB (the plans `orchestrator plan topologies/h200.yaml` makes with that
#        vram_limit, the same flags for both builds): one `orchestrator bench` each with configurations plan and
#        control (the plan again: the A/A spread) on the old llama-server and new (the same flags on the new
#        one), interleaved over ROUNDS (W1, default 2) and W2_ROUNDS (default 1): pp 512 and 4096, tg128; W1
#        takes two thirds of the time left when W2 follows, the last workload the rest less GPU_TESTS_SECONDS
#        (default 180) when the GPU tests follow;
#        builds made by an earlier `run` of the same archives while the machine is warm are reused, so a second
#        command measures for its whole time (RUN_SECONDS): the two builds take most of a first command's 10 min;
#     3. tests/backend/test_expert_cache_gpu.py on the new build.
#   PARTS (default bench,gpu-tests) picks steps 2 and 3, e.g. PARTS=gpu-tests for a command of its own.
#   WORKLOADS (default "w1 w2") narrows the models written and measured; PARTS (default bench,gpu-tests) the parts.
#   Writes everything under $OUT: build logs, plan JSON, each bench's folder (JSON and table), pytest.log,
#   summary.json (the median pp512, pp4096, tg128 and hit rate of plan, control and new per workload).
# Needs .devbundle/ as run.sh does (make-bundle.sh; the python packages) plus the two archives of `prepare`.
set -uo pipefail
cd "$(dirname "$0")/../.."

prepare() {
  local old=${1:-fe45b4e} tmp
  tmp=$(mktemp -d /tmp/series-regression.XXXXXX)
  mkdir -p .devbundle "$tmp/old-patches"
  git archive "$old" native/llama.cpp-patches | tar x -C "$tmp/old-patches" --strip-components=2 || {
    echo "series-regression: $old has no native/llama.cpp-patches"; exit 1; }
  local py=${PYTHON:-python3}
  PYTHONPATH=$PWD "$py" -m lab.llama_series checkout "$tmp/old" --patches "$tmp/old-patches" >/dev/null &&
    PYTHONPATH=$PWD "$py" -m orchestrator build --source "$tmp/old" --export-source .devbundle/series-old.tar.xz &&
    PYTHONPATH=$PWD "$py" -m lab.llama_series checkout "$tmp/new" >/dev/null &&
    PYTHONPATH=$PWD "$py" -m orchestrator build --source "$tmp/new" --export-source .devbundle/series-new.tar.xz ||
    { echo "series-regression: could not prepare the sources (see above)"; rm -rf "$tmp"; exit 1; }
  (cd "$tmp/old" && git rev-parse HEAD) > .devbundle/series-old.commit
  rm -rf "$tmp"
  ls -l .devbundle/series-old.tar.xz .devbundle/series-new.tar.xz
}

[ "${1:-}" = prepare ] && { shift; prepare "$@"; exit $?; }
[ "${1:-}" = run ] || { sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 2; }

for f in .devbundle/series-old.tar.xz .devbundle/series-new.tar.xz .devbundle/on-device.sh; do
  [ -f "$f" ] || { echo "series-regression: $f is missing (run \`$0 prepare\` and make-bundle.sh here)"; exit 1; }
done
t0=$(date +%s)
DEADLINE=$(( t0 + ${RUN_SECONDS:-570} ))
OUT=${OUT:-/tmp/series-regression-out}
S=/root/series M=/root/work/models
mkdir -p "$OUT" "$S" "$M"
source .devbundle/on-device.sh .devbundle >/dev/null
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 ORCHESTRATOR_CACHE=/root/.cache/orchestrator
log() { echo "[$(( $(date +%s) - t0 ))s] $*" | tee -a "$OUT/series-regression.log"; }
left() { echo $(( DEADLINE - $(date +%s) )); }
mins() { python3 -c "print(max(0.3, ($(left) - ${1:-12}) / 60))"; }
H200=topologies/h200.yaml
W1=$M/w1-loc-default.gguf W2=$M/w2-loc-default.gguf

# 1. sources, builds, models. Each stage leaves a mark, so a command that ran out of time before the builds ended
#    leaves the next one (while the machine is warm) to resume where it stopped: ninja picks up a half-built tree;
#    builds of the same two archives from an earlier command are kept, and a second `run` goes straight to measuring
stamp=$(cat .devbundle/series-old.tar.xz .devbundle/series-new.tar.xz | sha256sum | cut -c1-16)
if [ -x "$S/new-bin/llama-server" ] && [ "$(cat "$S/stamp" 2>/dev/null)" = "$stamp" ]; then
  reuse=1; log "builds of these sources kept from an earlier command"
elif [ "$(cat "$S/src-stamp" 2>/dev/null)" = "$stamp" ]; then
  reuse=0; log "resuming the builds of an earlier command"
else
  reuse=0; rm -rf "$S/src" "$S/new" "$S/build" "$S/old-bin" "$S/new-bin" "$S/stamp" "$S/src-stamp" "$S/overlaid"
  mkdir -p "$S/src" "$S/new"
  tar xJf .devbundle/series-old.tar.xz -C "$S/src" --strip-components=1
  tar xJf .devbundle/series-new.tar.xz -C "$S/new" --strip-components=1
  echo "$stamp" > "$S/src-stamp"
fi
CMAKE=(-G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=ON
       -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
       -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF -DGGML_RPC=ON)
TARGETS=(llama-server)
build() {   # build LOG: the targets, resumed where an earlier command stopped, within this command's time
  ( time timeout $(( $(left) - 15 )) cmake --build "$S/build" -j 16 --target "${TARGETS[@]}" ) >> "$1" 2>&1
}
[ $reuse = 1 ] || (
  set -e
  if [ ! -x "$S/old-bin/llama-server" ]; then
    [ -f "$S/build/build.ninja" ] || cmake -S "$S/src" -B "$S/build" "${CMAKE[@]}" > "$OUT/build-old.log" 2>&1
    build "$OUT/build-old.log"
    mkdir -p "$S/old-bin"; cp "$S/build/bin/llama-server" "$S/old-bin/"
  fi
  # the new series over the old: only files whose bytes differ are written (ninja rebuilds what they touch);
  # files only the old series has are removed
  [ -f "$S/overlaid" ] || { python3 lab/device/series_overlay.py "$S/new" "$S/src" > "$OUT/overlay.txt"
                            touch "$S/overlaid"; }
  build "$OUT/build-new.log"
  mkdir -p "$S/new-bin"; cp "$S/build/bin/llama-server" "$S/new-bin/"
  echo "$stamp" > "$S/stamp"
) &
builds=$!
python3 -m compileall -q -j 4 /tmp/site "$PWD/orchestrator" > /dev/null 2>&1 &
[ -f "$W1" ] || ( time python3 -m orchestrator synth-model "$W1" --like qwen3-30b-a3b --quant q4_0 --locality default ) \
  > "$OUT/synth.log" 2>&1
[[ " ${WORKLOADS:-w1 w2} " != *" w2 "* ]] || [ -f "$W2" ] || ( time python3 -m orchestrator synth-model "$W2" --like qwen3-235b-a22b --layers 24 --quant q4_0 \
  --locality default ) >> "$OUT/synth.log" 2>&1
log "models written"
wait $builds; rc=$?
log "builds rc=$rc: old $(grep -m1 real "$OUT/build-old.log" 2>/dev/null), new $(grep -m1 real "$OUT/build-new.log" 2>/dev/null)"
[ $rc -eq 0 ] || { tail -20 "$OUT/build-old.log" "$OUT/build-new.log" 2>/dev/null; exit 1; }
OLD=$S/old-bin/llama-server NEW=$S/new-bin/llama-server
export LLAMA_SERVER=$NEW    # what bench resolves for everything not given its own server
cmp -s "$OLD" "$NEW" && { log "the old and new binaries are the same: the overlay changed nothing"; exit 1; }

# 2. the plans: one bench per workload, the old build (plan, and control: the plan again, the A/A spread) and the
#    new one (new: the plan's flags on the new llama-server) interleaved over the rounds
PARTS=${PARTS:-bench,gpu-tests}
for w in "w1 $W1 12" "w2 $W2 24"; do
  set -- $w
  [[ ,$PARTS, == *,bench,* ]] || break
  [[ " ${WORKLOADS:-w1 w2} " == *" $1 "* ]] || continue
  [ "$(left)" -gt 200 ] || { log "no time left for $1"; continue; }
  # planned against the new build (its options are the old one's less the lab's): the same flags for both
  LLAMA_SERVER=$NEW python3 -m orchestrator plan "$H200" --set "model.path=$2" --set "nodes.0.vram_limit=$3GiB" \
    --json > "$OUT/plan-$1.json" 2>&1 || { log "no plan for $1: $(tail -2 "$OUT/plan-$1.json")"; continue; }
  c=$(python3 lab/device/plan-config.py new "$OUT/plan-$1.json")
  # of what is left (less the GPU tests' reserve), W1 takes two thirds when W2 follows; the last one takes all
  reserve=10; [[ ,$PARTS, == *,gpu-tests,* ]] && reserve=${GPU_TESTS_SECONDS:-180}
  share=3; [ "$1" = w1 ] && [[ " ${WORKLOADS:-w1 w2} " == *" w2 "* ]] && share=2
  budget=$(( ($(left) - reserve) * share / 3 ))
  timeout "$budget" python3 -m orchestrator bench "$H200" --progress plain --set "model.path=$2" \
    --vram-budget "$3GiB" --server "$OLD" --configs plan,control --config "${c/=/=LLAMA_SERVER=$NEW }" \
    --rounds "$([ "$1" = w1 ] && echo "${ROUNDS:-2}" || echo "${W2_ROUNDS:-1}")" --pp 512,4096 --pp-reps 1 --tg-depths 0 --tg-reps 2 --concurrency none \
    --max-minutes "$(python3 -c "print(max(0.5, $budget / 60 - 0.3))")" --out "$OUT/$1-$3g" \
    > "$OUT/$1-$3g.log" 2>&1
  log "$1 $3 GiB rc=$?"; tail -12 "$OUT/$1-$3g.log"
done

# 3. the GPU correctness tests on the new build
if [[ ,$PARTS, != *,gpu-tests,* ]]; then
  :
elif [ "$(left)" -gt 60 ]; then
  LLAMA_SERVER=$NEW timeout $(( $(left) - 10 )) python3 -m pytest --noconftest -p no:cacheprovider -m gpu -v -s \
    --basetemp /root/series/pytest tests/backend/test_expert_cache_gpu.py > "$OUT/pytest.log" 2>&1
  log "gpu tests rc=$?"; tail -8 "$OUT/pytest.log"
else
  log "no time left for the GPU tests"
fi
python3 - "$OUT" > "$OUT/summary.json" <<'PY'
import json, pathlib, sys
out = {}
for f in sorted(pathlib.Path(sys.argv[1]).glob("w*-*g/*.json")):
    try:
        d = json.loads(f.read_text())
    except (OSError, ValueError):
        continue
    if "summary" not in d:
        continue
    out[f.parent.name] = {c: {k: v.get("median") for k, v in s.get("metrics", {}).items()
                              if k.startswith(("pp", "tg", "expert_cache_hit"))}
                          for c, s in d["summary"].items()}
print(json.dumps(out, indent=1))
PY
cat "$OUT/summary.json"
