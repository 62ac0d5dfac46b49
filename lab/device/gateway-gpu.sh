#!/usr/bin/env bash
# What the gateway adds in front of a CUDA llama-server: time to first token (p50, p95, p99) and time per token
# after the first (p50, p95) at 1, 4 and 16 concurrent streams, straight to llama-server and through the gateway
# actor that `orchestrator up` runs under Ray, interleaved round by round on one llama-server. Every request is
# kept with where its first token's time went (the gateway's Server-Timing, llama-server's prompt time, the rest:
# the wait for a slot and the batch in progress), so a tail is explained, not only measured. One command does the
# whole measurement, the CUDA build and the model included when asked; everything lands under $OUT.
#
#   bash lab/device/gateway-gpu.sh LLAMA_SERVER|build MODEL.gguf|w1
#
# `build`: the CUDA llama-server from $BUNDLE/llama-src.tar.xz through `orchestrator build` (as `run.sh build`
# does, and instant when that build is in the cache already); `w1`: W1 (Qwen3-30B-A3B q4_0, written by
# `orchestrator synth-model` unless /root/work/models has it, where run.sh keeps it), beside the build.
# Environment (defaults): OUT (./gateway-gpu-out), STREAMS (1,4,16), ROUNDS (10), REQUESTS (48 requests per path
# and stream count at least; 200 or more for a p99), MAX_TOKENS (64), NGL (99: every layer on the GPU), THREADS
# (8), MEASURE_SECONDS (480: the measurement's limit), BUNDLE (a folder made by ../shared/device/make-bundle.sh,
# default .devbundle when there: its on-device.sh is sourced when Ray is not importable, as on the H200).
# Writes: gateway-gpu.json (every number per stream count, and every request), gateway-gpu.txt (the printed
# report), gateway-gpu.md (the rows for docs/benchmarks.md and the tail's split), gateway-gpu-requests.csv (one
# line per request), machine.txt (GPU, driver, commit).
set -euo pipefail
cd "$(dirname "$0")/../.."

