#!/usr/bin/env python3
"""Each family's cost per layer, measured as the difference between two cuts of one shape, against the plan's.

The plan predicts a generated token all on a GPU as bytes read / (data-sheet bandwidth x GPU_TG_EFFICIENCY) +
layers x GPU_LAYER_OVERHEAD_S, and a prompt's micro-batch as FLOPs at GPU_PP_FLOPS_EFFICIENCY of the data sheet +
a cost per layer (PP_LAYER_BATCH_S) (orchestrator/plan/predict.py). Two cuts of the same shape (the same widths and
ops, only the depth differs) separate what each layer costs from what a token costs once (embeddings, output head,
the graph's launch): the slope of the time between the two depths and its intercept. lab/device/run.sh's
``layer-costs`` step runs llama-bench on such pairs, interleaved round by round, and writes here:

  layer-costs.jsonl   llama-bench's JSON rows (``-o jsonl``), each with the ``variant`` it ran as (``default``,
                      ``graphs-off``: GGML_CUDA_DISABLE_GRAPHS=1) and its ``round``
  models.jsonl        one line per model file (``describe``): its shape and what the plan's costs read of it

``report DIR`` prints per family (cuts of one shape with the same expert type) and per test (tg, pp): the measured
time per layer (the slope between the medians; the spread of the rounds' own slopes beside it) and the fixed part,
the plan's prediction of both for the same files on the same device (the GPU's data sheet; on a CPU run its threads
at --host-bw), measured / predicted, and the part of the predicted slope that is bytes or FLOPs (the per-layer
constants at zero): measured minus it is the per-layer cost the constant would have to be. Then the same shape with
its experts in another type at the same depth (MXFP4 against Q4_0), and CUDA graphs on against off.

usage: lab/bench/layer_costs.py describe MODEL.gguf           one JSON line (models.jsonl)
       lab/bench/layer_costs.py brief RUN.jsonl               one llama-bench run's speeds in one line
       lab/bench/layer_costs.py report DIR [--json] [--host-bw GB/s]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import lzma
import re
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

ROWS = "layer-costs.jsonl"
MODELS = "models.jsonl"
# the per-layer constants of the speed model: at zero, what is left of a layer's predicted time is its bytes / FLOPs
LAYER_CONSTANTS = ("GPU_LAYER_OVERHEAD_S", "PP_LAYER_BATCH_S", "CPU_LAYER_OVERHEAD_S", "CPU_PP_LAYER_TOKEN_S")


class BadInput(Exception):
    """One line naming the file and what is wrong with it."""


# ---- describe ---------------------------------------------------------------------------------------------------


def describe(path: Path) -> dict:
    """A model file as the report needs it after the file is gone: its shape (what makes two cuts one family),
    its tensors' types and the plan's costs (:func:`orchestrator.plan.costs.model_costs`)."""
    from orchestrator.errors import ModelError
    from orchestrator.model import read_model
    from orchestrator.plan.costs import model_costs

    try:
        m = read_model(path)
    except (ModelError, OSError) as e:
        raise BadInput(f"{path}: {e}") from None
    expert = sorted({t.type for t in m.tensors if t.name.endswith("_exps.weight")})
    attn = sorted({t.type for t in m.tensors if re.search(r"\.attn_(q|q_a|kv_a_mqa|output)\.weight$", t.name)})
    title = re.sub(r", \d+ layers\)", ")", m.name or Path(path).stem)
    shape = dict(arch=m.arch, n_embd=m.n_embd, n_head=m.n_head, n_head_kv=m.n_head_kv, n_expert=m.n_expert,
                 n_expert_used=m.n_expert_used, n_ff_exp=m.n_ff_exp, n_vocab=m.n_vocab, experts="/".join(expert),
                 attention="/".join(attn))
    return {"file": Path(path).name, "title": title, "n_layers": m.n_layers, "n_dense_lead": m.n_dense_lead,
            "shape": shape, "file_bytes": m.file_bytes, "costs": dataclasses.asdict(model_costs(m))}


# ---- reading ----------------------------------------------------------------------------------------------------


def _lines(path: Path) -> list[tuple[int, dict]]:
    try:
        data = path.read_bytes()
        text = (lzma.decompress(data) if path.suffix == ".xz" else data).decode()
    except (OSError, lzma.LZMAError, UnicodeDecodeError) as e:
        raise BadInput(f"{path}: cannot read: {e}") from None
    out = []
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            doc = json.loads(line)
        except json.JSONDecodeError as e:
            raise BadInput(f"{path}: line {i} is not JSON ({e.msg})") from None
        if not isinstance(doc, dict):
            raise BadInput(f"{path}: line {i} is not a JSON object")
        out.append((i, doc))
    return out


def _find(d: Path, name: str) -> Path:
    for p in (d / name, d / (name + ".xz")):
        if p.is_file():
            return p
    raise BadInput(f"{d}: no {name} (the layer-costs step's output directory holds {ROWS} and {MODELS})")


ROW_FIELDS = ("model_filename", "n_prompt", "n_gen", "samples_ts", "n_gpu_layers")


def load(d: Path) -> tuple[list[dict], dict[str, dict]]:
    """(llama-bench rows, model descriptions by file name) of a step's output directory."""
    if not d.is_dir():
        raise BadInput(f"{d}: not a directory")
    models_path, rows_path = _find(d, MODELS), _find(d, ROWS)
    models = {}
    for i, m in _lines(models_path):
        if not {"file", "n_layers", "shape", "costs"} <= m.keys():
            raise BadInput(f"{models_path}: line {i} is not a model description (file, n_layers, shape, costs)")
        models[m["file"]] = m
    rows = []
    for i, r in _lines(rows_path):
        missing = [k for k in ROW_FIELDS if k not in r]
        if missing:
            raise BadInput(f"{rows_path}: line {i} is not a llama-bench row (no {', '.join(missing)})")
        name = Path(r["model_filename"]).name
        if name not in models:
            raise BadInput(f"{rows_path}: line {i}: {name} has no description in {models_path.name}")
        if not r["samples_ts"] or min(r["samples_ts"]) <= 0:
            raise BadInput(f"{rows_path}: line {i}: {name} has no positive samples_ts")
        rows.append({**r, "model": name, "variant": r.get("variant", "default"), "round": r.get("round", 0)})
    if not rows:
        raise BadInput(f"{rows_path}: no llama-bench rows")
    return rows, models


