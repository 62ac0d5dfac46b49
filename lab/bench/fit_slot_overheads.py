#!/usr/bin/env python3
"""Fit rates.CACHE_LAYER_OVERHEAD_HOST_S and CACHE_LAYER_OVERHEAD_DEVICE_S: the expert cache's cost per
host-resident layer and generated token with the slots assigned on the host and on the device, by a build that has
``--moe-cache-slots``.

Each BENCH ran one plan with the host's assignment (the configurations HOST, by default the plan and its A/A
control) and the device's (DEVICE, ``LLAMA_MOE_CACHE_DEVICE_SLOTS=1``) and fed it one stream and several. The run is
replanned as it ran (lab/bench/replan.py) with each assignment; its step time is linear in that assignment's cost
per layer (h host-resident layers x it), the upload efficiency and the fixed cost of the cache path held as stored.
Each cost is fitted by least squares on the relative error of the step time over every BENCH and stream count (the
median of the mode's generation samples; a step of N streams is N tokens).

usage: lab/bench/fit_slot_overheads.py BENCH.json[.xz] [...] --profile PROFILE.json.xz [--host plan,plan-control]
                                       [--device device] [--write [RATES_JSON]]
  --profile: the routing profile of the model the runs served, traced on the same machine
  --write: store the fitted costs in orchestrator/_data/rates.json (the recorded command there: its "fits")
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(Path(__file__).resolve().parent)]

import replan as P  # noqa: E402

CONSTANT = {"host": "CACHE_LAYER_OVERHEAD_HOST_S", "device": "CACHE_LAYER_OVERHEAD_DEVICE_S"}
FEATURES = frozenset({"expert_cache_slots"})


def _measured_step(bench: dict, configs: list[str], streams: str) -> float | None:
    runs = [r for r in bench["runs"] if r["config"] in configs and r.get("status") == "ok"]
    tps = [x["tps"] for r in runs for x in r["samples"].get("tg_streams", {}).get(streams, {}).get("runs", [])]
    return int(streams) / statistics.median(tps) if tps else None


def points(path: Path, curve, mode: str, configs: list[str]) -> list[dict]:
    """One point per stream count the run fed: measured step time, and the predicted one at the cost 0 and its
    slope in the cost (host-resident layers per step)."""
    bench = P.read_json(path)
    w = P.workload(path)
    runs = {r["config"]: r for r in bench["runs"] if r.get("status") == "ok"}
    missing = [c for c in configs if c not in runs]
    if missing:
        raise SystemExit(f"{path}: no configuration {', '.join(missing)} that ran (it has: {', '.join(runs)})")
    base = runs[configs[0]]

    def steps(cost: float) -> dict[str, float]:
        with P.rates(**{CONSTANT[mode]: cost}):
            wk = P.replan(bench, base, w, curve, FEATURES, expert_cache_slots=mode)
        if wk.expert_cache.chosen.device_slots != (mode == "device"):
            raise SystemExit(f"{path}: the replan does not assign the slots on the {mode}")
        return {"1": 1.0 / wk.predicted.tg, str(wk.predicted.streams): wk.predicted.streams / wk.predicted.tg_streams}

    at0, at1 = steps(0.0), steps(1e-4)
    out = []
    for s, t0 in at0.items():
        t = _measured_step(bench, configs, s)
        if t is not None:
            out.append(dict(name=f"{path.name.split('.')[0]}/{'+'.join(configs)}", streams=int(s), t=t, t0=t0,
                            slope=(at1[s] - t0) / 1e-4))
    return out


def fit(pts: list[dict]) -> float:
    """The cost minimising sum(((t0 + slope x cost) / t - 1)^2)."""
    num = sum((p["t"] - p["t0"]) * p["slope"] / p["t"] ** 2 for p in pts)
    den = sum((p["slope"] / p["t"]) ** 2 for p in pts)
    return num / den


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bench", nargs="+", type=Path)
    ap.add_argument("--profile", type=Path, required=True)
    ap.add_argument("--host", default="plan,plan-control", help="the configurations with the host's assignment")
    ap.add_argument("--device", default="device", help="the configurations with the device's assignment")
    ap.add_argument("--write", nargs="?", const="", metavar="RATES_JSON",
                    help="store the fitted costs, rounded to their resolution, in orchestrator/_data/rates.json "
                         "(or the RATES_JSON given)")
    args = ap.parse_args()
    curve = P.curve(args.profile)
    fitted = {}
    for mode, configs in (("host", args.host.split(",")), ("device", args.device.split(","))):
        pts = [p for path in args.bench for p in points(path, curve, mode, configs)]
        cost = fit(pts)
        fitted[CONSTANT[mode]] = cost
        print(f"{CONSTANT[mode]} = {cost * 1e6:.2f} us (least squares on {len(pts)} step times)")
        for p in pts:
            pred = p["t0"] + p["slope"] * cost
            print(f"  {p['name']:32s} {p['streams']} stream(s): measured {p['t'] * 1e3:6.2f} ms a step, model "
                  f"{pred * 1e3:6.2f} ms ({pred / p['t'] - 1:+.3f}), {p['slope']:.0f} host layers a step")
    if args.write is not None:
        from lab.rates_file import write_fitted

        for line in write_fitted(fitted, args.write or None):
            print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
