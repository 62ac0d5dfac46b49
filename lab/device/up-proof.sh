#!/usr/bin/env bash
# The single-node proof of `orchestrator up` on a real machine (the H200 run uses it; it works on any machine):
# up -> completion through the gateway (plain and streamed) -> status -> metrics on Ray's Prometheus endpoint ->
# kill -9 of the llama-server -> serving again -> down -> no llama-server, gateway or Ray process left.
# Also times llama-server's own load (the planned argv run directly) against `up` to ready.
#   bash lab/device/up-proof.sh TOPOLOGY MODEL.gguf OUTDIR [--set KEY=VALUE ...]
set -uo pipefail
TOPO=$1 MODEL=$2 O=$3
shift 3
mkdir -p "$O"
orch() { python3 -m orchestrator "$@"; }
now() { date +%s.%N; }
el() { python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.1f}')" "$1" "$(now)"; }
sets=(--set "model.path=$MODEL" "$@")
GW=http://127.0.0.1:8080

echo "== llama-server alone (the planned argv), time to /health"
orch plan "$TOPO" "${sets[@]}" --json > "$O/up-plan.json"
python3 - "$O/up-plan.json" > "$O/direct-load.txt" 2>&1 <<'EOF'
import json, os, subprocess, sys, time, urllib.request
w = json.load(open(sys.argv[1]))["workers"][0]
env = {**os.environ, **w["env"]}
t0 = time.monotonic()
p = subprocess.Popen(w["argv"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
url = f"http://{w['host']}:{w['port']}/health"
while True:
    try:
        if urllib.request.urlopen(url, timeout=2).status == 200:
            break
    except Exception:
        pass
    if p.poll() is not None:
        print("direct llama-server exited", p.returncode); break
    time.sleep(0.1)
print(f"direct_load_s {time.monotonic() - t0:.2f}")
os.killpg(p.pid, 15); p.wait(timeout=30)
EOF
cat "$O/direct-load.txt"

echo "== up"
t=$(now)
orch up "$TOPO" "${sets[@]}" --detach > "$O/up.out" 2>&1
echo "up rc=$? ready_after_s $(el "$t")"
tail -5 "$O/up.out"
orch status > "$O/status.txt" 2>&1; orch status --json > "$O/status.json" 2>&1
cat "$O/status.txt"

echo "== gateway"
curl -s "$GW/v1/models" | tee "$O/models.json"; echo
MODEL_ID=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['data'][0]['id'])" "$O/models.json")
curl -s "$GW/v1/completions" -H 'Content-Type: application/json' \
  -d "{\"model\": \"$MODEL_ID\", \"prompt\": \"The capital of France is\", \"max_tokens\": 16}" | tee "$O/completion.json"; echo
curl -sN "$GW/v1/chat/completions" -H 'Content-Type: application/json' \
  -d "{\"model\": \"$MODEL_ID\", \"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"max_tokens\": 16, \"stream\": true}" \
  > "$O/stream.txt"; echo "stream events: $(grep -c '^data:' "$O/stream.txt")"; tail -2 "$O/stream.txt"
nvidia-smi --query-gpu=memory.used,utilization.gpu,temperature.gpu,power.draw --format=csv > "$O/nvidia-smi.csv" 2>&1

echo "== metrics (Ray's Prometheus endpoint)"
MURL=$(python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(d.get('metrics_url') or d.get('cluster',{}).get('metrics_url',''))" "$O/status.json" 2>/dev/null)
sleep 12
curl -s "$MURL" | grep -i "orchestrator" > "$O/metrics.txt"; echo "metric lines: $(wc -l < "$O/metrics.txt") from $MURL"
head -20 "$O/metrics.txt"

echo "== kill -9 llama-server, serving again"
PID=$(pgrep -x llama-server | head -1)      # by process name: a command line that mentions llama-server is not one
kill -9 "$PID"; t=$(now)
for i in $(seq 1 300); do
  code=$(curl -s -o /dev/null -w '%{http_code}' "$GW/v1/completions" -H 'Content-Type: application/json' \
    -d "{\"model\": \"$MODEL_ID\", \"prompt\": \"x\", \"max_tokens\": 1}")
  [ "$code" = 200 ] && { echo "serving again after $(el "$t") s"; break; }
  sleep 0.2
done
orch status > "$O/status-after-kill.txt" 2>&1; cat "$O/status-after-kill.txt"

echo "== down"
orch down > "$O/down.out" 2>&1; echo "down rc=$?"; cat "$O/down.out"
sleep 2
echo "left: llama-server $(pgrep -xc llama-server || true), raylet $(pgrep -xc raylet || true), gcs $(pgrep -xc gcs_server || true)"
