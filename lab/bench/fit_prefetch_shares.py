#!/usr/bin/env python3
"""The shares the plan weighs uploads ahead of need (--moe-cache-prefetch) with, from the cache's counters of one run.

For each number of streams the run decoded with (``bench --tg-streams``), from the expert cache's counters over the
generation samples of the plan without uploads ahead (BASE) and the same plan with them (WITH):

    PREFETCH_MISS_CUT          = 1 - misses with them / misses without them   (the misses they turned into hits)
    PREFETCH_UPLOADS_PER_MISS  = uploads ahead / misses without them          (what each miss removed cost in uploads)

With ``--profile`` (the routing profile traced in the run) also PREFETCH_OVERLAP, the share of the uploads ahead's
link time hidden behind compute: the run is replanned as it ran (lab/bench/replan.py) with uploads ahead forced on
and off, and the share solved, per stream count, so that the predicted generation with them over without them is
the measured one (WITH over the mean of BASE and its A/A control, CONTROL, as the run interleaved them). A share
is between 0 and 1: a solution below 0 (the uploads ahead cost more than their bytes) is stored as 0.

usage: lab/bench/fit_prefetch_shares.py BENCH.json[.xz] [--base plan] [--with plan-prefetch]
                                        [--control plan-control] [--profile PROFILE.json.xz] [--write [RATES_JSON]]
"""

from __future__ import annotations

import argparse
import json
import lzma
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(Path(__file__).resolve().parent)]


def _read(path: Path) -> dict:
    raw = path.read_bytes()
    return json.loads(lzma.decompress(raw) if path.suffix == ".xz" else raw)


def shares(bench: dict, base: str, with_: str) -> dict[int, tuple[float, float]]:
    """Streams -> (miss cut, uploads ahead per miss without them)."""
    runs = {r["config"]: r for r in bench["runs"] if r.get("status") == "ok"}
    for name in (base, with_):
        if name not in runs:
            raise SystemExit(f"no configuration {name!r} that ran in this bench (it has: {', '.join(runs)})")
    out = {}
    for streams, b in sorted(runs[base]["samples"].get("tg_streams", {}).items(), key=lambda kv: int(kv[0])):
        w = runs[with_]["samples"]["tg_streams"].get(streams)
        if not w or not b.get("moe_cache", {}).get("misses"):
            continue
        before, after = b["moe_cache"], w["moe_cache"]
        out[int(streams)] = (1.0 - after["misses"] / before["misses"], after["prefetch_uploads"] / before["misses"])
    return out


def _tps(bench: dict, config: str, streams: str) -> float:
    runs = [r for r in bench["runs"] if r["config"] == config and r.get("status") == "ok"]
    return statistics.median(x["tps"] for r in runs for x in r["samples"]["tg_streams"][streams]["runs"])


def overlaps(bench: dict, bench_path: Path, profile: Path, base: str, with_: str, control: str,
             got: dict[int, tuple[float, float]]) -> dict[int, tuple[float, float, float]]:
    """Streams -> (the overlap solved, unclamped; the measured ratio with / without; the predicted one at the share
    stored), with the miss cut and uploads per miss ``got`` held."""
    import replan as P

    from orchestrator.plan import rates as R

    runs = {r["config"]: r for r in bench["runs"] if r.get("status") == "ok"}
    if control not in runs:
        raise SystemExit(f"no configuration {control!r} that ran in this bench (it has: {', '.join(runs)})")
    w, curve, run = P.workload(bench_path), P.curve(profile), runs[base]
    features = frozenset({"expert_cache_prefetch"})
    cut = {s: v[0] for s, v in got.items()}
    uploads = {s: v[1] for s, v in got.items()}
    out = {}
    for streams in got:
        s = str(streams)
        pick = (lambda wk: wk.predicted.tg) if streams == 1 else (lambda wk: wk.predicted.tg_streams)
        measured = _tps(bench, with_, s) / statistics.mean([_tps(bench, base, s), _tps(bench, control, s)])
        with P.rates(PREFETCH_MISS_CUT=cut, PREFETCH_UPLOADS_PER_MISS=uploads):
            off = pick(P.replan(bench, run, w, curve, features, expert_cache_prefetch="off"))

            def ratio(o: float) -> float:
                with P.rates(PREFETCH_OVERLAP={**R.PREFETCH_OVERLAP, streams: o}):
                    return pick(P.replan(bench, run, w, curve, features, expert_cache_prefetch="on")) / off

            solved = P.solve(lambda o: ratio(o) - measured, -1.0, 1.0, iters=24)
            out[streams] = (solved, measured, ratio(R.PREFETCH_OVERLAP.get(streams, 0.0)))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bench", type=Path)
    ap.add_argument("--base", default="plan", help="the configuration without uploads ahead (default plan)")
    ap.add_argument("--with", dest="with_", default="plan-prefetch",
                    help="the configuration with them (default plan-prefetch)")
    ap.add_argument("--control", default="plan-control",
                    help="the A/A control of the configuration without them (default plan-control)")
    ap.add_argument("--profile", type=Path, help="the routing profile traced in the run: fit PREFETCH_OVERLAP too")
    ap.add_argument("--write", nargs="?", const="", metavar="RATES_JSON",
                    help="store the shares, rounded to their resolution, in orchestrator/_data/rates.json (or the "
                         "RATES_JSON given)")
    args = ap.parse_args()
    got = shares(_read(args.bench), args.base, args.with_)
    if not got:
        print(f"{args.bench}: no generation streams with the cache's counters in both configurations", file=sys.stderr)
        return 1
    for streams, (cut, uploads) in got.items():
        print(f"{streams} stream(s): PREFETCH_MISS_CUT {cut:.4f}, PREFETCH_UPLOADS_PER_MISS {uploads:.4f}")
    fitted = {"PREFETCH_MISS_CUT": {s: v[0] for s, v in got.items()},
              "PREFETCH_UPLOADS_PER_MISS": {s: v[1] for s, v in got.items()}}
    if args.profile:
        from lab.rates_file import load, rounded

        # the replan sees the shares as they are stored
        res = {n: c["resolution"] for n, c in load()["constants"].items()}
        held = {s: (rounded(c, res["PREFETCH_MISS_CUT"]), rounded(u, res["PREFETCH_UPLOADS_PER_MISS"]))
                for s, (c, u) in got.items()}
        solved = overlaps(_read(args.bench), args.bench, args.profile, args.base, args.with_, args.control, held)
        for streams, (o, measured, at_stored) in solved.items():
            print(f"{streams} stream(s): PREFETCH_OVERLAP {o:+.4f}{' (stored as 0)' if o < 0 else ''}: measured "
                  f"{measured:.3f}x with uploads ahead, predicted {at_stored:.3f}x at the share in rates.py")
        fitted["PREFETCH_OVERLAP"] = {s: min(1.0, max(0.0, v[0])) for s, v in solved.items()}
    if args.write is not None:
        from lab.rates_file import write_fitted

        for line in write_fitted(fitted, args.write or None):
            print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
