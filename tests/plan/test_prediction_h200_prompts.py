"""Prompt speed and time to first token against what the H200 measured with the expert cache's prefill moves
(docs/benchmarks/h200-2026-12-03-workload: the patch series through 0007, slots assigned on the device).

Each plan run is replanned with the placement, cache and micro-batch it ran (its argv), on the recorded H200 as the
run saw it (its budget free, its probe's bandwidth) and with the routing profile traced for its model. The prompt
constants of plan/rates.py were fitted on these runs (lab/bench/fit_prompt_costs.py), so this checks that the
planner's own code path carries the fit, not that it predicts unseen runs; the second run of the same plans (NAME-b)
and the 2026-12-02 runs' prompts without slot reads (test_no_cache_prompts_of_the_earlier_runs) are out of sample.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
from test_prediction_h200_workload import _replan, _xz_json, h200  # noqa: F401 (h200: the fixture)
from test_prediction_h200_workload import _curve as _workload_curve

ROOT = Path(__file__).resolve().parents[2]
RUN = ROOT / "docs" / "benchmarks" / "h200-2026-12-03-workload"
EARLIER = ROOT / "docs" / "benchmarks" / "h200-2026-12-02-workload"
DEVICE_SLOTS = frozenset({"expert_cache_slots"})


def _curve(model: str):
    return _workload_curve(model, RUN)


def _run(directory: Path, name: str, config: str = "plan") -> tuple[dict, dict]:
    bench = _xz_json(directory / f"{name}.json.xz")
    return bench, next(r for r in bench["runs"] if r["config"] == config and r["status"] == "ok")


# NAME-b: the second run of the same plans, made by the planner with these constants (out of sample)
@pytest.mark.parametrize("name, model", [("w1-12g", "w1"), ("w1-8g", "w1"), ("w1-16g", "w1"), ("w2-24g", "w2"),
                                         ("w1-12g-b", "w1"), ("w1-8g-b", "w1"), ("w1-16g-b", "w1"),
                                         ("w2-24g-b", "w2")])
def test_prompts_and_time_to_first_token(models, h200, name, model):
    bench, run = _run(RUN, name)
    w = _replan(models, h200, bench, run, model, curve=_curve(model), features=DEVICE_SLOTS)
    tg = statistics.median(s["tps"] for s in run["samples"]["tg"])
    pp = {s["n"]: s["tps"] for s in run["samples"]["pp"]}
    for n in (512, 4096):
        assert w.predicted.pp[n] / pp[n] == pytest.approx(1.0, abs=0.15), (n, w.predicted.pp[n], pp[n])
        # time to first token: the prompt, then one step
        ttft = n / pp[n] + 1 / tg
        assert w.predicted.ttft(n) / ttft == pytest.approx(1.0, abs=0.15), (n, w.predicted.ttft(n), ttft)
    assert w.predicted.tg / tg == pytest.approx(1.0, abs=0.15), (w.predicted.tg, tg)
    print(f"{name}: pp512 {w.predicted.pp[512]:.0f} / {pp[512]:.0f}; pp4096 {w.predicted.pp[4096]:.0f} / "
          f"{pp[4096]:.0f}; ttft512 {w.predicted.ttft(512) * 1e3:.0f} / {(512 / pp[512] + 1 / tg) * 1e3:.0f} ms; "
          f"tg {w.predicted.tg:.1f} / {tg:.1f}")


@pytest.mark.parametrize("name", ["w1-12g-4streams", "w1-12g-4streams-b"])
def test_four_streams_prompt_and_aggregate(models, h200, name):
    bench, run = _run(RUN, name)
    w = _replan(models, h200, bench, run, "w1", curve=_curve("w1"), features=DEVICE_SLOTS)
    pp = {s["n"]: s["tps"] for s in run["samples"]["pp"]}
    agg = statistics.median(r["tps"] for r in run["samples"]["tg_streams"]["4"]["runs"])
    assert w.predicted.streams == 4
    assert w.predicted.pp[512] / pp[512] == pytest.approx(1.0, abs=0.15), (w.predicted.pp[512], pp[512])
    assert w.predicted.tg_streams / agg == pytest.approx(1.0, abs=0.15), (w.predicted.tg_streams, agg)


@pytest.mark.parametrize("name, model", [("w1-12g", "w1"), ("w1-8g", "w1"), ("w1-16g", "w1"), ("w2-24g", "w2")])
def test_no_cache_prompts_of_the_earlier_runs(models, h200, name, model):
    """The 2026-12-02 plans with the prefill's slot reads off: the same placement and micro-batch, every expert a
    batch uses copied, so the prompt model's copy, layer and compute terms are checked out of sample."""
    bench, run = _run(EARLIER, name, "plan-prefill-off")
    w = _replan(models, h200, bench, run, model, curve=_curve(model), features=DEVICE_SLOTS,
                without=frozenset({"expert_cache_slot_reads"}))
    pp = {s["n"]: s["tps"] for s in run["samples"]["pp"]}
    for n in (512, 4096):
        assert w.predicted.pp[n] / pp[n] == pytest.approx(1.0, abs=0.15), (n, w.predicted.pp[n], pp[n])
