#!/usr/bin/env python3
"""Solve rates.PAGEABLE_FRACTION on a prompt measured with the host-resident experts memory-mapped, beside the
same plan with them pinned (``run.sh w1-load-modes``: the plan, and the plan with ``--load-mode mmap``).

Op offload copies a big micro-batch's host-resident experts to the GPU: from pinned buffers at the probe's pinned
bandwidth, from memory-mapped (pageable) pages at PAGEABLE_FRACTION of it (orchestrator/plan/candidates.py). The
run is replanned as it ran (lab/bench/replan.py, no expert cache: the runs had none) with each load mode, and the
share solved so that the predicted prompt speed memory-mapped over pinned is the measured one (the medians over
each configuration's starts); the share that gives the memory-mapped prompt alone is printed beside (it carries
the model's error on the rest of the micro-batch, which the ratio cancels).

usage: lab/bench/fit_pageable_share.py BENCH.json[.xz] [--pinned plan] [--mmap plan-mmap] [--prompt 512]
                                       [--write [RATES_JSON]]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(Path(__file__).resolve().parent)]

import replan as P  # noqa: E402

NO_CACHE = frozenset({"expert_cache", "expert_cache_slot_reads"})


def solve(bench_path: Path, pinned_config: str = "plan", mmap_config: str = "plan-mmap",
          prompt: int = 512) -> dict[str, float]:
    """The measured prompt speeds pinned and memory-mapped, the predicted ones at rates.py's share, and the share
    solved for the measured ratio (``share``) and for the memory-mapped prompt alone (``alone``)."""
    from orchestrator.plan import rates as R

    bench = P.read_json(bench_path)
    w = P.workload(bench_path) if bench_path.name.startswith("w") else "w1"
    runs = {r["config"]: r for r in bench["runs"] if r.get("status") == "ok"}
    for c in (pinned_config, mmap_config):
        if c not in runs:
            raise SystemExit(f"{bench_path}: no configuration {c!r} that ran (it has: {', '.join(runs)})")

    def measured(config: str) -> float:
        pp = [s["tps"] for r in bench["runs"] if r["config"] == config and r.get("status") == "ok"
              for s in r["samples"].get("pp", []) if s["n"] == prompt]
        if not pp:
            raise SystemExit(f"{bench_path}: {config} has no pp{prompt} sample")
        return statistics.median(pp)

    def predicted(mode: str, share: float) -> float:
        with P.rates(PAGEABLE_FRACTION=share):
            wk = P.replan(bench, runs[pinned_config], w, None, without=NO_CACHE, load_mode=mode)
        return wk.predicted.pp[prompt]

    out = {"pinned": measured(pinned_config), "mmap": measured(mmap_config),
           "predicted_pinned": predicted("pinned", R.PAGEABLE_FRACTION),
           "predicted_mmap": predicted("mmap", R.PAGEABLE_FRACTION)}
    ratio = out["mmap"] / out["pinned"]
    out["share"] = P.solve(lambda x: predicted("mmap", x) / out["predicted_pinned"] - ratio, 0.01, 1.0, iters=30)
    out["alone"] = P.solve(lambda x: predicted("mmap", x) - out["mmap"], 0.01, 1.0, iters=30)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bench", type=Path)
    ap.add_argument("--pinned", default="plan", help="the configuration with pinned host weights (default plan)")
    ap.add_argument("--mmap", default="plan-mmap", help="the one memory-mapped (default plan-mmap)")
    ap.add_argument("--prompt", type=int, default=512, help="the prompt length measured (default 512)")
    ap.add_argument("--write", nargs="?", const="", metavar="RATES_JSON",
                    help="store the share, rounded to its resolution, in orchestrator/_data/rates.json (or the "
                         "RATES_JSON given)")
    args = ap.parse_args()
    from orchestrator.plan import rates as R

    got = solve(args.bench, args.pinned, args.mmap, args.prompt)
    print(f"pp{args.prompt}: measured {got['pinned']:.0f} t/s pinned, {got['mmap']:.0f} memory-mapped "
          f"({got['mmap'] / got['pinned']:.3f}x); predicted at rates.py's share {R.PAGEABLE_FRACTION}: "
          f"{got['predicted_pinned']:.0f} and {got['predicted_mmap']:.0f} "
          f"({got['predicted_mmap'] / got['predicted_pinned']:.3f}x)")
    print(f"PAGEABLE_FRACTION = {got['share']:.4f} (the ratio); {got['alone']:.4f} from the memory-mapped prompt alone")
    if args.write is not None:
        from lab.rates_file import write_fitted

        for line in write_fitted({"PAGEABLE_FRACTION": got["share"]}, args.write or None):
            print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
