#!/usr/bin/env bash
# `up` to ready with and without workers.early_start (llama-server started while Ray starts, then adopted), against
# llama-server's own load of the same argv; the model stays in the page cache (read once first). Interleaved.
#   bash lab/bench/up_ready.sh TOPOLOGY MODEL.gguf [ROUNDS] [--set KEY=VALUE ...]
set -uo pipefail
TOPO=$1 MODEL=$2 ROUNDS=${3:-2}
shift $(( $# >= 3 ? 3 : $# ))
sets=(--set "model.path=$MODEL" "$@")
orch() { python3 -m orchestrator "$@"; }
secs() { python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.1f}')" "$1" "$(date +%s.%N)"; }
plan=$(mktemp)
orch plan "$TOPO" "${sets[@]}" --json > "$plan" || exit 1
cat "$MODEL" > /dev/null
python3 lab/bench/direct_load.py "$plan" --repeat 2 || exit 1
for r in $(seq 1 "$ROUNDS"); do
  for es in false true; do
    t=$(date +%s.%N)
    out=$(orch up "$TOPO" "${sets[@]}" --set "workers.early_start=$es" --detach 2>&1)
    rc=$?
    echo "round $r early_start=$es: up rc=$rc, ready after $(secs "$t") s -- $(grep -o 'ready in.*s):' <<< "$out" | head -1)"
    orch down > /dev/null 2>&1
  done
done
rm -f "$plan"