def test_name(r: dict) -> str:
    return f"pp{r['n_prompt']}" if r["n_prompt"] else f"tg{r['n_gen']}"


def seconds(r: dict, ts: float) -> float:
    """Seconds per token generated (tg) or per prompt (pp) of a sample."""
    return (r["n_prompt"] or 1) / ts


# ---- the plan's prediction ----------------------------------------------------------------------------------------


def _costs(model: dict):
    from lab.cpu_speed import costs_of

    # the CPU speed model's reader of a stored summary: descriptions written before the costs gained a field read
    # as the model says of them
    return costs_of({"name": model["file"], "costs": model["costs"]})


def device(r: dict) -> str:
    """The device a row ran on: its GPU's name, or CPU."""
    gpu = (r.get("gpu_info") or "").split(",")[0].strip()
    return gpu if gpu and r["n_gpu_layers"] > 0 else "CPU"


def predicted_seconds(model: dict, r: dict, host_bw: float) -> float:
    """What the plan predicts for the row's test, the whole model on the row's device (a GPU: its data sheet;
    the CPU: the row's threads at ``host_bw``), no KV cache read (short context)."""
    from orchestrator.plan import rates as R
    from orchestrator.plan.placement import GpuBudget, place_cpu_only, place_single
    from orchestrator.plan.predict import SpeedInputs, predict_pp, predict_tg

    costs = _costs(model)
    threads = int(r.get("n_threads") or 1)
    per_core, _ = R.cpu_flops_per_core(r.get("cpu_info"))
    dev = device(r)
    kv = [0] * costs.n_layers
    if dev == "CPU":
        placement = place_cpu_only(costs, kv)
        sp = SpeedInputs((), (), 1.0, host_bw, per_core * threads, threads=threads)
    else:
        placement = place_single(costs, kv, GpuBudget(0, dev, 1 << 60))
        sp = SpeedInputs((R.gpu_memory_bandwidth(dev)[0],), (R.gpu_flops(dev)[0],), 1.0, host_bw,
                         per_core * threads, threads=threads)
    if r["n_prompt"]:
        ts = predict_pp(costs, placement, sp, int(r.get("n_ubatch") or 512), None,
                        lengths=(r["n_prompt"],))[r["n_prompt"]]
    else:
        ts = predict_tg(costs, placement, sp)[0]
    return seconds(r, ts)


def without_layer_constants():
    from lab.cpu_speed import constants

    return constants(**{k: 0.0 for k in LAYER_CONSTANTS})


# ---- the report -------------------------------------------------------------------------------------------------


def _line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(slope, intercept) of the least-squares line through the points."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return slope, my - slope * mx


