#!/usr/bin/env python3
"""Fit the expert cache's generation costs on measured `run.sh w1-cache` runs, and show every configuration.

The planner predicts a token's time on the cache path as (see orchestrator/plan/expert_cache.py)

    base + (GPU-resident + host-layer picks) / GPU bw + misses / (pinned PCIe bw x E) + host layers x L + F

where base, the GPU bandwidth and the pinned bandwidth are the plan's own (its roofline, the data sheet at
GPU_TG_EFFICIENCY, the probe), and E (CACHE_UPLOAD_EFFICIENCY), L (CACHE_LAYER_OVERHEAD_S) and F (CACHE_FIXED_S)
are constants of orchestrator/plan/rates.py. Each configuration that uploads its misses gives one linear equation
in 1/E, L and F (its hit rate from the cache's own counters, its generation from the bench): they are solved by
least squares on the relative error of the token time. The configurations with ``--moe-cache-cpu-misses`` are
shown beside, with what the model predicts for them from the routing profile's replayed shares where a profile
is given for their model (``--profile MODEL_NAME=PATH``): the CPU path's own costs, CACHE_CPU_MISS_FIXED_S per
token and CACHE_CPU_MISS_HOP_S per layer that has a CPU miss (the hop GPU -> CPU -> GPU), are fitted on them.

usage: lab/bench/fit_cache_costs.py RUN [RUN ...] [--profile w1-loc-default=PROFILE.json ...] [--upload current]
                                   [--write [RATES_JSON]]

With ``--upload current`` the upload path's three constants are not fitted but taken from rates.py, as the planner
uses them: the runs then check them out of sample, and the CPU path's costs are fitted on top of them.

With ``--write`` what this run fitted is stored in orchestrator/_data/rates.json: the three upload constants when
they were fitted, else (``--upload current``) the CPU path's two, fitted on top of the stored upload constants.

A RUN is a bench output directory whose parent holds the plan it ran (plan-<B>g.json, as run.sh writes), a bench
JSON (NAME.json or NAME.json.xz) beside its plan (plan-NAME.json[.xz], as docs/benchmarks keeps them), or
BENCH=PLAN. The current fit: docs/benchmarks.md, "Predictions".
"""

from __future__ import annotations

import argparse
import json
import lzma
import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO)]

from orchestrator.model.routing_profile import RoutingProfile  # noqa: E402
from orchestrator.plan import rates as R  # noqa: E402

MIB = 1 << 20


@dataclass(frozen=True)
class Point:
    run: str
    config: str
    host_layers: int
    slots_per_layer: int
    hit_rate: float            # the cache's counters (0 without a cache)
    tg: float                  # median tokens/s over the run's generation samples
    cpu_misses: bool
    base: float                # the plan's per-token time beside the routed experts
    gpu_bytes: float           # routed-expert bytes the GPU reads per token (whole layers + cache)
    host_picks: float          # bytes of the host layers' picks per token
    pinned: float              # the probe's pinned host->device bytes/s
    gpu_bw: float
    host_bw: float
    model: str


def _load(path: Path) -> dict:
    data = path.read_bytes()
    return json.loads(lzma.decompress(data) if path.suffix == ".xz" else data)


def _pair(spec: str) -> tuple[Path, Path]:
    """(bench JSON, plan JSON) of a RUN argument."""
    if "=" in spec:
        bench, plan = spec.split("=", 1)
        return Path(bench), Path(plan)
    run = Path(spec)
    if run.is_dir():
        name = run.name.rsplit("-", 1)[-1]            # w1-12g -> 12g
        return run / "bench.json", run.parent / f"plan-{name}.json"
    stem = run.name.split(".json")[0]
    return run, run.with_name(f"plan-{stem}.json{'.xz' if run.suffix == '.xz' else ''}")


