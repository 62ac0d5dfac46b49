"""``orchestrator bench``: the plan and named alternatives, measured side by side through llama-server.

Library use (what the CLI does once a plan exists)::

    from orchestrator.bench import BenchOptions, VramBallast, build_configs, config_from_worker, run_bench

    with VramBallast(12 * GiB, gpus=[0]) as ballast:          # only 12 GiB free from here on
        plan = make_plan(topology, vram_limit=ballast.budget)  # the plan sees the same budget
        configs = build_configs(config_from_worker(plan.workers[0]))
        data = run_bench(configs, server_binary, "bench-out", BenchOptions(rounds=2), ballast=ballast)

Importable with only the standard library, numpy/psutil/aiohttp/matplotlib/nvidia-ml-py and rich installed (the
GPU machine's python3 plus rich): gguf/pydantic/ray are not used.
"""

from orchestrator.bench.ballast import VramBallast, fill_to_budget
from orchestrator.bench.configs import (
    GROUPS,
    BenchConfig,
    build_configs,
    config_from_launch_spec,
    config_from_plan_json,
    config_from_worker,
    cpu_moe_config,
    fit_config,
    ncmoe_sweep,
    offload_sweep,
    parse_config_option,
    plan_config,
)
from orchestrator.bench.measure import Workload
from orchestrator.bench.session import BenchOptions, describe, run_bench, schedule
from orchestrator.bench.summary import ratios, summarize

__all__ = [
    "GROUPS", "BenchConfig", "BenchOptions", "VramBallast", "Workload", "build_configs", "config_from_launch_spec", "config_from_plan_json",
    "config_from_worker", "cpu_moe_config", "describe", "fill_to_budget", "fit_config", "ncmoe_sweep",
    "offload_sweep", "parse_config_option", "plan_config", "ratios", "run_bench", "schedule", "summarize",
]
