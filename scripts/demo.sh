#!/usr/bin/env bash
# The README's quick start: set up (see scripts/setup.sh), generate the small demo MoE model once,
# then bring up the demo topology (this machine, a local Ray head, one gateway on 127.0.0.1:8080).
# Ctrl-C stops everything it started. Extra arguments go to `orchestrator up`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
ORCH="${VENV:-.venv}/bin/orchestrator"
model=models/demo-moe.gguf
if [ ! -f "$model" ]; then
  mkdir -p models
  "$ORCH" synth-model "$model" --like qwen3-30b-a3b --scale 0.125 --quant q8_0
fi
exec "$ORCH" up topologies/demo.yaml "$@"
