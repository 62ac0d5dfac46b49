"""The workload prediction against what the H200 measured (docs/benchmarks/h200-2026-12-02-workload): prompts that
read the expert cache's slots, aggregate generation of several streams, and time to first token.

Each run is replanned with the placement, cache and micro-batch it ran (its argv), on the recorded H200 as the run
saw it (its budget free, its probe's bandwidth) and with the routing profile traced in the same run.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import lzma
import statistics
from pathlib import Path

import pytest
from planfixtures import backend, with_gpu_free

from orchestrator.hardware.dump import load_machine
from orchestrator.hardware.topology import Bandwidth
from orchestrator.model.routing_profile import RoutingProfile
from orchestrator.plan import NodeRequest, PlanRequest, make_plan
from test_prediction_h200_cache import _layers_and_cache

ROOT = Path(__file__).resolve().parents[2]
RUN = ROOT / "docs" / "benchmarks" / "h200-2026-12-02-workload"
FIX = ROOT / "tests" / "fixtures"
MiB = 1 << 20
SHAPES = {"w1": ("qwen3-30b-a3b", None), "w2": ("qwen3-235b-a22b", 24)}


def _xz_json(path: Path):
    return json.loads(lzma.decompress(path.read_bytes()))


@functools.lru_cache(maxsize=None)
def _curve(model: str, run: Path = RUN):
    """The routing profile traced for ``model`` in the benchmark directory ``run``, as its hit-rate curve."""
    doc = _xz_json(run / f"routing-{model}-default.profile.json.xz")
    return RoutingProfile.from_json(doc["profile"]).curve("lru-layer")


@pytest.fixture(scope="module")
def h200():
    return load_machine(FIX / "machines" / "h200.inspect.json")


def _measured(name: str, config: str = "plan") -> tuple[dict, dict]:
    bench = _xz_json(RUN / f"{name}.json.xz")
    run = next(r for r in bench["runs"] if r["config"] == config and r["status"] == "ok")
    return bench, run


def _replan(models, h200, bench, run, model: str, curve=None, features: frozenset = frozenset(),
            without: frozenset = frozenset(), **request):
    """The run's argv replanned (``curve``: the routing to plan with, else the run's; ``features``: more of the
    binary's, ``without``: fewer; ``request``: more PlanRequest fields)."""
    args = run["argv"]
    layers, mib = _layers_and_cache(args)
    parallel = int(args[args.index("-np") + 1])
    req = PlanRequest(nodes=(NodeRequest(name="h200", vram_limit=bench["vram_budget"], vram_reserve=256 * MiB),),
                      expert_layers_on_cpu=layers, expert_cache_bytes=mib * MiB,
                      ubatch=int(args[args.index("-ub") + 1]),
                      parallel=parallel, **request)
    b = backend("mainline")
    b = dataclasses.replace(b, features=(b.features | {"expert_cache", "expert_cache_slot_reads"} | set(features)) - without)
    machine = dataclasses.replace(with_gpu_free(h200, bench["vram_budget"]),
                                  bandwidth=Bandwidth.from_json(bench["plan_context"]["bandwidth"]))
    like, n_layers = SHAPES[model]
    shape = models(like, layers=n_layers) if n_layers else models(like)
    w = make_plan(machines={"h200": machine}, model=shape, request=req, backend=b,
                  routing=curve or _curve(model)).workers[0]
    assert w.settings.expert_cache_mib == mib
    return w


SINGLE = [("w1-12g", "w1"), ("w1-8g", "w1"), ("w1-16g", "w1"), ("w2-24g", "w2")]


@pytest.mark.parametrize("name, model", SINGLE)
def test_one_stream_generation_and_prompts(models, h200, name, model):
    bench, run = _measured(name)
    w = _replan(models, h200, bench, run, model)
    tg = statistics.median(s["tps"] for s in run["samples"]["tg"])
    pp = {s["n"]: s["tps"] for s in run["samples"]["pp"]}
    assert w.predicted.tg / tg == pytest.approx(1.0, abs=0.15), (w.predicted.tg, tg)
    # time to first token of a 512-token prompt (the prompt, then one step)
    ttft = 512 / pp[512] + 1 / tg
    assert w.predicted.ttft(512) / ttft == pytest.approx(1.0, abs=0.35), (w.predicted.ttft(512), ttft)
    print(f"{name}: tg {w.predicted.tg:.1f} / {tg:.1f}; pp512 {w.predicted.pp[512]:.0f} / {pp[512]:.0f}; pp4096 "
          f"{w.predicted.pp[4096]:.0f} / {pp[4096]:.0f}; ttft512 {w.predicted.ttft(512) * 1e3:.0f} / {ttft * 1e3:.0f} ms")


@pytest.mark.parametrize("name, streams, tolerance", [("w1-12g-4streams", 4, 0.15), ("w1-12g-8streams", 8, 0.20)])
def test_aggregate_generation_of_several_streams(models, h200, name, streams, tolerance):
    bench, run = _measured(name)
    w = _replan(models, h200, bench, run, "w1")
    entry = run["samples"]["tg_streams"][str(streams)]
    measured = statistics.median(r["tps"] for r in entry["runs"])
    assert w.predicted.streams == streams
    assert w.predicted.tg_streams / measured == pytest.approx(1.0, abs=tolerance), (w.predicted.tg_streams, measured)
    mc = entry["moe_cache"]
    c = w.expert_cache.chosen
    assert c.stream_hit_rate == pytest.approx(mc["hits"] / mc["lookups"], abs=0.05)
    # the same plan with one stream fed
    one = statistics.median(r["tps"] for r in run["samples"]["tg_streams"]["1"]["runs"])
    assert w.predicted.tg / one == pytest.approx(1.0, abs=0.15)
    print(f"{name}: {streams} streams {w.predicted.tg_streams:.1f} / {measured:.1f} t/s, hit rate "
          f"{c.stream_hit_rate:.3f} / {mc['hits'] / mc['lookups']:.3f}")
