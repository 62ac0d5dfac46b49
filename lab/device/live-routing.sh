#!/usr/bin/env bash
# The live routing profile through a real deployment on one machine (the H200 run uses it; it works on any
# machine with a cached plan): `up` with workers.live_routing on -> requests through the gateway one at a time,
# then four at once -> the cache's live hit rate in each phase (llama-server's own counters) and `status`'s line
# beside the plan's predicted one- and four-stream hit rates -> `down`, whose last harvest caches the served
# routing as the model's profile -> the plan again, now sized from what was served.
#   bash lab/device/live-routing.sh TOPOLOGY MODEL.gguf OUTDIR [--set KEY=VALUE ...]
# LIVE_TOKENS (default 256) tokens per request, LIVE_ONE (default 6) requests one at a time, LIVE_ROUNDS (default
# 2) rounds of four at once.
set -uo pipefail
TOPO=$1 MODEL=$2 O=$3
shift 3
mkdir -p "$O"
orch() { python3 -m orchestrator "$@"; }
sets=(--set "model.path=$MODEL" --set workers.live_routing=on "$@")

orch plan "$TOPO" "${sets[@]}" > "$O/plan-before.txt" 2>&1
orch plan "$TOPO" "${sets[@]}" --json > "$O/plan-before.json" || { echo "plan failed"; cat "$O/plan-before.txt"; exit 1; }
echo "== up"
orch up "$TOPO" "${sets[@]}" --detach > "$O/up.out" 2>&1
rc=$?; echo "up rc=$rc"; tail -5 "$O/up.out"
[ $rc -eq 0 ] || exit 1

orch status --json > "$O/status-ready.json" 2>&1
MURL=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1])).get('metrics_url') or '')" "$O/status-ready.json")
python3 - "$O" "${LIVE_TOKENS:-256}" "${LIVE_ONE:-6}" "${LIVE_ROUNDS:-2}" "$MURL" <<'EOF'
import json, re, sys, threading, time, urllib.request

out, tokens, n_one, rounds, murl = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
plan = json.load(open(f"{out}/plan-before.json"))
w = plan["workers"][0]
gw = "http://127.0.0.1:8080"
model = json.loads(urllib.request.urlopen(gw + "/v1/models", timeout=10).read())["data"][0]["id"]
PROMPTS = ["Write a short letter to a friend about a trip to the mountains in autumn.",
           "Explain how a hash table handles collisions, with an example in Python.",
           "Summarise the causes of the French Revolution in five sentences.",
           "Was ist der Unterschied zwischen Wetter und Klima? Antworte kurz.",
           "def merge_sort(xs):\n    # sort a list and explain each step\n",
           "List three ways to make a small apartment feel larger, and why each works.",
           "Describe the water cycle to a ten-year-old.",
           "Translate into French: the train leaves at seven and arrives before noon."]

def read_counters():
    # the worker's llama-server answers only the gateway and the controller (its own key): its cache counters as
    # the controller exports them to Ray's metrics endpoint, summed over label sets
    page = urllib.request.urlopen(murl, timeout=10).read().decode()
    got = {}
    for k in ("lookups", "misses", "uploaded_bytes"):
        pat = re.compile(rf"^\w*orchestrator_worker_expert_cache_{k}(?:_total)?(?:{{[^}}]*}})?\s+(\S+)$", re.M)
        got[k] = sum(float(v) for v in pat.findall(page))
    got["hits"] = got["lookups"] - got["misses"]
    return got

def counters(before=None):
    # the controller samples the worker every few seconds and Ray exports after that: wait until the counters
    # have moved past `before` and hold still
    last, t0 = read_counters(), time.monotonic()
    while time.monotonic() - t0 < 60:
        time.sleep(4)
        cur = read_counters()
        if cur == last and (before is None or cur["lookups"] > before["lookups"]):
            return cur
        last = cur
    return last

