#!/usr/bin/env bash
# Gateway overhead on the GPU machine's 16 cores without a CUDA build (carry .devbundle and .devcpu):
#  1. `--mode ray` twice: `up`'s real path (Ray, the worker actor, the gateway actor) in front of the CPU
#     llama-server of .devcpu/ serving the small generated llama (-t 8, leaving cores to the gateway and the client);
#  2. `--mode fake` twice, interleaved: this gateway, and another gateway.py given as OLD (e.g. the aiohttp one,
#     `git show ae6ef30:orchestrator/cluster/gateway.py > old_gateway.py`, placed in the working tree).
#   bash scripts/device/gateway-cpu.sh [OLD_GATEWAY.py]
source scripts/device/cpu-setup.sh gateway
OLD=${1:-}
for i in 1 2; do
  log "ray mode, run $i"
  timeout 70 python3 scripts/bench/gateway_overhead.py --mode ray --rounds 20 --threads 8 --json > "$O/ray-$i.txt" 2>&1
  grep -v '^{' "$O/ray-$i.txt" | tail -10
done
for i in 1 2; do
  for v in new ${OLD:+old}; do
    log "stand-in upstream, $v gateway, run $i"
    cmd=()
    [ "$v" = old ] && cmd=(--gateway-cmd "python3 $OLD --port {port} --replica bench={upstream}")
    timeout 40 python3 scripts/bench/gateway_overhead.py --mode fake --rounds 12 "${cmd[@]}" --json \
      > "$O/fake-$v-$i.txt" 2>&1
    grep -E 'first token p50|total p50|tokens/s|CPU' "$O/fake-$v-$i.txt"
  done
done
log done
