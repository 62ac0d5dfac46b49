#!/usr/bin/env python3
"""Benchmark: how long `make_plan` takes for DeepSeek-V3 (full size, q4_0, 671B) on a two-socket, eight-GPU
server (the described machine of topologies/2socket-8gpu.yaml). Target: < 200 ms.

    python lab/bench/plan_speed.py [--repeat 20] [--vram-limit GIB]

With --vram-limit each GPU is held to that budget, so experts stay in host memory and the plan also weighs the
expert cache: every split of each GPU's room between whole expert layers and slots (under -sm layer), from the
default hit-rate curve.

The model is synth-model's real DeepSeek-V3 header with a sparse data region (read exactly like the real file).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from orchestrator.hardware.dump import load_machine  # noqa: E402
from orchestrator.model import read_model, synth  # noqa: E402
from orchestrator.plan import NodeRequest, PlanRequest, make_plan  # noqa: E402
from orchestrator.resolve import nominal_backend  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--vram-limit", type=float, metavar="GIB", help="hold every GPU to this budget")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = synth.write_header_only(Path(tmp) / "deepseek-v3-q4_0.gguf", "deepseek-v3", quant="q4_0")
        t0 = time.perf_counter()
        model = read_model(path)
        t_read = time.perf_counter() - t0
        machine = load_machine(REPO / "tests" / "fixtures" / "machines" / "described" / "2socket-8gpu.json")
        limit = int(args.vram_limit * 2**30) if args.vram_limit else None
        req = PlanRequest(context=65536, parallel=4, nodes=(NodeRequest(name="server", vram_limit=limit),))
        be = nominal_backend("mainline", cuda=True)
        times = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            plan = make_plan(machines={"server": machine}, model=model, request=req, backend=be)
            times.append(time.perf_counter() - t0)
    w = plan.workers[0]
    print(f"read_model (header + tensor index, {model.file_bytes / 2**30:.0f} GiB model): {t_read * 1e3:.1f} ms")
    print(f"make_plan DeepSeek-V3 q4_0, 2 sockets x 8 GPUs, {args.repeat} runs: median "
          f"{statistics.median(times) * 1e3:.1f} ms, min {min(times) * 1e3:.1f} ms, max {max(times) * 1e3:.1f} ms "
          f"(target < 200 ms)")
    print(f"  -> {len(w.cpu_expert_layers)} expert layers in host memory, -sm {w.args[w.args.index('-sm') + 1]}, "
          f"ub {w.n_ubatch}, predicted tg {w.predicted.tg:.1f} t/s, expert cache "
          f"{w.settings.expert_cache_mib or 0} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
