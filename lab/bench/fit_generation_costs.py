#!/usr/bin/env python3
"""Fit the generation path's four constants of rates.py on runs without an expert cache, and show every point.

The plan predicts a generated token on a GPU worker as (orchestrator/plan/predict.py, _decode_step)

    GPU bytes / (data-sheet bandwidth x GPU_TG_EFFICIENCY) + layers x GPU_LAYER_OVERHEAD_S
    + host-resident expert bytes / (the probe's host bandwidth x CPU_TG_EFFICIENCY)
    + host-resident expert layers x CROSS_DEVICE_LAYER_OVERHEAD_S

which is linear in 1/GPU_TG_EFFICIENCY, GPU_LAYER_OVERHEAD_S, 1/CPU_TG_EFFICIENCY and
CROSS_DEVICE_LAYER_OVERHEAD_S. Each configuration that places its expert layers by ``-ot``, ``--n-cpu-moe`` or
``--cpu-moe`` is planned again with those layers in host memory and no cache (lab/bench/replan.py: the recorded
H200 with the run's VRAM budget, its probe's bandwidth of the day), the plan's own prediction taken at five
settings of the constants for its coefficients. A llama-bench JSONL (``-o jsonl``) adds its generation rows of the
whole model on the GPU. Least squares on the relative error of the token time (the median of a configuration's
generation samples):

  GPU_TG_EFFICIENCY is held (rates.py's, or --gpu-efficiency): runs of one GPU cannot tell the bytes' time from the
  per-layer time (every W1 point has its 48 layers on the GPU; the free fit of all four is printed beside).
  GPU_LAYER_OVERHEAD_S from the runs with every layer on the GPU;
  CPU_TG_EFFICIENCY and CROSS_DEVICE_LAYER_OVERHEAD_S from those with expert layers in host memory, where they are
  given (two placements at least), on top of it.

usage: lab/bench/fit_generation_costs.py [BENCH.json[.xz] ...] LLAMA_BENCH.jsonl[.xz] [...] [--gpu-efficiency E]
                                        [--write [RATES_JSON]]
"""

from __future__ import annotations

import argparse
import json
import lzma
import statistics
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(Path(__file__).resolve().parent)]

import replan as P  # noqa: E402

NAMES = ("GPU_TG_EFFICIENCY", "GPU_LAYER_OVERHEAD_S", "CPU_TG_EFFICIENCY", "CROSS_DEVICE_LAYER_OVERHEAD_S")
NO_CACHE = frozenset({"expert_cache", "expert_cache_slot_reads"})
HUGE = 1e30                                   # an efficiency that makes its bytes cost nothing


def _host_layers(argv: list[str], n_layers: int) -> tuple[int, ...] | None:
    if "--cpu-moe" in argv:
        return tuple(range(n_layers))
    if "--n-cpu-moe" in argv:
        return tuple(range(int(argv[argv.index("--n-cpu-moe") + 1])))
    if "-ot" in argv:
        return P.host_layers_and_cache(argv)[0]
    return None


def coefficients(w: str, layers: tuple[int, ...], vram_budget: int | None, bandwidth: dict | None) -> list[float]:
    """(the token time with the four terms at nothing, then each term's coefficient) of the plan's prediction."""
    def t(**values) -> float:
        settings = {"GPU_TG_EFFICIENCY": HUGE, "GPU_LAYER_OVERHEAD_S": 0.0, "CPU_TG_EFFICIENCY": HUGE,
                    "CROSS_DEVICE_LAYER_OVERHEAD_S": 0.0, **values}
        with P.rates(**settings):
            wk = P.plan_worker(w, None, layers, 0, 512, 1, vram_budget, bandwidth, without=NO_CACHE)
        got = P.host_layers_and_cache(list(wk.args))[0] if "-ot" in wk.args else ()
        if sorted(got) != sorted(layers):
            raise SystemExit(f"the replan keeps the experts of layers {got} in host memory, the run {layers}")
        return 1.0 / wk.predicted.tg
    c0 = t()
    return [c0, t(GPU_TG_EFFICIENCY=1.0) - c0, t(GPU_LAYER_OVERHEAD_S=1.0) - c0, t(CPU_TG_EFFICIENCY=1.0) - c0,
            t(CROSS_DEVICE_LAYER_OVERHEAD_S=1.0) - c0]


def _read(path: Path) -> bytes:
    data = path.read_bytes()
    return lzma.decompress(data) if path.suffix == ".xz" else data


def points(path: Path) -> list[dict]:
    w = P.workload(path) if path.name.startswith("w") else "w1"
    n_layers = P.model(w).n_layers
    if ".jsonl" in path.name:
        rows = [json.loads(line) for line in _read(path).decode().splitlines() if line.strip()]
        gen = [r for r in rows if r["n_gen"] and not r["n_prompt"] and r["n_cpu_moe"] == 0
               and r["tensor_buft_overrides"] == "none" and r["n_gpu_layers"] >= n_layers]
        return [dict(name=f"{path.parent.name}/tg{r['n_gen']}", layers=(), t=1.0 / r["avg_ts"],
                     coef=coefficients(w, (), None, None)) for r in gen]
    bench = json.loads(_read(path))
    bandwidth = (bench.get("plan_context") or {}).get("bandwidth")
    out, seen = [], {}
    for run in bench["runs"]:
        argv = run["argv"]
        tg = [s["tps"] for s in run["samples"].get("tg", [])]
        layers = _host_layers(argv, n_layers)
        if run.get("status") != "ok" or not tg or layers is None or "--moe-cache-mib" in argv:
            continue
        if layers not in seen:
            seen[layers] = coefficients(w, layers, bench["vram_budget"], bandwidth)
        out.append(dict(name=f"{path.parent.name}/{path.name.split('.')[0]}/{run['config']}", layers=layers,
                        t=1.0 / statistics.median(tg), coef=seen[layers]))
    return out


