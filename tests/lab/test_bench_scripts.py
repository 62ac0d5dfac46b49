"""The lab's benchmark scripts still run against the current code (the numbers are for docs/benchmarks.md; here
only that each one runs end to end and prints its verdict)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def test_plan_speed_plans_deepseek_on_two_sockets_and_eight_gpus():
    res = subprocess.run([sys.executable, str(REPO / "lab" / "bench" / "plan_speed.py"), "--repeat", "2"],
                         capture_output=True, text=True, env=ENV, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "make_plan DeepSeek-V3 q4_0, 2 sockets x 8 GPUs, 2 runs: median" in res.stdout
    assert "expert layers in host memory" in res.stdout


@pytest.mark.integration
def test_gateway_overhead_against_a_stand_in_upstream():
    """The real gateway process in front of a stand-in upstream: both paths answered every request."""
    res = subprocess.run([sys.executable, str(REPO / "lab" / "bench" / "gateway_overhead.py"), "--mode", "fake",
                          "--rounds", "1"], capture_output=True, text=True, env=ENV, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "time to first token p50" in res.stdout and "gateway CPU per streamed chunk" in res.stdout
    assert "target p50 added <= 1 ms" in res.stdout


@pytest.mark.integration
def test_cache_miss_modes_counts_both_modes_on_the_rpc_device():
    res = subprocess.run([sys.executable, str(REPO / "lab" / "bench" / "cache_miss_modes.py"), "--tokens", "24"],
                         capture_output=True, text=True, env=ENV, timeout=600)
    assert res.returncode == 0, res.stderr
    rows = [ln for ln in res.stdout.splitlines() if "|" in ln][1:]
    assert len(rows) == 6
    for ln in rows:
        upload, cpu = (tuple(float(x) for x in col.split(" / ")) for col in ln.split("|")[1:])
        assert upload[1] == 0 and sum(upload) == pytest.approx(1, abs=2e-3)       # no CPU misses asked for
        assert sum(cpu) == pytest.approx(1, abs=2e-3) and cpu[2] <= upload[2]     # fewer uploads
