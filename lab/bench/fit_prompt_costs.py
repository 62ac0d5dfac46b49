#!/usr/bin/env python3
"""Fit the GPU prompt costs of orchestrator/plan/rates.py on measured workload runs, and show every point.

The planner predicts a prompt micro-batch of b tokens on a GPU worker as (orchestrator/plan/predict.py, predict_pp)

    2 b x active parameters / (data-sheet FLOP/s x F)              the matrix products, the copied experts' too
  + layers x P x b / (b + PP_LAYER_BATCH_HALF)                      what every layer costs beyond them
  + host layers x O                                                 op offload's split per host-resident layer
  + (1 - f) x experts used x expert bytes / pinned bandwidth        the host-resident experts the batch copies
  + f x experts used x host layers x R                              those it reads from the expert cache's slots

with f the share of the batch's experts read from the slots (the cache's counters). F, P, O and R are fitted
(GPU_PP_FLOPS_EFFICIENCY, PP_LAYER_BATCH_S, OFFLOAD_LAYER_BATCH_S, PREFILL_READ_OVERHEAD_S), by least squares on
the relative error of each prompt's time; the pinned bandwidth is each run's probe at PINNED_COPY_EFFICIENCY.

Points: every configuration of a bench JSON that ran pp512/pp4096 with a known placement: our plans (their
plan JSON beside: host-resident layers, micro-batch) and llama.cpp's --fit (its host-resident experts from the
CUDA_Host model buffer it logged, less the token embeddings; micro-batch 512).

usage: lab/bench/fit_prompt_costs.py BENCH.json[.xz] [...] [--current | --write [RATES_JSON]]

A plan beside BENCH is plan-NAME.txt[.xz] (its "layers ... experts CPU" lines; plan-NAME-balanced for the config
plan-balanced; a second run NAME-b may share NAME's).
With --current the constants are not fitted: the points are shown against rates.py as it is. With --write the
fitted ones are stored in orchestrator/_data/rates.json (the recorded command there: its "fits").
"""

from __future__ import annotations

import argparse
import json
import lzma
import re
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO)]

from orchestrator.model import read_model, synth  # noqa: E402
from orchestrator.plan import rates as R  # noqa: E402
from orchestrator.plan.costs import model_costs  # noqa: E402
from orchestrator.plan.predict import experts_used  # noqa: E402

# the workloads' shapes, as lab/device/run.sh writes them
SHAPES = {"w1": ("qwen3-30b-a3b", None), "w2": ("qwen3-235b-a22b", 24)}
H200_FLOPS, _ = R.gpu_flops("NVIDIA H200")   # the data sheet the planner uses


def _read(path: Path) -> str:
    data = path.read_bytes()
    return (lzma.decompress(data) if path.suffix == ".xz" else data).decode()


def _costs(model: str):
    like, layers = SHAPES[model]
    with tempfile.TemporaryDirectory() as tmp:
        path = synth.write_header_only(Path(tmp) / f"{model}.gguf", like, quant="q4_0", layers=layers)
        return model_costs(read_model(path))


def _host_layers_of_plan(text: str) -> set[int]:
    """The layers whose experts the plan keeps in host memory (its "layers A-B ... experts CPU" lines)."""
    layers: set[int] = set()
    for a, b in re.findall(r"layers (\d+)-(\d+)\s+attention \S+\s+experts CPU", text):
        layers.update(range(int(a), int(b) + 1))
    layers.update(int(a) for a in re.findall(r"layers? (\d+)\s+attention \S+\s+experts CPU", text))
    return layers


def points(bench_path: Path, costs_of) -> list[dict]:
    bench = json.loads(_read(bench_path))
    stem = bench_path.name.split(".")[0]
    model = "w2" if "w2" in stem else "w1"
    costs = costs_of(model)
    pinned = bench["plan_context"]["bandwidth"]["gpu_h2d"][0]["bytes_per_s"] * R.PINNED_COPY_EFFICIENCY

    def plan_text(config: str) -> str | None:
        # plan-NAME for the plan and its A/A control, plan-NAME-VARIANT for a plan made otherwise (plan-VARIANT);
        # a second run's NAME-b shares them
        suffix = "-balanced" if config == "plan-balanced" else ""
        for base in (stem, stem.removesuffix("-b")):
            for ext in (".txt.xz", ".txt"):
                path = bench_path.with_name(f"plan-{base}{suffix}{ext}")
                if path.exists():
                    return _read(path)
        return None

    out = []
    for run in bench["runs"]:
        if run.get("status") != "ok" or not run["samples"].get("pp"):
            continue
        argv = run["argv"]
        if "--fit" in argv and argv[argv.index("--fit") + 1] == "on":
            host_model = run["llama"]["buffers"]["model"].get("CUDA_Host", 0)
            host = max(0.0, host_model - costs.input_bytes) / (sum(costs.layer_experts) / len(costs.moe_layers))
            ub = int(argv[argv.index("-ub") + 1]) if "-ub" in argv else 512
            last_host = host > 0          # --fit keeps the last layers' experts in host memory first
        elif run["config"] in ("plan", "plan-control", "plan-balanced") and plan_text(run["config"]):
            layers = _host_layers_of_plan(plan_text(run["config"]))
            host = float(len(layers))
            last_host = costs.n_compute_layers - 1 in layers
            ub = int(argv[argv.index("-ub") + 1])
        else:
            continue
        mc = run["samples"].get("moe_cache_pp") or {}
        for s in run["samples"]["pp"]:
            n = s["n"]
            c = mc.get(str(n)) or {}
            saved, copied = c.get("prefill_saved_bytes", 0), c.get("prefill_copied_bytes", 0)
            f = saved / (saved + copied) if saved + copied else 0.0
            out.append(dict(name=f"{stem}/{run['config']}", n=n, t=s["prompt_ms"] / 1e3, costs=costs, host=host,
                            ub=ub, f=f, pinned=pinned, last_host=last_host))
    return out


