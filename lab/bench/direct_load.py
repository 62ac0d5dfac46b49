#!/usr/bin/env python3
"""llama-server's own load time: run worker 0 of `orchestrator plan --json` directly (its argv and environment),
time until /health answers 200, stop it. What `up` to ready is compared with.

  python3 lab/bench/direct_load.py PLAN.json [--repeat N] [--label TEXT]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("plan_json")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--label", default="", help="printed after 'llama-server alone'")
    a = ap.parse_args()
    with open(a.plan_json) as f:
        w = json.load(f)["workers"][0]
    for _ in range(a.repeat):
        t0 = time.monotonic()
        p = subprocess.Popen(w["argv"], env={**os.environ, **w["env"]}, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            while True:
                try:
                    if urllib.request.urlopen(f"http://{w['host']}:{w['port']}/health", timeout=2).status == 200:
                        break
                except OSError:
                    pass
                if p.poll() is not None:
                    print(f"llama-server exited {p.returncode}", file=sys.stderr)
                    return 1
                time.sleep(0.05)
            print(f"llama-server alone{a.label}: {time.monotonic() - t0:.1f} s to /health", flush=True)
        finally:
            if p.poll() is None:
                os.killpg(p.pid, 15)
            p.wait(timeout=60)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
