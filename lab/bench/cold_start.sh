#!/usr/bin/env bash
# `up` to ready from a cold page cache, with and without workers.prefetch (workers.early_start off: with it, up
# starts llama-server itself while Ray starts and skips the prefetch), against llama-server's own cold load.
# The model file is evicted from the page cache before every start (POSIX_FADV_DONTNEED, no root needed).
#   bash lab/bench/cold_start.sh TOPOLOGY MODEL.gguf [ROUNDS] [--set KEY=VALUE ...]
set -uo pipefail
TOPO=$1 MODEL=$2 ROUNDS=${3:-2}
shift $(( $# >= 3 ? 3 : $# ))
sets=(--set "model.path=$MODEL" "$@")
orch() { python3 -m orchestrator "$@"; }
evict() { python3 -c "import os,sys; fd=os.open(sys.argv[1], os.O_RDONLY); os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)" "$MODEL"; }
secs() { python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.1f}')" "$1" "$(date +%s.%N)"; }
plan=$(mktemp)
orch plan "$TOPO" "${sets[@]}" --json > "$plan" || exit 1
evict
python3 lab/bench/direct_load.py "$plan" --label ", cold" || exit 1
for r in $(seq 1 "$ROUNDS"); do
  for pf in false true; do
    evict
    t=$(date +%s.%N)
    out=$(orch up "$TOPO" "${sets[@]}" --set "workers.prefetch=$pf" --set workers.early_start=false --detach 2>&1)
    rc=$?
    echo "round $r prefetch=$pf: up rc=$rc, ready after $(secs "$t") s -- $(grep -o 'ready in.*loaded in [0-9.]*s' <<< "$out" | head -1)"
    orch down > /dev/null 2>&1
  done
done
rm -f "$plan"