def fit(pts: list[dict]) -> dict[str, float]:
    """All four constants free (ill-conditioned on runs of one GPU: printed for the record)."""
    a = [[c / p["t"] for c in p["coef"][1:]] for p in pts]
    b = [(p["t"] - p["coef"][0]) / p["t"] for p in pts]
    (inv_g, layer, inv_c, cross), *_ = np.linalg.lstsq(np.array(a), np.array(b), rcond=None)
    return {"GPU_TG_EFFICIENCY": 1.0 / inv_g, "GPU_LAYER_OVERHEAD_S": layer, "CPU_TG_EFFICIENCY": 1.0 / inv_c,
            "CROSS_DEVICE_LAYER_OVERHEAD_S": cross}


def fit_gpu_layer(pts: list[dict], gpu_eff: float) -> float:
    """GPU_LAYER_OVERHEAD_S on the points with every layer on the GPU, the efficiency held."""
    a = [p["coef"][2] / p["t"] for p in pts]
    b = [(p["t"] - p["coef"][0] - p["coef"][1] / gpu_eff) / p["t"] for p in pts]
    return sum(x * y for x, y in zip(a, b)) / sum(x * x for x in a)


def fit_host(pts: list[dict], gpu_eff: float, gpu_layer: float) -> tuple[float, float]:
    """(CPU_TG_EFFICIENCY, CROSS_DEVICE_LAYER_OVERHEAD_S) on the points with expert layers in host memory."""
    a = [[p["coef"][3] / p["t"], p["coef"][4] / p["t"]] for p in pts]
    b = [(p["t"] - p["coef"][0] - p["coef"][1] / gpu_eff - p["coef"][2] * gpu_layer) / p["t"] for p in pts]
    (inv_c, cross), *_ = np.linalg.lstsq(np.array(a), np.array(b), rcond=None)
    return 1.0 / float(inv_c), float(cross)


def predict(p: dict, v: dict[str, float]) -> float:
    c = p["coef"]
    return c[0] + c[1] / v["GPU_TG_EFFICIENCY"] + c[2] * v["GPU_LAYER_OVERHEAD_S"] + c[3] / v["CPU_TG_EFFICIENCY"] \
        + c[4] * v["CROSS_DEVICE_LAYER_OVERHEAD_S"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--gpu-efficiency", type=float, help="GPU_TG_EFFICIENCY to hold (default: rates.py's)")
    ap.add_argument("--write", nargs="?", const="", metavar="RATES_JSON",
                    help="store the fitted constants, rounded to their resolution, in orchestrator/_data/rates.json "
                         "(or the RATES_JSON given)")
    args = ap.parse_args()
    from orchestrator.plan import rates as R

    pts = [p for path in args.runs for p in points(path)]
    gpu = [p for p in pts if not p["layers"]]
    host = [p for p in pts if p["layers"]]
    if not gpu:
        print("no run with every layer on the GPU: GPU_LAYER_OVERHEAD_S is not determined", file=sys.stderr)
        return 1
    cur = {n: getattr(R, n) for n in NAMES}
    eff = args.gpu_efficiency or R.GPU_TG_EFFICIENCY
    got = {"GPU_TG_EFFICIENCY": eff, "GPU_LAYER_OVERHEAD_S": fit_gpu_layer(gpu, eff)}
    fitted = ["GPU_LAYER_OVERHEAD_S"]
    if len({p["layers"] for p in host}) >= 2:
        got["CPU_TG_EFFICIENCY"], got["CROSS_DEVICE_LAYER_OVERHEAD_S"] = fit_host(host, eff,
                                                                                got["GPU_LAYER_OVERHEAD_S"])
        fitted += ["CPU_TG_EFFICIENCY", "CROSS_DEVICE_LAYER_OVERHEAD_S"]
    else:
        got.update({n: cur[n] for n in ("CPU_TG_EFFICIENCY", "CROSS_DEVICE_LAYER_OVERHEAD_S")})
    print(f"GPU_TG_EFFICIENCY held at {eff}; fitted on {len(gpu)} runs all on the GPU and {len(host)} with expert "
          f"layers in host memory ({len({p['layers'] for p in host})} placements):")
    for n in NAMES:
        print(f"  {n:32s} {got[n]:.6g}{'' if n in fitted else ' (held)':8s} rates.py {cur[n]:.6g}")
    if len({p["layers"] for p in pts}) >= 4:
        free = fit(pts)
        print("  all four free: " + ", ".join(f"{n} {free[n]:.4g}" for n in NAMES))

    def rms(v: dict) -> float:
        return (sum((predict(p, v) / p["t"] - 1) ** 2 for p in pts) / len(pts)) ** 0.5

    print(f"relative rms of the token time: fitted {rms(got):.4f}, rates.py {rms(cur):.4f}")
    print(f"\n{'run':56s} {'host':>4s} {'tg':>7s} {'fitted':>7s} {'ratio':>6s} {'rates.py':>8s} {'ratio':>6s}")
    for p in pts:
        f, c = 1.0 / predict(p, got), 1.0 / predict(p, cur)
        print(f"{p['name']:56s} {len(p['layers']):4d} {1 / p['t']:7.1f} {f:7.1f} {f * p['t']:6.3f} {c:8.1f} "
              f"{c * p['t']:6.3f}")
    if args.write is not None:
        from lab.rates_file import write_fitted

        for line in write_fitted({n: got[n] for n in fitted}, args.write or None):
            print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