def analyse(rows: list[dict], models: dict[str, dict], host_bw: float) -> dict:
    # samples by (model file, variant, test), the rows that made them, and the rounds they ran in
    groups: dict[tuple, dict] = {}
    for r in rows:
        g = groups.setdefault((r["model"], r["variant"], test_name(r)), {"row": r, "t": [], "by_round": {}})
        ts = [seconds(r, x) for x in r["samples_ts"]]
        g["t"] += ts
        g["by_round"].setdefault(r["round"], []).extend(ts)

    def family_key(m: dict) -> str:
        return json.dumps(m["shape"], sort_keys=True)

    families: dict[str, dict] = {}          # in the order the step ran them
    first = {}
    for i, r in enumerate(rows):
        first.setdefault(r["model"], i)
    for (name, variant, test), g in sorted(groups.items(), key=lambda kv: (first[kv[0][0]], kv[0][1:])):
        m = models[name]
        fam = families.setdefault(family_key(m), {"title": m["title"], "shape": m["shape"], "tests": {}})
        fam["tests"].setdefault((variant, test), []).append((m, g))

    out = {"host_bw": host_bw, "families": [], "expert_types": [], "graphs": []}
    for fam in families.values():
        entry = {"family": f"{fam['title']}, experts {fam['shape']['experts']}", "shape": fam["shape"], "tests": []}
        for (variant, test), cuts in sorted(fam["tests"].items()):
            cuts.sort(key=lambda c: c[0]["costs"]["n_compute_layers"])
            depths = [c[0]["costs"]["n_compute_layers"] for c in cuts]
            meas = [statistics.median(g["t"]) for _, g in cuts]
            pred = [predicted_seconds(m, g["row"], host_bw) for m, g in cuts]
            with without_layer_constants():
                pred_bare = [predicted_seconds(m, g["row"], host_bw) for m, g in cuts]
            t = {"variant": variant, "test": test, "device": device(cuts[0][1]["row"]), "layers": depths,
                 "measured_s": meas, "predicted_s": pred, "samples": [len(g["t"]) for _, g in cuts]}
            if len(set(depths)) >= 2:
                t["slope_s"], t["fixed_s"] = _line(depths, meas)
                t["pred_slope_s"], t["pred_fixed_s"] = _line(depths, pred)
                t["pred_slope_bare_s"] = _line(depths, pred_bare)[0]
                rounds = set.intersection(*(set(g["by_round"]) for _, g in cuts))
                per_round = [_line(depths, [statistics.median(g["by_round"][k]) for _, g in cuts])[0]
                             for k in sorted(rounds)]
                t["round_slopes_s"] = per_round
            entry["tests"].append(t)
        out["families"].append(entry)

    # the same shape with its experts in another type, at a depth both have (default variant)
    by_shape: dict[str, list] = {}
    for fam in families.values():
        k = json.dumps({**fam["shape"], "experts": None}, sort_keys=True)
        by_shape.setdefault(k, []).append(fam)
    for fams in by_shape.values():
        for i, a in enumerate(fams):
            for b in fams[i + 1:]:
                for (variant, test), cuts_a in a["tests"].items():
                    if variant != "default" or ("default", test) not in b["tests"]:
                        continue
                    da = {c[0]["costs"]["n_compute_layers"]: c for c in cuts_a}
                    db = {c[0]["costs"]["n_compute_layers"]: c for c in b["tests"][("default", test)]}
                    for n in sorted(set(da) & set(db)):
                        (ma, ga), (mb, gb) = da[n], db[n]
                        moe = sum(1 for e in ma["costs"]["layer_experts"] if e > 0)
                        ta, tb = statistics.median(ga["t"]), statistics.median(gb["t"])
                        pa, pb = (predicted_seconds(ma, ga["row"], host_bw), predicted_seconds(mb, gb["row"], host_bw))
                        out["expert_types"].append({
                            "family": a["title"], "test": test, "layers": n, "moe_layers": moe,
                            "experts": [a["shape"]["experts"], b["shape"]["experts"]], "measured_s": [ta, tb],
                            "predicted_s": [pa, pb], "per_moe_layer_s": (ta - tb) / moe,
                            "pred_per_moe_layer_s": (pa - pb) / moe})

    # CUDA graphs on against off: the same file and test
    for (name, variant, test), g in sorted(groups.items()):
        if variant != "graphs-off" or (name, "default", test) not in groups:
            continue
        on = groups[(name, "default", test)]
        m = models[name]
        ton, toff = statistics.median(on["t"]), statistics.median(g["t"])
        out["graphs"].append({"file": name, "family": f"{m['title']}, experts {m['shape']['experts']}",
                              "test": test, "layers": m["costs"]["n_compute_layers"], "on_s": ton, "off_s": toff,
                              "off_minus_on_per_layer_s": (toff - ton) / m["costs"]["n_compute_layers"]})
    return out


