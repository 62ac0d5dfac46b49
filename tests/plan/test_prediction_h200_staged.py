"""Prompts staged by the expert cache (``--moe-cache-prefill-ahead``) against what the H200 measured
(docs/benchmarks/h200-2026-12-03-staged: W1 at 12 GiB, the plan's cache without staging, its A/A control, and the
same cache with two and three staging buffers, interleaved in one run).

The plan's placement and cache are replanned as they ran (their argv), on the recorded H200 as the run saw it, with
the routing profile traced for W1 in the workload run before. rates.PREFILL_STAGED_OVERLAP was fitted on these
runs (lab/bench/fit_staged_overlap.py): this checks that the planner's own path carries the fit and that it chooses
the staging that ran faster, not that it predicts unseen runs.
"""

from __future__ import annotations

import dataclasses
import statistics
from pathlib import Path

import pytest
from planfixtures import backend
from test_prediction_h200_prompts import _curve, _run
from test_prediction_h200_workload import _replan, h200  # noqa: F401 (h200: the fixture)

from orchestrator.launch.llama_args import parse_server_args, server_args

ROOT = Path(__file__).resolve().parents[2]
RUN = ROOT / "docs" / "benchmarks" / "h200-2026-12-03-staged"
STAGING = frozenset({"moe_cache_slots", "moe_cache_prefill_ahead"})


def _argv(w) -> tuple[str, ...]:
    b = backend("mainline")
    b = dataclasses.replace(b, features=b.features | {"moe_cache", "moe_cache_prefill"} | STAGING)
    return server_args(w.settings, b)


def _measured(config: str) -> tuple[dict, dict]:
    bench, run = _run(RUN, "w1-12g", config)
    return bench, run


def _speeds(run: dict) -> tuple[dict, float]:
    return ({s["n"]: s["tps"] for s in run["samples"]["pp"]}, statistics.median(s["tps"] for s in run["samples"]["tg"]))


def test_the_plan_stages_prompts_and_predicts_them(models, h200):
    bench, plan_run = _measured("plan")
    w = _replan(models, h200, bench, plan_run, "w1", curve=_curve("w1"), features=STAGING)
    assert w.settings.moe_cache_prefill_ahead == 2
    argv = _argv(w)
    assert argv[argv.index("--moe-cache-prefill-ahead") + 1] == "2"
    assert parse_server_args(argv).moe_cache_prefill_ahead == 2
    _bench, ahead = _measured("plan-ahead2")
    pp, tg = _speeds(ahead)
    for n in (512, 4096):
        assert w.predicted.pp[n] / pp[n] == pytest.approx(1.0, abs=0.1), (n, w.predicted.pp[n], pp[n])
    assert w.predicted.tg / tg == pytest.approx(1.0, abs=0.1), (w.predicted.tg, tg)
    decision = next(d for d in w.decisions if d.what == "expert cache")
    assert "prompts staged: 2 buffers" in decision.why


def test_staging_off_predicts_the_unstaged_plan(models, h200):
    bench, plan_run = _measured("plan")
    on = _replan(models, h200, bench, plan_run, "w1", curve=_curve("w1"), features=STAGING)
    off = _replan(models, h200, bench, plan_run, "w1", curve=_curve("w1"), features=STAGING,
                  expert_cache_staging="off")
    assert off.settings.moe_cache_prefill_ahead == 0 and "--moe-cache-prefill-ahead" not in _argv(off)
    for config in ("plan", "plan-control"):
        pp, tg = _speeds(_measured(config)[1])
        for n in (512, 4096):
            assert off.predicted.pp[n] / pp[n] == pytest.approx(1.0, abs=0.1), (config, n, off.predicted.pp[n])
        assert off.predicted.tg / tg == pytest.approx(1.0, abs=0.1)
    # the buffers' slots cost generation a little; staging wins the prompts by more than the A/A spread
    assert 0.97 <= on.predicted.tg / off.predicted.tg < 1.0
    assert on.predicted.pp[512] / off.predicted.pp[512] > 1.15
    assert on.predicted.pp[4096] / off.predicted.pp[4096] > 1.2

