#!/usr/bin/env bash
# What the gateway adds in front of a CUDA llama-server: time to first token (median, p95) and time per token
# after the first (median, p95) at 1, 4 and 16 concurrent streams, straight to llama-server and through the
# gateway actor that `orchestrator up` runs under Ray, interleaved round by round on one llama-server. One command
# does the whole measurement; everything lands under $OUT.
#
#   bash lab/device/gateway-gpu.sh LLAMA_SERVER MODEL.gguf
#
# Environment (defaults): OUT (./gateway-gpu-out), STREAMS (1,4,16), ROUNDS (10), MIN_SAMPLES (48 requests per
# path and stream count), MAX_TOKENS (64), NGL (99: every layer on the GPU), THREADS (8), BUNDLE (a folder made by
# ../shared/device/make-bundle.sh: its on-device.sh is sourced when Ray is not importable, as on the H200).
# Writes: gateway-gpu.json (every number, per stream count), gateway-gpu.txt (the printed report),
# gateway-gpu.md (the rows for docs/benchmarks.md), machine.txt (GPU, driver, commit).
set -euo pipefail
cd "$(dirname "$0")/../.."

die() { echo "gateway-gpu.sh: $*" >&2; exit 2; }
[ $# -eq 2 ] || die "usage: bash lab/device/gateway-gpu.sh LLAMA_SERVER MODEL.gguf"
SERVER=$1 MODEL=$2
[ -x "$SERVER" ] && [ -f "$SERVER" ] || die "llama-server: $SERVER is not an executable file"
[ -f "$MODEL" ] || die "model: $MODEL is not a file"
OUT=${OUT:-./gateway-gpu-out}
STREAMS=${STREAMS:-1,4,16} ROUNDS=${ROUNDS:-10} MIN_SAMPLES=${MIN_SAMPLES:-48} MAX_TOKENS=${MAX_TOKENS:-64}
NGL=${NGL:-99} THREADS=${THREADS:-8}
for v in ROUNDS MIN_SAMPLES MAX_TOKENS NGL THREADS; do
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
"$PY" lab/bench/gateway_overhead.py --mode ray --binary "$SERVER" --model "$MODEL" --ngl "$NGL" \
  --threads "$THREADS" --streams "$STREAMS" --rounds "$ROUNDS" --min-samples "$MIN_SAMPLES" \
  --max-tokens "$MAX_TOKENS" --out "$OUT/gateway-gpu.json" 2>&1 | tee "$OUT/gateway-gpu.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || die "the measurement failed: see $OUT/gateway-gpu.txt"

"$PY" - "$OUT/gateway-gpu.json" "$OUT/machine.txt" > "$OUT/gateway-gpu.md" <<'EOF'
import json, sys

d = json.load(open(sys.argv[1]))
by = d.get("by_streams") or {str(d["streams"]): d}
commit = next((ln.split()[1] for ln in open(sys.argv[2]) if ln.startswith("commit ")), "?")
print("| streams | TTFT median direct / gateway (added) | TTFT p95 direct / gateway (added) "
      "| per token median direct / gateway (added) | per token p95 direct / gateway (added) | tokens/s lost |")
print("|---|---|---|---|---|---|")
for n, s in sorted(by.items(), key=lambda kv: int(kv[0])):
    def cell(key):
        a, b = s[key]["direct"], s[key]["gateway"]
        return f"{a:.2f} / {b:.2f} ms ({b - a:+.2f})"
    print(f"| {n} | {cell('ttft_p50_ms')} | {cell('ttft_p95_ms')} | {cell('per_token_p50_ms')} "
          f"| {cell('per_token_p95_ms')} | {s['throughput_loss_pct']:+.1f}% |")
print(f"\n{d.get('max_tokens')} tokens per request, {d.get('mode')} mode, commit {commit}")
EOF
cat "$OUT/gateway-gpu.md"
