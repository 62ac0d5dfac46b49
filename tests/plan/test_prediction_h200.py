"""The speed and memory model against what the H200 machine measured (2026-11-29, docs/benchmarks.md).

Real recorded data: the machine as `orchestrator inspect --save` recorded it (with the probe's bandwidths), and
`orchestrator bench` results of Qwen3-30B-A3B q4_0 and a 24-layer Qwen3-235B-A22B shape under VRAM budgets.
The models are the same synth-model shapes (real headers, sparse data), so the planner sees the same tensors.
"""

from __future__ import annotations

import json
import lzma
import statistics
from pathlib import Path

import pytest
from planfixtures import backend, with_gpu_free

from orchestrator.hardware.dump import load_machine
from orchestrator.plan import NodeRequest, PlanRequest, make_plan

FIX = Path(__file__).resolve().parents[1] / "fixtures"
BENCH = Path(__file__).resolve().parents[2] / "docs" / "benchmarks" / "h200-2026-11-29-bench"
GiB = 1 << 30


def _runs():
    for f in sorted(BENCH.glob("*.json.xz")):
        doc = json.loads(lzma.decompress(f.read_bytes()))
        configs = {c["name"]: c for c in doc["configs"]}
        for r in doc["runs"]:
            if r.get("status") == "ok":
                yield f.name.removesuffix(".json.xz"), configs[r["config"]], r


def _cpu_layers(args: list[str], n_layers: int) -> tuple[int, ...] | None:
    a = list(args)
    if "--cpu-moe" in a:
        return tuple(range(n_layers))
    if "--n-cpu-moe" in a:
        return tuple(range(int(a[a.index("--n-cpu-moe") + 1])))
    if "-ot" in a:
        import re

        m = re.match(r"blk\\\.\(([0-9|]+)\)\\\.", a[a.index("-ot") + 1])
        return tuple(int(x) for x in m.group(1).split("|"))
    return None


def _budget_gib(stem: str) -> int:
    return int(stem.split("-")[1].rstrip("g"))       # w1-12g-b -> 12, w2-24g -> 24


def measured_tg() -> dict[tuple[str, tuple[int, ...]], list[float]]:
    """tg128 at depth 0 by (model file, CPU expert layers, budget), pooled over every run with that placement."""
    out: dict = {}
    for stem, cfg, run in _runs():
        args = cfg["args"]
        model = Path(args[args.index("-m") + 1]).name
        n_layers = 24 if "235b" in model else 48
        layers = _cpu_layers(args, n_layers)
        if layers is None:
            continue
        for s in run["samples"]["tg"]:
            if s["depth"] == 0:
                out.setdefault((model, layers, _budget_gib(stem)), []).append(s["tps"])
    return out


@pytest.fixture(scope="module")
def h200():
    return load_machine(FIX / "machines" / "h200.inspect.json")


def _predict(models, machine, model_file: str, cpu_layers: tuple[int, ...], budget_gib: int,
             ubatch: int | None = None):
    model = models("qwen3-235b-a22b", layers=24) if "235b" in model_file else models("qwen3-30b-a3b")
    m = with_gpu_free(machine, budget_gib * GiB)
    req = PlanRequest(nodes=(NodeRequest(name="h200", vram_limit=budget_gib * GiB, vram_reserve=256 << 20),),
                      expert_layers_on_cpu=cpu_layers, ubatch=ubatch)
    return make_plan(machines={"h200": m}, model=model, request=req, backend=backend()).workers[0]


def test_recorded_machine_has_the_measured_bandwidths(h200):
    assert h200.gpus[0].name == "NVIDIA H200" and h200.gpus[0].pcie_gen == 5
    bw = h200.bandwidth
    assert 50e9 < bw.gpu_h2d[(0, 0)] < 60e9 and 90e9 < bw.host[(0, 0)] < 110e9


def test_predicted_generation_speed_within_15_percent_of_measured(models, h200):
    points = measured_tg()
    assert len(points) >= 6, points.keys()
    for (model_file, layers, budget), samples in points.items():
        w = _predict(models, h200, model_file, layers, budget)
        measured = statistics.median(samples)
        ratio = w.predicted.tg / measured
        assert 0.85 <= ratio <= 1.15, (model_file, len(layers), w.predicted.tg, measured, samples)


def test_predicted_vram_within_tolerance_of_measured_peak(models, h200):
    """Issue 4's tolerance: within 3% or 256 MiB (the larger) of what the device really used, predicted by the
    current memory model (weights + KV + compute + CUDA context and pool) for each recorded plan placement."""
    checked = 0
    for stem, cfg, run in _runs():
        if cfg["name"] not in ("plan", "plan-control"):
            continue
        args = cfg["args"]
        model = Path(args[args.index("-m") + 1]).name
        layers = _cpu_layers(args, 24 if "235b" in model else 48)
        w = _predict(models, h200, model, layers, _budget_gib(stem), ubatch=int(args[args.index("-ub") + 1]))
        assert w.n_ubatch == int(args[args.index("-ub") + 1]) and w.cpu_expert_layers == layers
        predicted = next(m.total for m in w.memory if m.device == "CUDA0")
        peak = run["resources"]["gpus"]["0"]["peak_delta"]
        assert abs(predicted - peak) <= max(0.03 * peak, 256 << 20), (stem, predicted / GiB, peak / GiB)
        checked += 1
    assert checked >= 6
