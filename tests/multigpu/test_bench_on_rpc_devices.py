"""``bench`` on the two-RPC-device machine: the plan and the alternatives derived from it (fit, fit-pinned,
cpu-moe, an --n-cpu-moe sweep, the cache grid) each start, serve and are measured, with every server's argv the
configuration's flags plus the devices (``--rpc``). Functional only: the RPC devices compute with the CPU's
kernels, so no number here says anything about speed on two GPUs (docs/multi-gpu.md)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from orchestrator.bench.configs import build_configs, config_from_worker
from orchestrator.bench.measure import Workload
from orchestrator.bench.session import BenchOptions, run_bench
from orchestrator.plan.costs import model_costs
from tests.multigpu.rpc_devices import STAND_IN, plan_for, rpc_devices

pytestmark = pytest.mark.integration

GROUPS = ("plan", "fit", "fit-pinned", "cpu-moe", "ncmoe-sweep", "cache-grid")


def test_bench_runs_the_plan_and_its_alternatives_on_two_rpc_devices(model, llama_server_path, rpc_server, tmp_path):
    worker = plan_for(model, llama_server_path, 2, STAND_IN)
    costs = model_costs(model)
    plan = config_from_worker(worker)
    plan = dataclasses.replace(plan, params={**dict(plan.params), "n_layers": model.n_layers})
    configs = build_configs(plan, GROUPS, ncmoe_values=[model.n_layers // 2], ubatches=[512], load_modes=("mmap",),
                            n_layers=model.n_layers,
                            layer_expert_bytes=max(costs.layer_experts[i] for i in costs.moe_layers))
    names = [c.name for c in configs]
    assert {c.group for c in configs} >= {"plan", "fit", "cpu-moe", "ncmoe-sweep", "cache-grid"}, names
    workload = Workload(pp=(32,), pp_reps=1, tg_depths=(0,), tg_tokens=8, tg_reps=1, concurrency=(1,),
                        ttft_prompt=16, ttft_requests=1, warmup=False)
    options = BenchOptions(rounds=1, workload=workload, prime_page_cache=False, load_timeout=300.0,
                           request_timeout=300.0, stop_grace=10.0)
    with rpc_devices(rpc_server, 2, tmp_path) as devs:
        rpc = ",".join(d.endpoint for d in devs)
        on_devices = [dataclasses.replace(c, args=(*c.args, "--rpc", rpc, "--no-repack")) for c in configs]
        data = run_bench(on_devices, llama_server_path, tmp_path / "bench", options, nvml=None, charts=False)
    runs = {r["config"]: r for r in data["runs"]}
    print("; ".join(f"{n}: tg {r['samples']['tg'][0]['tps']:.1f} t/s" for n, r in runs.items()))
    assert sorted(runs) == sorted(names)
    for name, r in runs.items():
        assert r["status"] == "ok" and not r.get("error"), (name, r.get("error"))
        assert all(t["tps"] > 0 for t in r["samples"]["tg"]) and r["samples"]["tg"], (name, r["samples"])
        bufs = r["llama"]["buffers"]["model"]
        assert len([b for b in bufs if b.startswith("RPC")]) == 2, (name, bufs)   # both devices hold weights
    assert runs["plan"]["llama"]["expert_cache"]["slots"] > 0
    assert runs["plan"]["llama"]["offloaded_layers"][0] == model.n_layers + 1
    assert json.loads((tmp_path / "bench" / "bench.json").read_text())["runs"]
