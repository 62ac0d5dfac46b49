"""Per-GPU memory of a layer split against what two H200s measured (nvidia-h200-x2, 2026-11-29, docs/benchmarks.md).

Real recorded data: the machine as `orchestrator inspect --save` recorded it (tests/fixtures/machines/h200x2.*) and
`orchestrator bench` runs of the plan: the 24-layer Qwen3-235B-A22B shape under 12 GiB per GPU and Qwen3-30B-A3B
under 6 GiB per GPU, both `-sm layer` with experts overflowing to host memory. The planner, given the recorded
CPU-resident expert layers, must reproduce the recorded `-ts` and predict each GPU's peak within the memory model's
tolerance (3% or 256 MiB). Before the second GPU's compute buffer was modelled without the op offload's copy of a
host-resident expert tensor (which only CUDA0 makes), CUDA1 was over-predicted by ~420 MiB on the 235B shape.
"""

from __future__ import annotations

import json
import lzma
import re
from pathlib import Path

import pytest
from planfixtures import backend, with_gpu_free

from orchestrator.hardware.dump import load_machine
from orchestrator.plan import NodeRequest, PlanRequest, make_plan
from orchestrator.plan import buffers as M
from orchestrator.plan.costs import model_costs
from orchestrator.plan.placement import layer_split_placement
from orchestrator.plan.candidates import gpu_computes

FIX = Path(__file__).resolve().parents[1] / "fixtures"
BENCH = Path(__file__).resolve().parents[2] / "docs" / "benchmarks" / "h200x2-2026-11-29-bench"
GiB = 1 << 30


def _arg(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def _plan_runs():
    for f in sorted(BENCH.glob("*.json.xz")):
        doc = json.loads(lzma.decompress(f.read_bytes()))
        cfg = next(c for c in doc["configs"] if c["name"] == "plan")
        runs = [r for r in doc["runs"] if r["config"] == "plan" and r.get("status") == "ok"]
        yield f.name.removesuffix(".json.xz"), cfg, runs


@pytest.fixture(scope="module")
def x2():
    return load_machine(FIX / "machines" / "h200x2.tar.gz")


def test_fixtures_are_the_two_gpu_layer_split_runs():
    stems = {stem: (cfg, runs) for stem, cfg, runs in _plan_runs()}
    assert set(stems) == {"w1-6g", "w2-12g"}
    for cfg, runs in stems.values():
        assert _arg(cfg["args"], "-sm") == "layer" and runs
        assert all(set(r["resources"]["gpus"]) == {"0", "1"} for r in runs)


def _recorded_placement(model, args: list[str]):
    """The placement a recorded plan ran (its -ts counts and -ot layers), and the CPU-resident expert layers."""
    costs = model_costs(model)
    counts = [int(x) for x in _arg(args, "-ts").split(",")]
    counts[-1] -= 1                                         # the output layer, counted on the last GPU
    cpu = tuple(int(x) for x in re.match(r"blk\\\.\(([0-9|]+)\)\\\.", _arg(args, "-ot")).group(1).split("|"))
    return costs, layer_split_placement(costs, _kv(model, args), counts, cpu), cpu


def _kv(model, args):
    return M.kv_by_layer(model, M.BufferShape(n_ctx=int(_arg(args, "-c")), n_parallel=int(_arg(args, "-np")),
                                              n_ubatch=int(_arg(args, "-ub")), n_batch=int(_arg(args, "-b")),
                                              type_k="f16", type_v="f16", flash_attn=True, flavor="mainline"))


@pytest.mark.parametrize("stem", ["w1-6g", "w2-12g"])
def test_per_gpu_memory_of_the_layer_split_within_tolerance(models, stem):
    """Each GPU's predicted peak (weights and KV of its layers, its compute buffer, CUDA context and pool) for the
    placement that ran, against the peak measured on that GPU."""
    cfg, runs = next((c, r) for s, c, r in _plan_runs() if s == stem)
    args = cfg["args"]
    model = models("qwen3-235b-a22b", layers=24) if stem.startswith("w2") else models("qwen3-30b-a3b")
    costs, placement, cpu = _recorded_placement(model, args)
    ub = int(_arg(args, "-ub"))
    req = PlanRequest(nodes=(NodeRequest(name="x2"),), context=int(_arg(args, "-c")), parallel=int(_arg(args, "-np")),
                      batch=int(_arg(args, "-b")))
    computes = gpu_computes(model, req, ub=ub, fa="on", flavor="mainline", mode="layer", n_gpus=2,
                            offload_copy=M.offload_copy_bytes(model, cpu))
    overhead = M.cuda_overhead(model, ub)
    bufs = runs[0]["llama"]["buffers"]
    for k in (0, 1):
        # the weights of the recorded placement are what llama.cpp allocated on that GPU
        assert abs(placement.gpu_weights[k] - bufs["model"][f"CUDA{k}"]) <= 0.01 * bufs["model"][f"CUDA{k}"]
        predicted = placement.gpu_weights[k] + placement.gpu_kv[k] + computes[k] + overhead
        for run in runs:
            peak = run["resources"]["gpus"][str(k)]["peak_delta"]
            assert abs(predicted - peak) <= max(0.03 * peak, 256 << 20), (stem, k, predicted / GiB, peak / GiB)
    # CUDA1 runs no offloaded batch: its compute buffer is the smaller one, as llama.cpp reported
    assert computes[1] < computes[0] and bufs["compute"]["CUDA1"] < bufs["compute"]["CUDA0"]
    assert abs(computes[1] - bufs["compute"]["CUDA1"]) <= 64 << 20


def test_the_planner_uses_the_room_the_second_gpu_has(models, x2):
    """With CUDA1's smaller compute buffer the planner keeps at least as many expert layers in VRAM as ran, and
    its per-GPU totals stay within each GPU's budget."""
    for stem, cfg, _runs in _plan_runs():
        budget = int(stem.split("-")[1].rstrip("g")) * GiB
        model = models("qwen3-235b-a22b", layers=24) if stem.startswith("w2") else models("qwen3-30b-a3b")
        req = PlanRequest(nodes=(NodeRequest(name="x2", vram_limit=budget, vram_reserve=256 << 20),))
        w = make_plan(machines={"x2": with_gpu_free(x2, budget)}, model=model, request=req,
                      backend=backend()).workers[0]
        _costs, _placement, ran_cpu = _recorded_placement(model, cfg["args"])
        assert _arg(w.args, "-sm") == "layer" and len(w.cpu_expert_layers) <= len(ran_cpu)
        for m in w.memory:
            if m.device.startswith("CUDA"):
                assert m.total <= m.budget, (stem, m)