def _us(x: float) -> str:
    return f"{x * 1e6:8.1f}"


def _ms(x: float) -> str:
    return f"{x * 1e3:8.2f}"


def _speed(test: str, s: float) -> float:
    return (1 if test.startswith("tg") else int(test[2:])) / s


def render(rep: dict) -> str:
    lines = []
    for fam in rep["families"]:
        lines.append(f"{fam['family']}")
        for t in fam["tests"]:
            test = t["test"]
            speeds = ", ".join(f"{n}: {_speed(test, s):.1f} t/s (plan {_speed(test, p):.1f})"
                               for n, s, p in zip(t["layers"], t["measured_s"], t["predicted_s"]))
            lines.append(f"  {test:6s} {t['variant']:10s} {t['device']}: {speeds}")
            if "slope_s" not in t:
                lines.append("         one depth only: no slope")
                continue
            unit = "per token" if test.startswith("tg") else "per prompt"
            rs = t["round_slopes_s"]
            spread = f" (rounds {min(rs) * 1e6:.1f}..{max(rs) * 1e6:.1f})" if len(rs) >= 2 else ""
            bare, const = t["pred_slope_bare_s"], t["pred_slope_s"] - t["pred_slope_bare_s"]
            lines.append(f"         per layer {unit}: measured {_us(t['slope_s'])} us{spread}, plan "
                         f"{_us(t['pred_slope_s'])} us, measured/plan {t['slope_s'] / t['pred_slope_s']:.2f}")
            lines.append(f"         of the plan's, bytes/FLOPs {_us(bare)} us, the per-layer constant {_us(const)} us;"
                         f" measured minus bytes/FLOPs {_us(t['slope_s'] - bare)} us")
            lines.append(f"         fixed {unit}: measured {_ms(t['fixed_s'])} ms, plan {_ms(t['pred_fixed_s'])} ms")
    if rep["expert_types"]:
        lines.append("\nexpert types at the same depth (per MoE layer: the first type's time minus the second's)")
        for e in rep["expert_types"]:
            (a, b), (ta, tb) = e["experts"], e["measured_s"]
            lines.append(f"  {e['family']} {e['layers']} layers {e['test']}: {a} {_ms(ta)} ms, {b} {_ms(tb)} ms; "
                         f"per MoE layer {_us(e['per_moe_layer_s'])} us, plan {_us(e['pred_per_moe_layer_s'])} us")
    if rep["graphs"]:
        lines.append("\nCUDA graphs off (GGML_CUDA_DISABLE_GRAPHS=1) against on, same file")
        for g in rep["graphs"]:
            lines.append(f"  {g['family']} {g['layers']} layers {g['test']}: on {_ms(g['on_s'])} ms, off "
                         f"{_ms(g['off_s'])} ms, off/on {g['off_s'] / g['on_s']:.3f}, per layer "
                         f"{_us(g['off_minus_on_per_layer_s'])} us")
    return "\n".join(lines)


def brief(path: Path) -> str:
    try:
        rows = [doc for _, doc in _lines(path)]
    except BadInput:
        rows = []
    return " ".join(f"{test_name(r)} {r['avg_ts']:.1f} t/s" for r in rows if "avg_ts" in r) or "no result"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("describe", help="one model file as models.jsonl holds it")
    d.add_argument("model", type=Path)
    b = sub.add_parser("brief", help="one llama-bench -o jsonl output in one line")
    b.add_argument("run", type=Path)
    r = sub.add_parser("report", help="the slopes of a layer-costs step's output directory")
    r.add_argument("dir", type=Path)
    r.add_argument("--json", action="store_true", help="the report as JSON")
    r.add_argument("--host-bw", type=float, metavar="GB/s",
                   help="host memory bandwidth for the prediction of CPU runs (default: rates.py's assumed figure)")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "describe":
            print(json.dumps(describe(args.model)))
        elif args.cmd == "brief":
            print(brief(args.run))
        else:
            from orchestrator.plan import rates as R

            host_bw = args.host_bw * 1e9 if args.host_bw else R.host_memory_bandwidth_default(1)[0]
            rows, models = load(args.dir)
            rep = analyse(rows, models, host_bw)
            print(json.dumps(rep, indent=1) if args.json else render(rep))
    except BadInput as e:
        print(e, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
