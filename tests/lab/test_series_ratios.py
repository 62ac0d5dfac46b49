"""lab/bench/series_ratios.py: new over old and the A/A control per interleaved round, from a bench's runs."""

import json
import lzma
from pathlib import Path

import pytest

from lab.bench import series_ratios

REPO = Path(__file__).resolve().parents[2]


def _run(config, rnd, pp512, pp4096, tg, status="ok"):
    return {"config": config, "round": rnd, "status": status,
            "samples": {"pp": [{"n": 512, "tps": pp512}, {"n": 4096, "tps": pp4096}],
                        "tg": [{"depth": 0, "tps": tg}, {"depth": 0, "tps": tg * 1.02}]}}


def test_ratios_are_taken_round_by_round():
    doc = {"runs": [_run("plan", 1, 100, 50, 10), _run("new", 1, 110, 50, 10), _run("plan-control", 1, 100, 50, 10),
                    _run("plan", 2, 200, 50, 10), _run("new", 2, 200, 55, 10), _run("plan-control", 2, 190, 50, 10),
                    _run("plan", 3, 1, 1, 1), _run("new", 3, 1, 1, 1, status="failed")]}
    r = series_ratios.ratios(doc)
    assert r["pp512"]["rounds"] == 2                      # round 3 lost its new run: left out
    assert r["pp512"]["new_over_old"] == pytest.approx((1.05, 1.0, 1.1))
    assert r["pp512"]["control_over_old"] == pytest.approx((0.975, 0.95, 1.0))
    assert r["pp4096"]["new_over_old"] == pytest.approx((1.05, 1.0, 1.1))
    assert r["tg128"]["new"] == pytest.approx(10.1)       # the median of a run's generation samples


def test_a_bench_without_a_full_round_is_refused():
    with pytest.raises(SystemExit, match="no round"):
        series_ratios.ratios({"runs": [_run("plan", 1, 1, 1, 1), _run("new", 1, 1, 1, 1)]})


def test_the_recorded_comparison_reads(capsys):
    path = REPO / "docs/benchmarks/h200-2026-12-04-series/w2-24g.json.xz"
    assert series_ratios.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "new/old" in out and "A/A" in out
    doc = json.loads(lzma.open(path).read())
    assert series_ratios.ratios(doc)["tg128"]["rounds"] == 2
