"""Uploads ahead of need against what the H200 measured (docs/benchmarks/h200-2026-12-02-prefetch): W1 at 12 GiB,
the plan for four streams beside the same plan with ``--moe-cache-prefetch on``, in one run.

The run is replanned with the placement and cache it ran, on the recorded H200 with the run's own bandwidth and
routing profile, once with uploads ahead of need forced on and once off; the predicted ratio of the two must be
the measured one, at one stream and at four, and ``auto`` must choose what was faster.
"""

from __future__ import annotations

import statistics

import pytest
import test_prediction_h200_workload as W

from orchestrator.hardware.dump import load_machine
from orchestrator.model.routing_profile import RoutingProfile

RUN = W.ROOT / "docs" / "benchmarks" / "h200-2026-12-02-prefetch"
FIX = W.FIX
_xz_json = W._xz_json


@pytest.fixture(scope="module")
def bench():
    return _xz_json(RUN / "w1-12g-prefetch.json.xz")


def _tps(bench, config: str, streams: str) -> float:
    runs = [r for r in bench["runs"] if r["config"] == config and r["status"] == "ok"]
    return statistics.median(x["tps"] for r in runs for x in r["samples"]["tg_streams"][streams]["runs"])


def _replan(models, bench, prefetch: str):
    h200 = load_machine(FIX / "machines" / "h200.inspect.json")
    run = next(r for r in bench["runs"] if r["config"] == "plan")
    curve = RoutingProfile.from_json(_xz_json(RUN / "routing-w1-default.profile.json.xz")["profile"]).curve("lru-layer")
    return W._replan(models, h200, bench, run, "w1", curve=curve, features=frozenset({"expert_cache_prefetch"}),
                    expert_cache_prefetch=prefetch)


@pytest.mark.parametrize("streams", ["1", "4"])
def test_the_predicted_effect_of_uploads_ahead_is_the_measured_one(models, bench, streams):
    on, off = _replan(models, bench, "on"), _replan(models, bench, "off")
    assert on.settings.expert_cache_prefetch and not off.settings.expert_cache_prefetch
    pick = (lambda w: w.predicted.tg) if streams == "1" else (lambda w: w.predicted.tg_streams)
    predicted = pick(on) / pick(off)
    # the plan without them: its own start and its A/A control, both in the same run
    base = statistics.mean([_tps(bench, "plan", streams), _tps(bench, "plan-control", streams)])
    measured = _tps(bench, "plan-prefetch", streams) / base
    assert predicted == pytest.approx(measured, abs=0.06), (predicted, measured)
    print(f"{streams} stream(s): uploads ahead predicted {predicted:.3f}x, measured {measured:.3f}x")


def test_auto_keeps_uploads_ahead_off_where_they_measured_slower(models, bench):
    w = _replan(models, bench, "auto")
    assert not w.settings.expert_cache_prefetch
    assert "--moe-cache-prefetch" not in w.args
    c = w.expert_cache.chosen
    assert not c.prefetch and c.prefetch_gain < 1.0
    assert "uploads ahead of need off" in "\n".join(w.expert_cache.arithmetic())
    # and the counters of the run say why: most picks predicted, the hit rate up, the uploads doubled
    run = next(r for r in bench["runs"] if r["config"] == "plan-prefetch")
    mc = run["samples"]["tg_streams"]["1"]["moe_cache"]
    assert mc["prefetch_correct"] / mc["prefetch_predicted"] > 0.7
    assert mc["hits"] / mc["lookups"] > 0.95


@pytest.mark.parametrize("arch, features, asked, weighed", [
    ("qwen3moe", {"expert_cache_prefetch"}, "auto", "auto"),
    ("qwen3moe", {"expert_cache_prefetch"}, "on", "on"),
    ("qwen3moe", {"expert_cache_prefetch"}, "off", "off"),
    ("qwen3moe", set(), "on", "off"),                     # the binary has no --moe-cache-prefetch
    ("deepseek2", {"expert_cache_prefetch"}, "on", "off"),    # its graph predicts nothing: the flag would do nothing
])
def test_uploads_ahead_are_weighed_only_where_the_binary_and_the_architecture_have_them(arch, features, asked,
                                                                                         weighed):
    from types import SimpleNamespace

    from orchestrator.plan.cache_choice import prefetch_mode

    ctx = SimpleNamespace(req=SimpleNamespace(expert_cache_prefetch=asked), costs=SimpleNamespace(arch=arch),
                          backend=SimpleNamespace(has=lambda f: f in features))
    assert prefetch_mode(ctx) == weighed
