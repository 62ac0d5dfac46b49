#!/usr/bin/env python3
"""Fit rates.PREFILL_STAGED_OVERLAP on measured prompts staged by --moe-cache-prefill-ahead, and show every point.

A staged micro-batch of b tokens through op offload is predicted as the unstaged one (fit_prompt_costs.py's model,
with the constants in rates.py) less OVERLAP x min(copy, span x rest): ``copy`` the PCIe time of the experts the
slots did not give, ``rest`` everything else the micro-batch costs, ``span`` the share of the layers up to the last
host-resident one (what the copies can hide behind: a layer's copy runs while the layers before it compute). OVERLAP is fitted by least
squares on the relative error of each prompt's time, with each run's slot share from its counters; the runs without
staging (the plan and its A/A control) are shown beside, against the same model, for the spread.

With ``--profile`` for the runs' workloads also rates.PREFILL_STAGE_SLOT_COST, the share of the staging buffers'
bytes the plan takes from the slots when it predicts staged generation: each BENCH's plan is replanned as it ran
(lab/bench/replan.py, with the routing profile given) with staging on and off, and the share fitted by least squares
on the relative error of the predicted staged / unstaged generation against the measured one (the mean over each
side's configurations of their median generation; staged: the runs with PREFILL_STAGE_BUFFERS buffers).

usage: lab/bench/fit_staged_overlap.py BENCH.json[.xz] [...] [--host-layers N] [--profile w1=PROFILE.json.xz ...]
                                       [--write [RATES_JSON]]
  --host-layers: the plan's host-resident expert layers (default: the -ot pattern's layer list in the run's argv)
  --profile: the routing profile of a workload (w1, w2), traced on the machine the runs ran on
  --write: store the fitted constants in orchestrator/_data/rates.json (the recorded command there: its "fits")
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(Path(__file__).resolve().parent)]

from fit_prompt_costs import H200_FLOPS, _costs, _read  # noqa: E402

from orchestrator.plan import rates as R  # noqa: E402
from orchestrator.plan.predict import experts_used, prefill_stageable  # noqa: E402


def _host_layers(argv: list[str]) -> int:
    if "-ot" not in argv:
        return 0
    m = re.search(r"blk\\?\.\(([\d|]+)\)", argv[argv.index("-ot") + 1])
    return len(m.group(1).split("|")) if m else 0


def _ahead(run: dict) -> int:
    argv = run["argv"]
    if "--moe-cache-prefill-ahead" in argv:
        return int(argv[argv.index("--moe-cache-prefill-ahead") + 1])
    return int((run.get("env") or {}).get("LLAMA_MOE_CACHE_PREFILL_AHEAD", 0) or 0)


def prompt_parts(costs, n: int, ub: int, host: float, f: float, pinned: float, staged: bool) -> tuple[float, float]:
    """(unstaged model time, the part staging can hide at OVERLAP 1) of a prompt of ``n`` tokens."""
    active = sum(costs.layer_always_params) + costs.n_expert_used * sum(costs.layer_expert_params)
    expert = sum(costs.layer_experts) / len(costs.moe_layers) / costs.n_expert
    total = hidden = 0.0
    remaining = n
    while remaining > 0:
        b = min(ub, remaining)
        remaining -= b
        used = experts_used(costs.n_expert, costs.n_expert_used, b)
        rest = (2.0 * b * active / (H200_FLOPS * R.GPU_PP_FLOPS_EFFICIENCY)
                + costs.n_compute_layers * R.PP_LAYER_BATCH_S * b / (b + R.PP_LAYER_BATCH_HALF)
                + host * R.OFFLOAD_LAYER_BATCH_S + f * used * host * R.PREFILL_READ_OVERHEAD_S)
        copy = (1.0 - f) * used * expert * host / pinned
        total += rest + copy
        if staged and prefill_stageable(costs.n_expert, costs.n_expert_used, b):
            # the plans' host-resident layers are the first ones: the copies hide behind their share of the rest
            hidden += min(copy, rest * min(1.0, host / costs.n_compute_layers))
    return total, hidden


STAGING = frozenset({"expert_cache_slots", "expert_cache_staging"})


def slot_cost_pairs(paths: list[Path], profiles: dict[str, Path]) -> list[dict]:
    """Each BENCH with staged and unstaged runs of one plan: the measured staged / unstaged generation, and a
    function of the slot cost giving the predicted one."""
    import replan as P

    out = []
    for path in paths:
        bench = json.loads(_read(path))
        w = P.workload(path)
        if w not in profiles:
            raise SystemExit(f"{path}: no routing profile of {w} given (--profile {w}=PATH)")
        cached = [r for r in bench["runs"] if r.get("status") == "ok" and r["samples"].get("tg")
                  and "--moe-cache-mib" in r["argv"]]
        on = [r for r in cached if _ahead(r) == R.PREFILL_STAGE_BUFFERS]
        off = [r for r in cached if _ahead(r) == 0]
        if not on or not off:
            continue

        def tg(runs: list[dict]) -> float:
            return statistics.mean(statistics.median(s["tps"] for s in r["samples"]["tg"]) for r in runs)

        curve = P.curve(profiles[w])
        plain = P.replan(bench, off[0], w, curve, STAGING, expert_cache_staging="off").predicted.tg

        def predicted(cost: float, bench=bench, run=off[0], w=w, curve=curve, plain=plain) -> float:
            with P.rates(PREFILL_STAGE_SLOT_COST=cost):
                staged = P.replan(bench, run, w, curve, STAGING, expert_cache_staging="on")
            return staged.predicted.tg / plain

        out.append(dict(name=f"{path.parent.name}/{path.name.split('.')[0]}", measured=tg(on) / tg(off),
                        predicted=predicted, on=[r["config"] for r in on], off=[r["config"] for r in off]))
    return out


def fit_slot_cost(pairs: list[dict], step: float = 0.01) -> tuple[float, list[tuple[float, float, float]]]:
    """The share in [0, 1] of least squared relative error of the pairs' ratios, and every plateau (first, last
    share, error). The plan's slots are whole experts, so the predicted ratios, and the error, are steps in the
    share: it is scanned at ``step`` and the middle of the lowest plateau taken."""
    plateaus: list[list[float]] = []
    for i in range(int(round(1.0 / step)) + 1):
        cost = i * step
        err = sum((p["predicted"](cost) / p["measured"] - 1.0) ** 2 for p in pairs)
        if plateaus and abs(plateaus[-1][2] - err) < 1e-12:
            plateaus[-1][1] = cost
        else:
            plateaus.append([cost, cost, err])
    first, last, _ = min(plateaus, key=lambda q: q[2])
    return (first + last) / 2, [tuple(q) for q in plateaus]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bench", nargs="+", type=Path)
    ap.add_argument("--host-layers", type=int)
    ap.add_argument("--profile", action="append", default=[], metavar="WORKLOAD=PATH",
                    help="the routing profile of a workload (w1, w2): fit PREFILL_STAGE_SLOT_COST too")
    ap.add_argument("--write", nargs="?", const="", metavar="RATES_JSON",
                    help="store the fitted constants, rounded to their resolution, in "
                         "orchestrator/_data/rates.json (or the RATES_JSON given)")
    args = ap.parse_args()
    pts = []
    for path in args.bench:
        bench = json.loads(_read(path))
        costs = _costs("w2" if "w2" in path.name else "w1")
        pinned = bench["plan_context"]["bandwidth"]["gpu_h2d"][0]["bytes_per_s"] * R.PINNED_COPY_EFFICIENCY
        for run in bench["runs"]:
            argv = run["argv"]
            if run.get("status") != "ok" or not run["samples"].get("pp") or "--moe-cache-mib" not in argv:
                continue
            host = args.host_layers or _host_layers(argv)
            ub = int(argv[argv.index("-ub") + 1])
            mc = run["samples"].get("moe_cache_pp") or {}
            for s in run["samples"]["pp"]:
                c = mc.get(str(s["n"])) or {}
                saved, copied = c.get("prefill_saved_bytes", 0), c.get("prefill_copied_bytes", 0)
                f = saved / (saved + copied) if saved + copied else 0.0
                model, hidden = prompt_parts(costs, s["n"], ub, host, f, pinned, _ahead(run) > 0)
                pts.append(dict(name=f"{path.name.split('.')[0]}/{run['config']}", n=s["n"], t=s["prompt_ms"] / 1e3,
                                model=model, hidden=hidden, f=f))
    staged = [p for p in pts if p["hidden"] > 0]
    if not staged:
        print("no staged prompts in these runs", file=sys.stderr)
        return 1
    # minimise sum(((model - o hidden) / t - 1)^2) over o
    num = sum((p["model"] / p["t"] - 1.0) * p["hidden"] / p["t"] for p in staged)
    den = sum((p["hidden"] / p["t"]) ** 2 for p in staged)
    overlap = min(1.0, max(0.0, num / den))
    print(f"PREFILL_STAGED_OVERLAP = {overlap:.2f}")
    for p in pts:
        pred = p["model"] - overlap * p["hidden"]
        print(f"{p['name']:28s} pp{p['n']:<5d} slots {p['f']:.2f}  measured {p['t'] * 1e3:7.1f} ms  model "
              f"{pred * 1e3:7.1f} ms  {pred / p['t'] - 1:+.3f}{'  staged' if p['hidden'] else ''}")
    print(f"{len(staged)} staged prompts, fitted")
    fitted = {"PREFILL_STAGED_OVERLAP": overlap}
    if args.profile:
        profiles = {k: Path(v) for k, _, v in (p.partition("=") for p in args.profile)}
        pairs = slot_cost_pairs(args.bench, profiles)
        if not pairs:
            print("no run with staged and unstaged generation of one plan", file=sys.stderr)
            return 1
        cost, plateaus = fit_slot_cost(pairs)
        print(f"\nPREFILL_STAGE_SLOT_COST = {cost:.3f} (least squares on {len(pairs)} staged / unstaged generation "
              f"ratios; the middle of the lowest plateau; {R.PREFILL_STAGE_SLOT_COST} in rates.py)")
        for first, last, err in plateaus:
            mark = "  <- rates.py" if first <= R.PREFILL_STAGE_SLOT_COST <= last else ""
            print(f"  {first:.2f}-{last:.2f}: relative rms {(err / len(pairs)) ** 0.5:.4f}{mark}")
        for p in pairs:
            print(f"{p['name']:36s} {'+'.join(p['on'])} / {'+'.join(p['off'])}: measured {p['measured']:.3f}x, model "
                  f"{p['predicted'](cost):.3f}x, at no cost {p['predicted'](0.0):.3f}x, at the whole buffers "
                  f"{p['predicted'](1.0):.3f}x")
        fitted["PREFILL_STAGE_SLOT_COST"] = cost
    if args.write is not None:
        from lab.rates_file import write_fitted

        for line in write_fitted(fitted, args.write or None):
            print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
