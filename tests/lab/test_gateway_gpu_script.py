"""lab/device/gateway-gpu.sh, the GPU machine's gateway measurement, run here end to end against the CPU
llama-server and a tiny model (Ray is importable here, so no bundle): it writes the JSON, the report and the rows
for docs/benchmarks.md under $OUT, with each stream count measured on both paths. Bad arguments are one line and
exit status 2, before anything starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "lab" / "device" / "gateway-gpu.sh"
sys.path.insert(0, str(REPO / "tests"))
from tiny_llama import write_tiny_llama  # noqa: E402


def test_the_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


@pytest.mark.parametrize("args,env,why", [
    ([], {}, "usage: bash lab/device/gateway-gpu.sh LLAMA_SERVER|build MODEL.gguf|w1"),
    (["/nonexistent/llama-server", "m.gguf"], {}, "is not an executable file"),
    (["SERVER", "/nonexistent/m.gguf"], {}, "model: /nonexistent/m.gguf is not a file"),
    (["SERVER", "MODEL"], {"STREAMS": "1;rm -rf /"}, "STREAMS: 1;rm -rf / is not a list like 1,4,16"),
    (["SERVER", "MODEL"], {"ROUNDS": "ten"}, "ROUNDS: ten is not a whole number"),
])
def test_bad_arguments_are_one_line_and_exit_2(tmp_path, llama_server_path, args, env, why):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    args = [llama_server_path if a == "SERVER" else str(model) if a == "MODEL" else a for a in args]
    res = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True,
                         env={**os.environ, "OUT": str(tmp_path / "out"), **env}, timeout=60)
    assert res.returncode == 2 and res.stderr.strip().count("\n") == 0 and why in res.stderr, res.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.integration
@pytest.mark.slow
def test_it_measures_gateway_and_direct_per_stream_count(tmp_path, llama_server_path):
    model = write_tiny_llama(tmp_path / "tiny.gguf")
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "STREAMS": "1,4", "ROUNDS": "1", "MIN_SAMPLES": "4", "MAX_TOKENS": "8",
           "NGL": "0", "THREADS": "1", "PYTHON": sys.executable, "PYTHONPATH": str(REPO), "ORCHESTRATOR_STATE": str(tmp_path / "state")}
    res = subprocess.run(["bash", str(SCRIPT), llama_server_path, str(model)], capture_output=True, text=True,
                         env=env, timeout=400)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    d = json.loads((out / "gateway-gpu.json").read_text())
    assert d["mode"] == "ray" and set(d["by_streams"]) == {"1", "4"}
    for n, s in d["by_streams"].items():
        assert s["samples"] == {"direct": max(4, int(n)), "gateway": max(4, int(n))}
        for key in ("ttft_p50_ms", "ttft_p95_ms", "per_token_p50_ms", "per_token_p95_ms"):
            assert 0 < s[key]["direct"] < 10_000 and 0 < s[key]["gateway"] < 10_000
    md = (out / "gateway-gpu.md").read_text()
    summary = md.split("\n\n")[0]                     # the first table: one row per stream count
    rows = [ln.split(" | ")[0] for ln in summary.splitlines() if ln[:3] in ("| 1", "| 4")]
    assert rows == ["| 1", "| 4"] and md.startswith("| streams | requests per path | TTFT median")
    # then where the first token's time went: both paths at each stream count, all requests and the slowest 5%
    split = [ln.split(" | ")[:2] for ln in md.splitlines() if ln.startswith(("| 1 | ", "| 4 | "))][2:]
    assert {tuple(r) for r in split} == {(f"| {n}", p) for n in (1, 4) for p in ("direct", "gateway")}
    assert "time to first token p95" in (out / "gateway-gpu.txt").read_text()
    assert "llama-server" in (out / "machine.txt").read_text()