def ask(i, res):
    body = {"model": model, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": tokens, "temperature": 1.0,
            "seed": i, "ignore_eos": True}
    req = urllib.request.Request(gw + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t = time.monotonic()
    r = json.loads(urllib.request.urlopen(req, timeout=600).read())
    res[i] = (r["usage"]["completion_tokens"], time.monotonic() - t)

def phase(name, batches):
    c0, t0, res = counters(), time.monotonic(), {}
    for batch in batches:
        th = [threading.Thread(target=ask, args=(i, res)) for i in batch]
        [t.start() for t in th]; [t.join() for t in th]
    c1 = counters(c0)
    d = {k: c1[k] - c0[k] for k in c0}
    n = sum(v[0] for v in res.values())
    return {"phase": name, "requests": len(res), "tokens": n, "seconds": round(time.monotonic() - t0, 2),
            "hit_rate": d["hits"] / d["lookups"] if d["lookups"] else None, "lookups": d["lookups"],
            "misses": d["misses"], "uploaded_mb_per_token": d["uploaded_bytes"] / max(n, 1) / 1e6}

phase("warm-up", [[100]])
one = phase("1 stream", [[i] for i in range(n_one)])
four = phase("4 streams", [list(range(10 + 4 * r, 14 + 4 * r)) for r in range(rounds)])
chosen = w["expert_cache"]["chosen"]
res = {"curve": w["expert_cache"].get("curve_source"), "predicted_1": chosen["hit_rate"], "predicted_streams": chosen.get("stream_hit_rate"),
       "streams": chosen.get("streams"), "phases": [one, four]}
json.dump(res, open(f"{out}/live.json", "w"), indent=2)
for p in (one, four):
    print(f"{p['phase']}: {p['tokens']} tokens in {p['seconds']} s, live hit rate {p['hit_rate']:.3f} "
          f"({p['lookups']:.0f} lookups), {p['uploaded_mb_per_token']:.1f} MB uploaded a token")
print(f"predicted: {chosen['hit_rate']:.3f} at 1 stream, {chosen.get('stream_hit_rate') or 0:.3f} at "
      f"{chosen.get('streams')} streams")
EOF
sleep 12    # a metrics sample after the traffic, for status's live line
orch status > "$O/status.txt" 2>&1; orch status --json > "$O/status.json" 2>&1
cat "$O/status.txt"
echo "== down"
orch down > "$O/down.out" 2>&1; echo "down rc=$?"; tail -3 "$O/down.out"
sleep 2
echo "left: llama-server $(pgrep -xc llama-server || true), raylet $(pgrep -xc raylet || true)"
echo "== the plan again, from the served routing"
orch model "$MODEL" > "$O/model-after.txt" 2>&1
orch plan "$TOPO" "${sets[@]}" > "$O/plan-after.txt" 2>&1
orch plan "$TOPO" "${sets[@]}" --json > "$O/plan-after.json"
python3 - "$O" <<'EOF'
import json, sys
out = sys.argv[1]
live = json.load(open(f"{out}/live.json"))
after = json.load(open(f"{out}/plan-after.json"))["workers"][0]["expert_cache"]
c = after.get("chosen") or {}
live["replanned_1"], live["replanned_streams"] = c.get("hit_rate"), c.get("stream_hit_rate")
live["replanned_curve"] = after.get("curve_source")
json.dump(live, open(f"{out}/live.json", "w"), indent=2)
one, four = (p["hit_rate"] for p in live["phases"])
print(f"curve before: {live['curve']}; after: {live['replanned_curve']}")
print(f"live 1 stream {one:.3f}: predicted {live['predicted_1']:.3f} ({100 * (one - live['predicted_1']):+.1f} points), "
      f"replanned from the served routing {c.get('hit_rate', 0):.3f}")
print(f"live 4 streams {four:.3f}: predicted {live['predicted_streams'] or 0:.3f} "
      f"({100 * (four - (live['predicted_streams'] or 0)):+.1f} points), replanned {c.get('stream_hit_rate') or 0:.3f}")
EOF
grep -iE "routing|profile" "$O/model-after.txt" | head -5