def regressors(p: dict) -> tuple[list[float], float]:
    """The four coefficients' multipliers and the fixed copy time of one point (its whole prompt)."""
    c = p["costs"]
    # the last layer's feed-forward runs for the prompt's output token only (ModelCosts.prompt_skip_ffn_layer):
    # neither its parameters nor, where its experts are in host memory, their copies count for the micro-batch
    skip = c.prompt_skip_ffn_layer
    active = sum(c.layer_always_params) + c.n_expert_used * sum(c.layer_expert_params)
    if skip is not None:
        active -= c.prompt_skip_ffn_params + c.n_expert_used * c.layer_expert_params[skip]
    host_layers = max(0.0, p["host"] - 1) if skip is not None and p["last_host"] else p["host"]
    expert = sum(c.layer_experts) / len(c.moe_layers) / c.n_expert
    flops = layer = host = reads = copy = 0.0
    remaining = p["n"]
    while remaining > 0:
        b = min(p["ub"], remaining)
        remaining -= b
        used = experts_used(c.n_expert, c.n_expert_used, b)
        flops += 2.0 * b * active / H200_FLOPS
        layer += c.n_compute_layers * b / (b + R.PP_LAYER_BATCH_HALF)
        host += host_layers
        reads += p["f"] * used * host_layers
        copy += (1.0 - p["f"]) * used * expert * host_layers / p["pinned"]
    return [flops, layer, host, reads], copy


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bench", nargs="+", type=Path)
    ap.add_argument("--current", action="store_true", help="show the points against rates.py, fit nothing")
    ap.add_argument("--write", nargs="?", const="", metavar="RATES_JSON",
                    help="store the fitted constants, rounded to their resolution, in "
                         "orchestrator/_data/rates.json (or the RATES_JSON given)")
    args = ap.parse_args()
    if args.current and args.write is not None:
        ap.error("--write stores what was fitted; --current fits nothing")
    cache: dict = {}
    pts = [p for b in args.bench for p in points(b, lambda m: cache.setdefault(m, _costs(m)))]
    if not pts:
        print("no points: no run with prompts and a known placement", file=sys.stderr)
        return 1
    rows = [regressors(p) for p in pts]
    X = np.array([r[0] for r in rows])
    C = np.array([r[1] for r in rows])
    T = np.array([p["t"] for p in pts])
    if args.current:
        coef = np.array([1.0 / R.GPU_PP_FLOPS_EFFICIENCY, R.PP_LAYER_BATCH_S, R.OFFLOAD_LAYER_BATCH_S,
                         R.PREFILL_READ_OVERHEAD_S])
    else:
        coef, *_ = np.linalg.lstsq(X / T[:, None], 1.0 - C / T, rcond=None)
        print(f"GPU_PP_FLOPS_EFFICIENCY = {1.0 / coef[0]:.3f}\nPP_LAYER_BATCH_S = {coef[1] * 1e6:.0f}e-6\n"
              f"OFFLOAD_LAYER_BATCH_S = {coef[2] * 1e6:.0f}e-6\nPREFILL_READ_OVERHEAD_S = {coef[3] * 1e6:.1f}e-6")
    pred = X @ coef + C
    for p, t in zip(pts, pred):
        print(f"{p['name']:32s} pp{p['n']:<5d} host {p['host']:5.1f} ub {p['ub']:5d} slots {p['f']:.2f}  measured "
              f"{p['t'] * 1e3:7.1f} ms  model {t * 1e3:7.1f} ms  {t / p['t'] - 1:+.3f}")
    err = pred / T - 1.0
    print(f"{len(pts)} points: largest error {np.abs(err).max():.3f}, rms {np.sqrt(np.mean(err ** 2)):.3f}")
    if args.write is not None:
        from lab.rates_file import write_fitted

        for line in write_fitted({"GPU_PP_FLOPS_EFFICIENCY": 1.0 / coef[0], "PP_LAYER_BATCH_S": coef[1],
                                  "OFFLOAD_LAYER_BATCH_S": coef[2], "PREFILL_READ_OVERHEAD_S": coef[3]},
                                 args.write or None):
            print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