def _host_layers(args: list[str]) -> int | None:
    """Layers whose routed experts the argv keeps in host memory (``-ot 'blk\\.(0|1|...)\\.ffn_...=CPU'``, or
    ``--n-cpu-moe N``); None for an argv that places them some other way (``--fit``)."""
    if "--n-cpu-moe" in args:
        return int(args[args.index("--n-cpu-moe") + 1])
    if "-ot" in args:
        m = re.match(r"blk\\\.\(([0-9|]+)\)", args[args.index("-ot") + 1])
        return len(m.group(1).split("|")) if m else None
    return None


def points(spec: str) -> list[Point]:
    bench_path, plan_path = _pair(spec)
    for p in (bench_path, plan_path):
        if not p.is_file():
            raise SystemExit(f"{spec}: {p} not found")
    bench, plan = _load(bench_path), _load(plan_path)
    run = bench_path.parent if bench_path.name == "bench.json" else bench_path
    cache = plan["workers"][0].get("expert_cache")
    if not cache:
        raise SystemExit(f"{plan_path}: the plan has no expert-cache block")
    c = cache["chosen"]
    base = 1.0 / c["tokens_per_s"] - c["expert_seconds_per_token"]
    bw = bench["plan_context"]["bandwidth"]
    pinned = bw["gpu_h2d"][0]["bytes_per_s"]
    host_bw = bw["host"][0]["bytes_per_s"] * R.CPU_TG_EFFICIENCY
    gpu_bw = R.gpu_memory_bandwidth(bench["gpus"][0]["name"])[0] * R.GPU_TG_EFFICIENCY
    n_expert, used = plan["model"]["n_expert"], plan["model"]["n_expert_used"]
    model = Path(plan["model"]["path"]).stem
    out = []
    layers = plan["model"]["n_layers"]
    layer_bytes = plan["model"]["routed_expert_bytes"] / layers
    for cfg in bench["configs"]:
        h = _host_layers(cfg["args"])
        if h is None:
            continue
        runs = [r for r in bench["runs"] if r["config"] == cfg["name"] and r.get("status") == "ok"]
        tg = [s["tps"] for r in runs for s in r["samples"].get("tg", [])]
        if not tg:
            continue
        expert = layer_bytes / n_expert
        a = cfg["args"]
        mib = int(a[a.index("--moe-cache-mib") + 1]) if "--moe-cache-mib" in a else 0
        slots = min(int(mib * MIB // (h * expert)), n_expert) if mib and h else 0
        counters = [r["samples"].get("moe_cache") for r in runs]
        hits = sum(m["hits"] for m in counters if m)
        lookups = sum(m["lookups"] for m in counters if m)
        out.append(Point(run=str(run), config=cfg["name"], host_layers=h, slots_per_layer=slots,
                         hit_rate=hits / lookups if lookups else 0.0, tg=statistics.median(tg),
                         cpu_misses="--moe-cache-cpu-misses" in cfg["args"], base=base,
                         gpu_bytes=(layers - h) * used * expert + (h * used * expert if slots else 0.0),
                         host_picks=h * used * expert, pinned=pinned, gpu_bw=gpu_bw, host_bw=host_bw,
                         model=model))
    return out


def predict_upload(pt: Point, eff: float, layer_s: float, fixed_s: float) -> float:
    misses = (1.0 - pt.hit_rate) * pt.host_picks
    t = pt.base + pt.gpu_bytes / pt.gpu_bw + misses / (pt.pinned * eff) + pt.host_layers * layer_s + fixed_s
    return 1.0 / t


def predict_no_cache(pt: Point) -> float:
    t = (pt.base + pt.gpu_bytes / pt.gpu_bw + pt.host_picks / pt.host_bw
         + pt.host_layers * R.CROSS_DEVICE_LAYER_OVERHEAD_S)
    return 1.0 / t


def fit(pts: list[Point]) -> tuple[float, float, float]:
    """Least squares on (predicted - measured) / measured token time; returns (E, L, F)."""
    a, b = [], []
    for pt in pts:
        t = 1.0 / pt.tg
        misses = (1.0 - pt.hit_rate) * pt.host_picks
        a.append([misses / pt.pinned / t, pt.host_layers / t, 1.0 / t])
        b.append((t - pt.base - pt.gpu_bytes / pt.gpu_bw) / t)
    x, *_ = np.linalg.lstsq(np.array(a), np.array(b), rcond=None)
    inv_e, layer_s, fixed_s = (float(v) for v in x)
    return 1.0 / inv_e, layer_s, fixed_s


def cpu_parts(pt: Point, prof: RoutingProfile, eff: float, layer_s: float, fixed_s: float):
    """With CPU-computed misses: (hit, upload, CPU shares replayed on the profile, the token time without the CPU
    path's own costs, the host layers' expected number of CPU hops per token)."""
    hit, up = prof.cpu_misses.at(pt.slots_per_layer / 128)
    on_cpu = max(0.0, 1.0 - hit - up)
    hops = pt.host_layers * (1.0 - (1.0 - on_cpu) ** 8)   # a layer needs the CPU for a token with a CPU miss
    rest = (pt.base + (pt.gpu_bytes - on_cpu * pt.host_picks) / pt.gpu_bw
            + up * pt.host_picks / (pt.pinned * eff) + on_cpu * pt.host_picks / pt.host_bw
            + pt.host_layers * layer_s + fixed_s)
    return hit, up, on_cpu, rest, hops


def fit_cpu(rows: list[tuple[Point, float, float]]) -> tuple[float, float]:
    """(per token, per CPU hop) of the CPU-miss path, least squares on the token time left over."""
    a = [[1.0, hops] for _pt, _rest, hops in rows]
    b = [1.0 / pt.tg - rest for pt, rest, _hops in rows]
    (per_token, per_hop), *_ = np.linalg.lstsq(np.array(a), np.array(b), rcond=None)
    return float(per_token), float(per_hop)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--profile", action="append", default=[], metavar="MODEL=PATH",
                    help="the routing profile of the model named MODEL (file stem), for the CPU-miss rows: JSON or "
                         "JSON.xz, as `orchestrator model --routing` caches it (tests/fixtures/routing/*.profile.json.xz)")
    ap.add_argument("--upload", choices=("fit", "current"), default="fit",
                    help="fit the upload path's constants on these runs (default), or take rates.py's and check them")
    ap.add_argument("--write", nargs="?", const="", metavar="RATES_JSON",
                    help="store the fitted constants, rounded to their resolution, in "
                         "orchestrator/_data/rates.json (or the RATES_JSON given)")
    a = ap.parse_args()
    profiles = {}
    for spec in a.profile:
        name, _, path = spec.partition("=")
        doc = _load(Path(path))
        # a profile, or the file `orchestrator model --routing` caches (the profile under "profile")
        profiles[name] = RoutingProfile.from_json(doc.get("profile", doc))
    pts = [pt for run in a.runs for pt in points(run)]
    up = [pt for pt in pts if pt.slots_per_layer and not pt.cpu_misses]
    cur = (R.CACHE_UPLOAD_EFFICIENCY, R.CACHE_LAYER_OVERHEAD_S, R.CACHE_FIXED_S)
    if a.upload == "current":
        eff, layer_s, fixed_s = cur
        print(f"not fitted: rates.py's constants, checked on {len(up)} configurations")
    elif len(up) < 3:
        print("fewer than three cache configurations that upload their misses: nothing to fit", file=sys.stderr)
        return 1
    else:
        eff, layer_s, fixed_s = fit(up)
        print(f"fitted on {len(up)} configurations: CACHE_UPLOAD_EFFICIENCY {eff:.3f}, "
              f"CACHE_LAYER_OVERHEAD_S {layer_s * 1e6:.1f} us, CACHE_FIXED_S {fixed_s * 1e3:.3f} ms")
    print(f"current:                          CACHE_UPLOAD_EFFICIENCY {cur[0]:.3f}, "
          f"CACHE_LAYER_OVERHEAD_S {cur[1] * 1e6:.1f} us, CACHE_FIXED_S {cur[2] * 1e3:.3f} ms\n")
    print(f"{'run':44} {'config':20} {'host':>4} {'slots':>5} {'hits':>6} {'tg':>7} {'fitted':>7} {'ratio':>6} "
          f"{'current':>7} {'ratio':>6}")
    worst = 0.0
    for pt in pts:
        run = "/".join(Path(pt.run).parts[-3:])
        if pt.cpu_misses:
            continue
        if pt.slots_per_layer:
            f, c = predict_upload(pt, eff, layer_s, fixed_s), predict_upload(pt, *cur)
            worst = max(worst, abs(f / pt.tg - 1))
        else:
            f = c = predict_no_cache(pt)
        print(f"{run:44} {pt.config:20} {pt.host_layers:4d} {pt.slots_per_layer:5d} {pt.hit_rate:6.3f} "
              f"{pt.tg:7.1f} {f:7.1f} {f / pt.tg:6.3f} {c:7.1f} {c / pt.tg:6.3f}")
    print(f"\n{'fitted' if a.upload == 'fit' else 'current'}: every cache configuration within {worst:.1%} of its "
          "measured generation")
    if a.write is not None and a.upload == "fit":
        from lab.rates_file import write_fitted

        for line in write_fitted({"CACHE_UPLOAD_EFFICIENCY": eff, "CACHE_LAYER_OVERHEAD_S": layer_s,
                                  "CACHE_FIXED_S": fixed_s}, a.write or None):
            print(line)
    cpu = [pt for pt in pts if pt.cpu_misses]
    if not cpu:
        if a.write is not None and a.upload == "current":
            print("not written: no configuration with --moe-cache-cpu-misses in these runs", file=sys.stderr)
            return 1
        return 0
    print("\n--moe-cache-cpu-misses (hit / upload / CPU shares: the routing profile's replay of the patch's rule):")
    rows = []
    for pt in cpu:
        prof = profiles.get(pt.model)
        if prof is None or prof.cpu_misses is None:
            print(f"{pt.run}: no routing profile of {pt.model} given (--profile {pt.model}=PATH)")
            continue
        rows.append((pt, *cpu_parts(pt, prof, eff, layer_s, fixed_s)))
    if len(rows) < 2:
        if a.write is not None and a.upload == "current":
            print("not written: fewer than two CPU-miss configurations with a routing profile", file=sys.stderr)
            return 1
        return 0
    per_token, per_hop = fit_cpu([(pt, rest, hops) for pt, _h, _u, _c, rest, hops in rows])
    cur_token, cur_hop = R.CACHE_CPU_MISS_FIXED_S, R.CACHE_CPU_MISS_HOP_S
    print(f"fitted on {len(rows)}: CACHE_CPU_MISS_FIXED_S {per_token * 1e3:.2f} ms, CACHE_CPU_MISS_HOP_S "
          f"{per_hop * 1e6:.0f} us (current {cur_token * 1e3:.2f} ms, {cur_hop * 1e6:.0f} us)")
    print(f"{'run':44} {'host':>4} {'slots':>5} {'hits':>6} {'replay hit/up/cpu':>18} {'hops':>5} {'tg':>7} "
          f"{'fitted':>7} {'ratio':>6} {'upload':>7}")
    for pt, hit, up, on_cpu, rest, hops in rows:
        run = "/".join(Path(pt.run).parts[-3:])
        fitted = 1.0 / (rest + per_token + hops * per_hop)
        upload = next((q.tg for q in pts if q.run == pt.run and not q.cpu_misses and q.host_layers == pt.host_layers
                       and q.slots_per_layer == pt.slots_per_layer), float("nan"))
        print(f"{run:44} {pt.host_layers:4d} {pt.slots_per_layer:5d} {pt.hit_rate:6.3f} "
              f"{hit:6.3f}/{up:5.3f}/{on_cpu:5.3f} {hops:5.1f} {pt.tg:7.1f} {fitted:7.1f} {fitted / pt.tg:6.3f} "
              f"{upload:7.1f}")
    if a.write is not None and a.upload == "current":
        from lab.rates_file import write_fitted

        for line in write_fitted({"CACHE_CPU_MISS_FIXED_S": per_token, "CACHE_CPU_MISS_HOP_S": per_hop},
                                 a.write or None):
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
