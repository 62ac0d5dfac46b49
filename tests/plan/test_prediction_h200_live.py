"""The live routing run on the H200 (docs/benchmarks/h200-2026-12-02-live): W1 served through `up` at 12 GiB for
four streams, one request at a time and then four at once, with the cache counters' hit rate of each phase.

The deployment's plan is replanned with the placement and cache it ran (the same plan as the 12 GiB run of
h200-2026-12-02-device-slots, whose argv and bandwidth are recorded) and the routing profile the run traced; the
predicted one-stream and four-stream hit rates must be the live ones within 5 points.
"""

from __future__ import annotations

import pytest
import test_prediction_h200_workload as W

from orchestrator.hardware.dump import load_machine
from orchestrator.model.routing_profile import RoutingProfile

LIVE = W.ROOT / "docs" / "benchmarks" / "h200-2026-12-02-live"
SLOTS = W.ROOT / "docs" / "benchmarks" / "h200-2026-12-02-device-slots"


@pytest.fixture(scope="module")
def live():
    return W._xz_json(LIVE / "live.json.xz")


def test_live_hit_rates_are_the_predicted_ones(models, live):
    bench = W._xz_json(SLOTS / "w1-12g.json.xz")
    run = next(r for r in bench["runs"] if r["config"] == "plan")
    h200 = load_machine(W.FIX / "machines" / "h200.inspect.json")
    curve = RoutingProfile.from_json(W._xz_json(LIVE / "routing-w1-default.profile.json.xz")["profile"]).curve("lru-layer")
    w = W._replan(models, h200, bench, run, "w1", curve=curve)
    c = w.expert_cache.chosen
    one, four = (p["hit_rate"] for p in live["phases"])
    assert c.streams == 4
    assert c.hit_rate == pytest.approx(one, abs=0.05), (c.hit_rate, one)
    assert c.stream_hit_rate == pytest.approx(four, abs=0.05), (c.stream_hit_rate, four)
    # what the deployment's own plan said, as recorded
    assert live["predicted_1"] == pytest.approx(c.hit_rate, abs=0.01)
    print(f"live {one:.3f} / {four:.3f} against predicted {c.hit_rate:.3f} / {c.stream_hit_rate:.3f}")
