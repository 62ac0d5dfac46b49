"""Where the expert cache's slots are assigned, against what the H200 measured (docs/benchmarks/h200-2026-12-02-device-slots):
W1 at 12 and 8 GiB, the plans for four streams, with the host's assignment (the plan and its A/A control) and the
device's (``LLAMA_MOE_CACHE_DEVICE_SLOTS=1``, what ``--moe-cache-slots device`` sets) in one run each.

Each run is replanned with the placement and cache it ran, on the recorded H200 with the run's bandwidth, by a
backend that has ``--moe-cache-slots``: the host's and the device's per-layer costs (fitted on these runs) must
predict both modes at one stream and at four, and ``auto`` must take the device. A backend without the option is
the build before it, whose layers drained the device: its prediction stays the one the run's plan printed.
"""

from __future__ import annotations

import lzma
import re
import statistics

import pytest
import test_prediction_h200_workload as W

from orchestrator.hardware.dump import load_machine
from orchestrator.model.routing_profile import RoutingProfile

RUN = W.ROOT / "docs" / "benchmarks" / "h200-2026-12-02-device-slots"
# the same W1 file (the same seed and locality) traced on the same machine, the day of the run
PROFILE = W.ROOT / "docs" / "benchmarks" / "h200-2026-12-02-prefetch" / "routing-w1-default.profile.json.xz"
BUDGETS = ("12", "8")


@pytest.fixture(scope="module")
def h200():
    return load_machine(W.FIX / "machines" / "h200.inspect.json")


@pytest.fixture(scope="module")
def curve():
    return RoutingProfile.from_json(W._xz_json(PROFILE)["profile"]).curve("lru-layer")


def _bench(budget: str) -> dict:
    return W._xz_json(RUN / f"w1-{budget}g.json.xz")


def _tps(bench: dict, configs: tuple[str, ...], streams: str) -> float:
    """The median over the samples of these configurations (the plan and its A/A control are one mode)."""
    runs = [r for r in bench["runs"] if r["config"] in configs and r["status"] == "ok"]
    return statistics.median(x["tps"] for r in runs for x in r["samples"]["tg_streams"][streams]["runs"])


def _replan(models, h200, bench, curve, slots: str, features=frozenset({"expert_cache_slots"})):
    run = next(r for r in bench["runs"] if r["config"] == "plan")
    return W._replan(models, h200, bench, run, "w1", curve=curve, features=features, expert_cache_slots=slots)


MODES = {"host": ("plan", "plan-control"), "device": ("device",)}


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("slots", ["host", "device"])
def test_each_assignment_predicts_its_measured_generation(models, h200, curve, budget, slots):
    bench = _bench(budget)
    w = _replan(models, h200, bench, curve, slots)
    assert w.settings.expert_cache_slots == ("device" if slots == "device" else None)
    assert w.expert_cache.chosen.device_slots == (slots == "device")
    one, four = _tps(bench, MODES[slots], "1"), _tps(bench, MODES[slots], "4")
    assert w.predicted.tg / one == pytest.approx(1.0, abs=0.10), (w.predicted.tg, one)
    assert w.predicted.tg_streams / four == pytest.approx(1.0, abs=0.10), (w.predicted.tg_streams, four)
    print(f"{budget} GiB, slots on the {slots}: 1 stream {w.predicted.tg:.1f} / {one:.1f}, 4 streams "
          f"{w.predicted.tg_streams:.1f} / {four:.1f} t/s")


@pytest.mark.parametrize("budget", BUDGETS)
def test_the_predicted_gain_of_the_device_is_the_measured_one(models, h200, curve, budget):
    bench = _bench(budget)
    host, device = _replan(models, h200, bench, curve, "host"), _replan(models, h200, bench, curve, "device")
    for streams, pick in (("1", lambda w: w.predicted.tg), ("4", lambda w: w.predicted.tg_streams)):
        measured = _tps(bench, MODES["device"], streams) / _tps(bench, MODES["host"], streams)
        # one start per mode: the host's two starts (the plan and its A/A control) differ by up to 7% (8 GiB, four
        # streams: 121 and 113 t/s)
        assert pick(device) / pick(host) == pytest.approx(measured, abs=0.10), (streams, measured)


def test_auto_assigns_on_the_device_and_says_so(models, h200, curve):
    w = _replan(models, h200, _bench("12"), curve, "auto")
    assert w.settings.expert_cache_slots == "device"
    i = w.args.index("--moe-cache-slots")
    assert w.args[i + 1] == "device"
    assert "slots assigned on the device" in "\n".join(w.expert_cache.arithmetic())


def test_a_build_without_the_option_keeps_the_host_and_the_old_cost(models, h200, curve):
    bench = _bench("12")
    w = _replan(models, h200, bench, curve, "auto", features=frozenset())
    assert w.settings.expert_cache_slots is None and "--moe-cache-slots" not in w.args
    # the run's own plan (made by that build's planner) printed its prediction
    text = lzma.decompress((RUN / "plan-w1-12g.txt.xz").read_bytes()).decode()
    printed = float(re.search(r"speed \(predicted\): tg ([\d.]+) t/s", text).group(1))
    assert w.predicted.tg == pytest.approx(printed, rel=0.01)


@pytest.mark.parametrize("topology, why", [
    ({"expert_cache_slots": "host"}, "set by the topology"),
    ({"load_mode": "mmap"}, "memory-mapped weights are not pinned"),
])
def test_the_host_assigns_where_the_device_cannot(models, h200, curve, topology, why):
    bench = _bench("12")
    run = next(r for r in bench["runs"] if r["config"] == "plan")
    w = W._replan(models, h200, bench, run, "w1", curve=curve, features=frozenset({"expert_cache_slots"}),
                  **{"expert_cache_slots": "auto", **topology})
    assert w.settings.expert_cache_slots is None
    assert not w.expert_cache.chosen.device_slots
    from orchestrator.plan.cache_choice import slots_on_device
    from types import SimpleNamespace
    ctx = SimpleNamespace(req=SimpleNamespace(expert_cache_slots=topology.get("expert_cache_slots", "auto")),
                          backend=w.backend)
    assert slots_on_device(ctx, [object()], topology.get("load_mode", "pinned")) == why
