#!/usr/bin/env bash
# `up` to ready and the gateway's overhead on the GPU machine with a CPU llama-server (no CUDA build needed: a
# session with too little device time left for the 5-minute CUDA build can still time `up` on that machine).
# The CPU build travels xz-compressed in .devcpu/ (carry [".devbundle", ".devcpu"]):
#   mkdir -p .devcpu && xz -c ~/.cache/orchestrator/llama.cpp/mainline-cpu-*/bin/llama-server > .devcpu/llama-server.xz
#   bash scripts/device/cpu-up.sh          # on the device
set -uo pipefail
source scripts/device/cpu-setup.sh cpu
python3 -m orchestrator synth-model models/demo-moe.gguf --like qwen3-30b-a3b --scale 0.125 --quant q8_0 \
  > "$O/synth.log" 2>&1; log "demo model rc=$?"
for run in 1 2; do
  timeout 100 bash scripts/device/up-proof.sh topologies/demo.yaml models/demo-moe.gguf "$O/up$run" \
    --set nodes.0.gpus=none > "$O/up-proof-$run.log" 2>&1
  log "up-proof $run rc=$?"; grep -E "direct_load|ready in|left:" "$O/up-proof-$run.log"
done
for n in 1 4; do
  timeout 60 python3 scripts/bench/gateway_overhead.py --mode ray --rounds 8 --gateway-processes $n --json \
    > "$O/gateway-$n.txt" 2>&1; log "gateway, $n process(es)"; tail -2 "$O/gateway-$n.txt" | cut -c1-300
done
