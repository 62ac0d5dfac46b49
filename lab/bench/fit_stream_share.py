#!/usr/bin/env python3
"""Fit rates.STREAM_SHARE_EXPONENT on the expert cache's hit rates of several streams decoding together.

The plan predicts a stream's hit rate at N streams as the single-stream curve (the routing profile traced in the
run) at cached fraction x (k / U(N)) ** e, U(N) the distinct experts of a step of N tokens
(orchestrator/plan/expert_cache.py). Each run is replanned as it ran (lab/bench/replan.py) for its cached fraction;
its hit rate at the streams it was planned for (its ``-np``) comes from the cache's counters over those generation
samples. e is fitted by least squares on the hit rates. The hit rates at the other stream counts the run fed (one
stream, two) are shown beside, with the exponent each alone would need.

usage: lab/bench/fit_stream_share.py BENCH.json[.xz] [...] [--profile PROFILE.json.xz] [--write [RATES_JSON]]
  --profile: the routing profile to replan with (default: routing-<workload>-default.profile.json.xz beside BENCH)
  --write: store the fitted exponent in orchestrator/_data/rates.json (the recorded command there: its "fits")
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(Path(__file__).resolve().parent)]

import replan as P  # noqa: E402

from orchestrator.plan.expert_cache import hit_rate, union_experts  # noqa: E402


def points(path: Path, profile: Path | None) -> list[dict]:
    bench = P.read_json(path)
    w = P.workload(path)
    profile = profile or path.with_name(f"routing-{w}-default.profile.json.xz")
    if not profile.is_file():
        raise SystemExit(f"{path}: no routing profile {profile} (give --profile)")
    curve = P.curve(profile)
    out = []
    for run in bench["runs"]:
        argv = run["argv"]
        if run.get("status") != "ok" or "--moe-cache-mib" not in argv or "--moe-cache-prefetch" in argv:
            continue
        c = P.replan(bench, run, w, curve).expert_cache.chosen
        m = P.model(w)
        n_expert, k = m.n_expert, m.n_expert_used
        planned = int(argv[argv.index("-np") + 1])
        for s, entry in sorted(run["samples"].get("tg_streams", {}).items(), key=lambda kv: int(kv[0])):
            mc = entry.get("moe_cache")
            if not mc or not mc.get("lookups"):
                continue
            n = int(s)
            out.append(dict(name=f"{path.parent.name}/{path.name.split('.')[0]}/{run['config']}", streams=n,
                            planned=n == planned and n > 1, fraction=c.fraction, curve=curve,
                            share=k / union_experts(n_expert, k, n), hit=mc["hits"] / mc["lookups"]))
    return out


def predicted(p: dict, e: float) -> float:
    return hit_rate(p["curve"], p["fraction"] * p["share"] ** e)


def fit(pts: list[dict], lo: float = 0.0, hi: float = 2.0) -> float:
    """The exponent of least squared hit-rate error (golden-section search: the error is unimodal in it)."""
    def err(e: float) -> float:
        return sum((predicted(p, e) - p["hit"]) ** 2 for p in pts)

    g = (5 ** 0.5 - 1) / 2
    a, b = lo, hi
    for _ in range(80):
        c, d = b - g * (b - a), a + g * (b - a)
        if err(c) <= err(d):
            b = d
        else:
            a = c
    return (a + b) / 2


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bench", nargs="+", type=Path)
    ap.add_argument("--profile", type=Path)
    ap.add_argument("--write", nargs="?", const="", metavar="RATES_JSON",
                    help="store the fitted exponent, rounded to its resolution, in orchestrator/_data/rates.json "
                         "(or the RATES_JSON given)")
    args = ap.parse_args()
    pts = [p for path in args.bench for p in points(path, args.profile)]
    planned = [p for p in pts if p["planned"]]
    if not planned:
        print("no run with the cache's counters at the streams it was planned for (-np above 1)", file=sys.stderr)
        return 1
    e = fit(planned)
    print(f"STREAM_SHARE_EXPONENT = {e:.3f} (least squares on {len(planned)} hit rates at the planned streams)")
    print(f"{'run':52s} {'streams':>7s} {'cached':>6s} {'measured':>8s} {'model':>6s} {'alone':>6s}")
    for p in pts:
        alone = fit([p]) if p["streams"] > 1 else float("nan")
        print(f"{p['name']:52s} {p['streams']:7d} {p['fraction']:6.3f} {p['hit']:8.3f} {predicted(p, e):6.3f} "
              f"{alone:6.2f}{'  fitted' if p['planned'] else ''}")
    if args.write is not None:
        from lab.rates_file import write_fitted

        for line in write_fitted({"STREAM_SHARE_EXPONENT": e}, args.write or None):
            print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
