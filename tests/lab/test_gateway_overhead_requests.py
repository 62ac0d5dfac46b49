"""lab/bench/gateway_overhead.py keeps every request, with where its first token's time went, so a tail can be
explained: against the real CPU llama-server and the real gateway process (standalone mode)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.integration
def test_every_request_is_kept_with_the_gateways_and_llama_servers_share(tmp_path, llama_server_path):
    out = tmp_path / "gw.json"
    res = subprocess.run([sys.executable, str(REPO / "lab" / "bench" / "gateway_overhead.py"), "--mode", "standalone",
                          "--binary", llama_server_path, "--streams", "2", "--requests", "10", "--rounds", "1",
                          "--max-tokens", "4", "--threads", "1", "--embd", "64", "--layers", "2", "--out", str(out)],
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "time to first token p99" in res.stdout and "slowest 5%" in res.stdout
    d = json.loads(out.read_text())
    assert d["samples"] == {"direct": 10, "gateway": 10} and d["rounds"] == 5
    assert d["ttft_p99_ms"]["gateway"] >= d["ttft_p95_ms"]["gateway"]
    for path in ("direct", "gateway"):
        reqs = d["requests"][path]
        assert len(reqs) == 10 and all(r["tokens"] >= 4 and r["prompt_ms"] > 0 and r["ttft"] > 0 for r in reqs)
        assert {r["round"] for r in reqs} == set(range(5))
        slow = d["tail"][path]["slowest"]
        assert slow["n"] == 1 and slow["ttft_ms"] == pytest.approx(max(r["ttft"] for r in reqs), abs=1e-3)
    # the gateway's and the replica's parts (Server-Timing) fall within the first token's time the client saw
    assert all(0 <= r["gateway_ms"] and 0 <= r["replica_ms"] and r["gateway_ms"] + r["replica_ms"] <= r["ttft"]
               for r in d["requests"]["gateway"])
    assert not any("gateway_ms" in r for r in d["requests"]["direct"])
