#!/usr/bin/env bash
# `up` to ready with and without workers.early_start on the GPU machine (16 cores), with the CPU llama-server
# carried in .devcpu/ (see cpu-up.sh) and a 12-layer Qwen3-30B-A3B-shaped model read with --no-mmap (a load of
# seconds). carry [".devbundle", ".devcpu"]; ends itself after ${1:-240} s.
set -uo pipefail
source scripts/device/cpu-setup.sh early
python3 -m orchestrator synth-model models/q30-12l.gguf --like qwen3-30b-a3b --layers 12 > "$O/synth.log" 2>&1
log "model rc=$?"
timeout $(( ${1:-240} - $(date +%s) + t0 )) bash scripts/bench/up_ready.sh topologies/demo.yaml models/q30-12l.gguf 3 \
  --set workers.replicas=1 --set workers.load_mode=pinned --set nodes.0.gpus=none 2>&1 | tee "$O/up_ready.log"
log "done; left: llama-server $(pgrep -xc llama-server) keeper $(pgrep -fc '[o]rchestrator.cluster.keeper')"