die() { echo "gateway-gpu.sh: $*" >&2; exit 2; }
[ $# -eq 2 ] || die "usage: bash lab/device/gateway-gpu.sh LLAMA_SERVER|build MODEL.gguf|w1"
SERVER=$1 MODEL=$2
[ "$SERVER" = build ] || { [ -x "$SERVER" ] && [ -f "$SERVER" ]; } ||
  die "llama-server: $SERVER is not an executable file"
[ "$MODEL" = w1 ] || [ -f "$MODEL" ] || die "model: $MODEL is not a file"
OUT=${OUT:-./gateway-gpu-out}
STREAMS=${STREAMS:-1,4,16} ROUNDS=${ROUNDS:-10} REQUESTS=${REQUESTS:-${MIN_SAMPLES:-48}} MAX_TOKENS=${MAX_TOKENS:-64}
NGL=${NGL:-99} THREADS=${THREADS:-8} MEASURE_SECONDS=${MEASURE_SECONDS:-480}
[ -z "${BUNDLE:-}" ] && [ -f .devbundle/on-device.sh ] && BUNDLE=.devbundle
for v in ROUNDS REQUESTS MAX_TOKENS NGL THREADS MEASURE_SECONDS; do
  [[ ${!v} =~ ^[0-9]+$ ]] || die "$v: ${!v} is not a whole number"
done
[[ $STREAMS =~ ^[0-9]+(,[0-9]+)*$ ]] || die "STREAMS: $STREAMS is not a list like 1,4,16"
PY=${PYTHON:-python3}

if ! "$PY" -c 'import ray' 2>/dev/null; then
  [ -n "${BUNDLE:-}" ] || die "Ray is not importable: set BUNDLE to the folder make-bundle.sh made (or install Ray)"
  [ -f "$BUNDLE/on-device.sh" ] || die "BUNDLE: $BUNDLE/on-device.sh is missing"
  # shellcheck disable=SC1091
  source "$BUNDLE/on-device.sh" "$BUNDLE"
  "$PY" -c 'import ray' 2>/dev/null || die "Ray is still not importable after sourcing $BUNDLE/on-device.sh"
fi
"$PY" -c 'import httptools, aiohttp, psutil' 2>/dev/null ||
  die "the gateway and the load generator need httptools, aiohttp and psutil (make-bundle.sh DIR httptools adds the first)"
"$PY" -c 'import orchestrator' 2>/dev/null || export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
mkdir -p "$OUT"

# the CUDA build and W1, side by side, when asked for
if [ "$SERVER" = build ]; then
  [ -f "${BUNDLE:-}/llama-src.tar.xz" ] ||
    die "build: ${BUNDLE:-BUNDLE}/llama-src.tar.xz is missing (the llama.cpp source to build)"
fi
if [ "$MODEL" = w1 ]; then
  MODEL=/root/work/models/qwen3-30b-a3b-q4_0.gguf
  if [ ! -f "$MODEL" ]; then
    mkdir -p "$(dirname "$MODEL")"
    ( time "$PY" -m orchestrator synth-model "$MODEL" --like qwen3-30b-a3b --quant q4_0 ) > "$OUT/synth.log" 2>&1 &
    SYNTH=$!
  fi
fi
if [ "$SERVER" = build ]; then
  export ORCHESTRATOR_CACHE=${ORCHESTRATOR_CACHE:-/root/.cache/orchestrator}
  ( time "$PY" -m orchestrator build --source "$BUNDLE/llama-src.tar.xz" --cuda --cuda-arch 90 --native -j 16 ) \
    > "$OUT/build.log" 2>&1 || die "the CUDA build failed: see $OUT/build.log"
  SERVER=$("$PY" -m orchestrator build --source "$BUNDLE/llama-src.tar.xz" --cuda --cuda-arch 90 --native -j 16 \
           2>/dev/null) || die "no CUDA llama-server after the build: see $OUT/build.log"
  echo "llama-server $SERVER (built: $(grep -E '^real' "$OUT/build.log" | tail -1))"
fi
if [ -n "${SYNTH:-}" ]; then
  wait "$SYNTH" || die "writing W1 failed: see $OUT/synth.log"
fi
[ -x "$SERVER" ] || die "llama-server: $SERVER is not an executable file"
[ -f "$MODEL" ] || die "model: $MODEL is not a file"

{
  echo "date $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  echo "host $(hostname) cpus $(nproc)"
  echo "llama-server $SERVER"
  "$SERVER" --version 2>&1 | head -4 || true
  echo "model $MODEL $(stat -c %s "$MODEL") bytes"
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.current,pcie.link.width.current \
      --format=csv,noheader || true
  else
    echo "no nvidia-smi: not a GPU machine"
  fi
} > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"

# the measurement: one deployment (llama-server with as many slots as the largest count), each count in turn
timeout "$MEASURE_SECONDS" "$PY" lab/bench/gateway_overhead.py --mode ray --binary "$SERVER" --model "$MODEL" \
  --ngl "$NGL" \
  --threads "$THREADS" --streams "$STREAMS" --rounds "$ROUNDS" --requests "$REQUESTS" \
  --max-tokens "$MAX_TOKENS" --out "$OUT/gateway-gpu.json" 2>&1 | tee "$OUT/gateway-gpu.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || die "the measurement failed: see $OUT/gateway-gpu.txt"

"$PY" - "$OUT/gateway-gpu.json" "$OUT/machine.txt" "$OUT/gateway-gpu-requests.csv" > "$OUT/gateway-gpu.md" <<'EOF'
import csv, json, sys

d = json.load(open(sys.argv[1]))
by = d.get("by_streams") or {str(d["streams"]): d}
commit = next((ln.split()[1] for ln in open(sys.argv[2]) if ln.startswith("commit ")), "?")
print("| streams | requests per path | TTFT median direct / gateway (added) | TTFT p95 direct / gateway (added) "
      "| TTFT p99 direct / gateway (added) | per token median direct / gateway (added) "
      "| per token p95 direct / gateway (added) | tokens/s lost |")
print("|---|---|---|---|---|---|---|---|")
for n, s in sorted(by.items(), key=lambda kv: int(kv[0])):
    def cell(key):
        a, b = s[key]["direct"], s[key]["gateway"]
        return f"{a:.2f} / {b:.2f} ms ({b - a:+.2f})"
    print(f"| {n} | {s['samples']['gateway']} | {cell('ttft_p50_ms')} | {cell('ttft_p95_ms')} | {cell('ttft_p99_ms')} "
          f"| {cell('per_token_p50_ms')} | {cell('per_token_p95_ms')} | {s['throughput_loss_pct']:+.1f}% |")
print(f"\n{d.get('max_tokens')} tokens per request, {d.get('mode')} mode, commit {commit}")
print("\nWhere the first token's time went (medians, ms): gateway (its Server-Timing: the end of the request to the "
      "replica) + llama-server's prompt + the wait for a slot and for the batch in progress (the replica's time to "
      "the head, which comes with the first token, less the prompt; straight to llama-server all but the prompt) + "
      "the relay (the request into the gateway, the first token back through it)\n")
print("| streams | path | requests | time to first token | gateway | prompt | slot/batch wait | relay "
      "| sent into the round |")
print("|---|---|---|---|---|---|---|---|---|")
fields = ["streams", "path", "round", "sent", "ttft", "total", "tokens", "gateway_ms", "replica_ms", "prompt_ms",
          "prompt_n", "predicted_ms"]
with open(sys.argv[3], "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
    w.writeheader()
    for n, s in sorted(by.items(), key=lambda kv: int(kv[0])):
        for path in ("direct", "gateway"):
            for part, label in (("all", "all"), ("slowest", "slowest 5%")):
                t = s["tail"][path][part]
                print(f"| {n} | {path} | {label} ({t['n']}) | {t['ttft_ms']:.2f} | {t['gateway_ms']:.2f} "
                      f"| {t['prompt_ms']:.2f} | {t['wait_ms']:.2f} | {t['relay_ms']:.2f} | {t['sent_ms']:.2f} |")
            for r in s["requests"][path]:
                w.writerow({"streams": n, "path": path, **r})
EOF
cat "$OUT/gateway-gpu.md"
