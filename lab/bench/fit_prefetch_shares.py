#!/usr/bin/env python3
"""The shares the plan weighs uploads ahead of need (--moe-cache-prefetch) with, from the cache's counters of one run.

For each number of streams the run decoded with (``bench --tg-streams``), from the expert cache's counters over the
generation samples of the plan without uploads ahead (BASE) and the same plan with them (WITH):

    PREFETCH_MISS_CUT          = 1 - misses with them / misses without them   (the misses they turned into hits)
    PREFETCH_UPLOADS_PER_MISS  = uploads ahead / misses without them          (what each miss removed cost in uploads)

usage: lab/bench/fit_prefetch_shares.py BENCH.json[.xz] [--base plan] [--with plan-prefetch] [--write [RATES_JSON]]
"""

from __future__ import annotations

import argparse
import json
import lzma
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO)]


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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bench", type=Path)
    ap.add_argument("--base", default="plan", help="the configuration without uploads ahead (default plan)")
    ap.add_argument("--with", dest="with_", default="plan-prefetch",
                    help="the configuration with them (default plan-prefetch)")
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
    if args.write is not None:
        from lab.rates_file import write_fitted

        for line in write_fitted({"PREFETCH_MISS_CUT": {s: v[0] for s, v in got.items()},
                                  "PREFETCH_UPLOADS_PER_MISS": {s: v[1] for s, v in got.items()}},
                                 args.write or None):
            print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
