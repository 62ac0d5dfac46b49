"""Per-round ratios of a series-regression bench (lab/device/series-regression.sh): the new build over the old
one and the old build again over itself (the A/A control), for pp512, pp4096 and tg128 — their medians and ranges
over the interleaved rounds.

    python lab/bench/series_ratios.py BENCH.json[.xz] [...]
"""

from __future__ import annotations

import json
import lzma
import statistics
import sys

METRICS = ("pp512", "pp4096", "tg128")


def per_run(run: dict) -> dict[str, float]:
    s = run["samples"]
    out = {f"pp{p['n']}": p["tps"] for p in s.get("pp", [])}
    tg = [t["tps"] for t in s.get("tg", []) if t.get("depth") == 0]
    if tg:
        out["tg128"] = statistics.median(tg)
    return out


def ratios(doc: dict, new: str = "new", old: str = "plan", control: str = "plan-control") -> dict[str, dict]:
    rounds: dict[int, dict[str, dict]] = {}
    for r in doc["runs"]:
        if r.get("status") == "ok":
            rounds.setdefault(r["round"], {})[r["config"]] = per_run(r)
    full = [c for c in rounds.values() if {new, old, control} <= set(c)]
    if not full:
        raise SystemExit("no round ran all three of new, old and the control")
    out = {}
    for m in METRICS:
        nr = [c[new][m] / c[old][m] for c in full if m in c[old]]
        aa = [c[control][m] / c[old][m] for c in full if m in c[old]]
        out[m] = {"old": statistics.median(c[old][m] for c in full), "new": statistics.median(c[new][m] for c in full),
                  "new_over_old": (statistics.median(nr), min(nr), max(nr)),
                  "control_over_old": (statistics.median(aa), min(aa), max(aa)), "rounds": len(full)}
    return out


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.strip())
        return 2
    for path in argv:
        opener = lzma.open if path.endswith(".xz") else open
        with opener(path, "rt") as f:
            doc = json.load(f)
        print(path)
        for m, r in ratios(doc).items():
            n, a = r["new_over_old"], r["control_over_old"]
            print(f"  {m:7s} old {r['old']:8.1f}  new {r['new']:8.1f}  new/old {n[0]:.3f} [{n[1]:.3f}-{n[2]:.3f}]"
                  f"  A/A {a[0]:.3f} [{a[1]:.3f}-{a[2]:.3f}]  ({r['rounds']} rounds)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
