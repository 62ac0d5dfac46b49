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


def test_fit_cache_costs_gives_the_constants_the_plan_uses():
    """Fitted again on the committed H200 runs and the W1 profiles, the expert cache's costs are the ones in
    orchestrator/plan/rates.py (to their rounding): the constants stay tied to the data that produced them."""
    import re

    from orchestrator.plan import rates as R

    raw = REPO / "docs" / "benchmarks" / "h200-2026-12-01-w1-cache"
    runs = [str(p) for p in sorted(raw.glob("*.json.xz")) if not p.name.startswith("plan-")]
    fix = REPO / "tests" / "fixtures" / "routing"
    res = subprocess.run([sys.executable, str(REPO / "lab" / "bench" / "fit_cache_costs.py"), *runs,
                          "--profile", f"w1-loc-default={fix / 'w1-loc-default.profile.json.xz'}",
                          "--profile", f"w1-loc-high={fix / 'w1-loc-high.profile.json.xz'}"],
                         capture_output=True, text=True, env=ENV, timeout=300)
    assert res.returncode == 0, res.stderr
    m = re.search(r"fitted on 24 configurations: CACHE_UPLOAD_EFFICIENCY ([\d.]+), CACHE_LAYER_OVERHEAD_S ([\d.]+) us, "
                  r"CACHE_FIXED_S ([\d.]+) ms", res.stdout)
    assert m, res.stdout
    assert float(m.group(1)) == pytest.approx(R.CACHE_UPLOAD_EFFICIENCY, abs=0.005)
    assert float(m.group(2)) * 1e-6 == pytest.approx(R.CACHE_LAYER_OVERHEAD_S, abs=1e-6)
    assert float(m.group(3)) * 1e-3 == pytest.approx(R.CACHE_FIXED_S, abs=0.01e-3)
    worst = float(re.search(r"every cache configuration within ([\d.]+)%", res.stdout).group(1))
    assert worst < 8.0
    # the CPU-miss path as the patch runs it now: measured again (the runs above predate its split handling),
    # fitted on top of rates.py's upload constants, which these runs check out of sample
    revised = REPO / "docs" / "benchmarks" / "h200-2026-12-01-cache-rev"
    res = subprocess.run([sys.executable, str(REPO / "lab" / "bench" / "fit_cache_costs.py"),
                          *(str(revised / f"default-{b}g.json.xz") for b in (8, 12, 16)), "--upload", "current",
                          "--profile", f"w1-loc-default={fix / 'w1-loc-default.profile.json.xz'}"],
                         capture_output=True, text=True, env=ENV, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "not fitted: rates.py's constants, checked on 13 configurations" in res.stdout
    worst = float(re.search(r"current: every cache configuration within ([\d.]+)%", res.stdout).group(1))
    assert worst < 6.0
    m = re.search(r"fitted on 3: CACHE_CPU_MISS_FIXED_S ([\d.]+) ms, CACHE_CPU_MISS_HOP_S ([\d.]+) us", res.stdout)
    assert m, res.stdout
    assert float(m.group(1)) * 1e-3 == pytest.approx(R.CACHE_CPU_MISS_FIXED_S, abs=0.01e-3)
    assert float(m.group(2)) * 1e-6 == pytest.approx(R.CACHE_CPU_MISS_HOP_S, abs=1e-6)


def test_fit_prompt_costs_gives_the_constants_the_plan_uses():
    """Fitted again on the committed H200 workload runs (the first of the two), the prompt costs are the ones in
    orchestrator/plan/rates.py; the second run, shown against them, stays within 12% for the plans the default
    objective made (its balanced plans' 4096-token micro-batches are outside the fit, and not checked here)."""
    import re

    from orchestrator.plan import rates as R

    raw = REPO / "docs" / "benchmarks" / "h200-2026-12-03-workload"
    script = str(REPO / "lab" / "bench" / "fit_prompt_costs.py")
    first = [str(p) for p in sorted(raw.glob("w*.json.xz")) if not p.name.endswith("-b.json.xz")]
    res = subprocess.run([sys.executable, script, *first], capture_output=True, text=True, env=ENV, timeout=300)
    assert res.returncode == 0, res.stderr
    got = dict(re.findall(r"^(\w+) = ([\d.e-]+)$", res.stdout, re.M))
    assert float(got["GPU_PP_FLOPS_EFFICIENCY"]) == pytest.approx(R.GPU_PP_FLOPS_EFFICIENCY, abs=0.001)
    assert float(got["PP_LAYER_BATCH_S"]) == pytest.approx(R.PP_LAYER_BATCH_S, abs=1e-6)
    assert float(got["OFFLOAD_LAYER_BATCH_S"]) == pytest.approx(R.OFFLOAD_LAYER_BATCH_S, abs=1e-6)
    assert float(got["PREFILL_READ_OVERHEAD_S"]) == pytest.approx(R.PREFILL_READ_OVERHEAD_S, abs=0.1e-6)
    assert re.search(r"^22 points: largest error 0\.0\d\d", res.stdout, re.M), res.stdout
    second = [str(p) for p in sorted(raw.glob("w*-b.json.xz"))]
    res = subprocess.run([sys.executable, script, *second, "--current"], capture_output=True, text=True, env=ENV,
                         timeout=300)
    assert res.returncode == 0, res.stderr
    rows = [ln for ln in res.stdout.splitlines() if " pp" in ln and "/plan-balanced " not in ln]
    assert len(rows) >= 14
    for ln in rows:
        assert abs(float(ln.split()[-1])) <= 0.12, ln
