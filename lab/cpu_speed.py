"""The CPU speed model against llama-bench: measure generation and prompt speed of CPU-only runs, then fit the
constants of :mod:`orchestrator.plan.rates` that the CPU path of the prediction uses.

    python -m lab.cpu_speed measure --bench PATH/llama-bench --model A.gguf [--model B.gguf] \\
        --threads 1,2 --rounds 3 --out runs.json
    python -m lab.cpu_speed fit runs.json [more.json]
    python -m lab.cpu_speed serve plan.json [--worker 0] [--rounds 5] [--tokens 64] [--out serve.json]

``measure`` records, in one JSON file: the machine (CPU model, cores), host memory read bandwidth measured by the
project's probe (``native/membw.c``) as ``orchestrator probe`` measures it (every physical core of the node: the
figure the plan predicts from) and with as many threads as each run uses, before and after the runs, and for each
model what the prediction needs (bytes read per generated token, layers, parameters per token), read from its
GGUF header. Then ``--rounds`` rounds, each running every (model, threads) once through ``llama-bench -o jsonl``
(generation ``-n``, prompts ``-p``, ``-r`` repetitions), in an order that rotates from round to round so a slow
moment of a shared machine does not fall on one configuration only. Every llama-bench row is kept with its argv.

``fit`` evaluates the product's own predict_tg / predict_pp on a CPU-only placement. It takes the fastest of each
configuration's samples (on a shared machine the least disturbed one: other work only ever slows a run down; the
median is printed beside it) and fits, by least squares on the relative error: for generation, time per token =
CPU bytes / (bandwidth x CPU_ONLY_TG_EFFICIENCY) + layers x CPU_LAYER_OVERHEAD_S + CPU_TOKEN_OVERHEAD_S (the
bandwidth-bound and the overhead-bound regime in one line; on one thread of the reference machine), the per-layer cost
then x threads ** CPU_LAYER_THREAD_EXPONENT (on runs over every core of their node); for prompts, CPU_ONLY_PP_FLOPS_FACTOR (the share of
rates.py's per-core FLOP/s the CPU-only path reaches) and CPU_PP_LAYER_TOKEN_S (per layer and token: what a token
costs beyond its matrix products). It prints the
constants and every configuration's predicted / measured speed with the constants in rates.py.

``serve`` checks a plan's own prediction where the plan runs: it starts the worker's exact argv and environment
from ``orchestrator plan --json`` (numactl binding included), asks llama-server for ``--tokens`` tokens
``--rounds`` times (greedy, the prompt cache off) and prints llama-server's own timings against the plan's
predicted tg and pp.

Standard library plus the orchestrator package (its GGUF reader and probe): on the GPU machine
``PYTHONPATH=. python3 -m lab.cpu_speed ...`` needs nothing installed.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import lzma
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

SCHEMA = "orchestrator.cpu-speed/1"


# ---- what the prediction needs of a model ----------------------------------------------------------------------


def model_summary(path: str) -> dict:
    """The model as the prediction sees it (:class:`orchestrator.plan.costs.ModelCosts`: bytes and parameters
    per layer), read from its GGUF header, so that a record can be predicted again without the file."""
    from orchestrator.model.reader import read_model
    from orchestrator.plan.costs import model_costs

    c = model_costs(read_model(path))
    return {"path": path, "name": Path(path).name, "file_bytes": os.path.getsize(path), "arch": c.arch,
            "n_layers": c.n_compute_layers, "costs": dataclasses.asdict(c)}


# Records made before the model summary had attention's width: heads x (key + value width) per layer of the
# shapes they name (docs/benchmarks.md, "Without a GPU"): Qwen3-30B-A3B's 32 heads of 128 at full width
# (w1-6l, qwen3-30b-a3b-q4_0), 4 heads of 128 at synth-model's --scale 0.125 (the demo and its --layers variants).
OLDER_RECORD_ATTN_WIDTH = {"w1-6l.gguf": 32 * 256, "qwen3-30b-a3b-q4_0.gguf": 32 * 256}
DEMO_ATTN_WIDTH = 4 * 256


def costs_of(summary: dict):
    from orchestrator.plan.costs import LAST_FFN_EVERY_TOKEN, ModelCosts

    d = {k: tuple(v) if isinstance(v, list) else v for k, v in summary["costs"].items()}
    if "attn_pair_macs" not in d:
        width = OLDER_RECORD_ATTN_WIDTH.get(summary["name"], DEMO_ATTN_WIDTH)
        d["attn_pair_macs"] = width * d["n_compute_layers"]
    if "prompt_skip_ffn_layer" not in d:
        # records made before the summary said which feed-forward a prompt skips: the last layer's, as
        # model_costs says of every architecture but gpt-oss; its router's few parameters stay counted (the
        # Qwen3 shapes of those records have no dense or shared FFN beside it)
        d["prompt_skip_ffn_layer"] = None if d["arch"] in LAST_FFN_EVERY_TOKEN else d["n_compute_layers"] - 1
    return ModelCosts(**d)


# ---- measuring -------------------------------------------------------------------------------------------------


def _physical_cpus() -> list[int]:
    from orchestrator.hardware import read_machine

    m = read_machine("/")
    return list(m.physical_cpus(m.allowed_cpus))


def host_bandwidth(threads: list[int], reps: int = 5) -> dict[str, float]:
    """Best read bandwidth of the first ``t`` physical cores of node 0, for each t in ``threads`` (bytes/s)."""
    from orchestrator.hardware import read_machine
    from orchestrator.hardware.probe import build_native, find_cc, host_plan
    from orchestrator.units import format_cpulist

    cc = find_cc()
    if cc is None:
        raise SystemExit("lab.cpu_speed: no C compiler (cc/gcc/clang) to build native/membw.c")
    exe = build_native("membw", cc)
    m = read_machine("/")
    mem_nodes, sets, nbytes = host_plan(m)
    node, cpus = sets[0]
    out = {}
    for t in threads:
        mine = list(cpus)[:t]
        res = subprocess.run([str(exe), "--mem-nodes", str(mem_nodes[0]), "--bytes", str(nbytes), "--reps", str(reps),
                              "--set", f"{node}:{format_cpulist(mine)}"], capture_output=True, text=True, timeout=600)
        recs = [json.loads(x) for x in res.stdout.splitlines() if x.startswith("{")]
        best = [r["best_bytes_per_s"] for r in recs if "best_bytes_per_s" in r]
        if not best:
            raise SystemExit(f"lab.cpu_speed: membw failed with {t} thread(s): {res.stderr.strip() or res.stdout}")
        out[str(t)] = float(best[0])
    return out


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def bench_once(bench: str, model: str, threads: int, cpus: list[int], *, gen: int, prompts: str, reps: int,
               timeout: float, ubatch: int = 512, flash_attn: str = "on") -> tuple[list[str], list[dict]]:
    """One llama-bench run on the first ``threads`` physical cores (``-C`` mask, strict placement)."""
    mask = sum(1 << c for c in cpus[:threads])
    argv = [bench, "-m", model, "-t", str(threads), "-C", f"0x{mask:x}", "--cpu-strict", "1", "-ngl", "0",
            "-fa", flash_attn, "-ub", str(ubatch), "-p", prompts, "-n", str(gen), "-r", str(reps), "-o", "jsonl"]
    res = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    rows = [json.loads(x) for x in res.stdout.splitlines() if x.startswith("{")]
    if res.returncode != 0 or not rows:
        tail = " | ".join(res.stderr.strip().splitlines()[-3:])
        raise SystemExit(f"lab.cpu_speed: {' '.join(argv)} failed (exit {res.returncode}): {tail}")
    return argv, rows


def measure(args) -> int:
    threads = [int(t) for t in args.threads.split(",") if t]
    cpus = _physical_cpus()
    if max(threads) > len(cpus):
        raise SystemExit(f"lab.cpu_speed: --threads {max(threads)} > the {len(cpus)} physical cores allowed here")
    models = [model_summary(m) for m in args.model]
    doc = {"schema": SCHEMA, "machine": {"cpu_model": _cpu_model(), "physical_cpus": len(cpus),
                                         "host": platform.node()},
           "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "bench": os.path.basename(args.bench),
           "node_threads": len(cpus), "host_bw": host_bandwidth(sorted(set(threads) | {len(cpus)})),
           "models": models, "runs": []}
    configs = [(m, t) for m in models for t in threads]
    out = Path(args.out)
    for rnd in range(args.rounds):
        k = rnd % len(configs)
        for m, t in configs[k:] + configs[:k]:
            argv, rows = bench_once(args.bench, m["path"], t, cpus, gen=args.gen, prompts=args.prompts,
                                    reps=args.reps, timeout=args.timeout, ubatch=args.ubatch,
                                    flash_attn=args.flash_attn)
            for r in rows:
                doc["runs"].append({"round": rnd, "model": m["name"], "threads": t,
                                    "argv": [os.path.basename(argv[0]), *argv[1:]],
                                    "n_prompt": r["n_prompt"], "n_gen": r["n_gen"], "n_ubatch": r.get("n_ubatch"),
                                    "samples_ts": r["samples_ts"], "avg_ts": r["avg_ts"]})
                what = f"pp{r['n_prompt']}" if r["n_prompt"] else f"tg{r['n_gen']}"
                print(f"round {rnd} {m['name']:24s} t={t:<3d} {what:7s} {r['avg_ts']:9.1f} t/s", flush=True)
        doc["host_bw_after"] = host_bandwidth(sorted(set(threads) | {len(cpus)}))
        tmp = out.with_suffix(out.suffix + ".tmp")
        tmp.write_text(json.dumps(doc, indent=1))
        tmp.replace(out)
    return 0


# ---- fitting ---------------------------------------------------------------------------------------------------


def load(path: str | Path) -> dict:
    raw = Path(path).read_bytes()
    if str(path).endswith(".xz"):
        raw = lzma.decompress(raw)
    doc = json.loads(raw)
    if doc.get("schema") != SCHEMA:
        raise SystemExit(f"{path}: not a lab.cpu_speed record (schema {doc.get('schema')!r})")
    return doc


def points(docs: list[dict]) -> list[dict]:
    """One point per (file, model, threads, test): the fastest and the median of every sample of every round;
    the bandwidth is the median of what the probe measured before and after the rounds on every core of the
    node (the figure `orchestrator probe` gives the plan; it moves too on a shared machine)."""
    out = []
    for i, doc in enumerate(docs):
        models = {m["name"]: m for m in doc["models"]}
        groups: dict[tuple, list[float]] = {}
        for r in doc["runs"]:
            key = (r["model"], r["threads"], r["n_prompt"], r["n_gen"], r.get("n_ubatch") or 512)
            groups.setdefault(key, []).extend(r["samples_ts"])
        for (name, t, n_p, n_g, ub), ts in sorted(groups.items()):
            node = str(doc["node_threads"])
            bw = statistics.median([d[node] for d in (doc["host_bw"], doc.get("host_bw_after", {})) if node in d])
            out.append({"set": i, "machine": doc["machine"]["cpu_model"], "model": models[name], "threads": t,
                        "node_threads": doc["node_threads"],
                        "n_prompt": n_p, "n_gen": n_g, "n_ubatch": ub, "host_bw": bw,
                        "ts": max(ts), "median": statistics.median(ts), "spread": (min(ts), max(ts)),
                        "n": len(ts)})
    return out


def _lstsq(rows: list[list[float]], ys: list[float]) -> list[float]:
    """Least squares by the normal equations (a handful of unknowns; Gauss-Jordan with partial pivoting)."""
    n = len(rows[0])
    a = [[sum(r[i] * r[j] for r in rows) for j in range(n)] + [sum(r[i] * y for r, y in zip(rows, ys))]
         for i in range(n)]
    for c in range(n):
        p = max(range(c, n), key=lambda k: abs(a[k][c]))
        a[c], a[p] = a[p], a[c]
        if abs(a[c][c]) < 1e-30:
            raise SystemExit("lab.cpu_speed: the points do not determine the constants (too few kinds of runs)")
        for k in range(n):
            if k != c:
                f = a[k][c] / a[c][c]
                a[k] = [x - f * y for x, y in zip(a[k], a[c])]
    return [a[i][n] / a[i][i] for i in range(n)]


def _inputs(p: dict, per_core: float, cpu_rate: float | None = None):
    from orchestrator.plan.placement import place_cpu_only
    from orchestrator.plan.predict import SpeedInputs

    costs = costs_of(p["model"])
    rate = p.get("cpu_rate", 0.0) if cpu_rate is None else cpu_rate
    return costs, place_cpu_only(costs, [0] * costs.n_layers), SpeedInputs(
        (), (), 1.0, p["host_bw"], per_core * p["threads"], threads=p["threads"], cpu_rate=rate)


@contextlib.contextmanager
def constants(**values):
    """rates.py's constants set to ``values`` for a moment (the fit evaluates the product's own formulas)."""
    from orchestrator.plan import rates as R

    old = {k: getattr(R, k) for k in values}
    try:
        for k, v in values.items():
            setattr(R, k, v)
        yield
    finally:
        for k, v in old.items():
            setattr(R, k, v)


def predict(p: dict) -> float:
    """Tokens/s the product predicts for a point with the constants in rates.py (predict_tg / predict_pp on a
    CPU-only placement, at the point's measured bandwidth, thread count and machine cpu_rate)."""
    from orchestrator.plan import rates as R
    from orchestrator.plan.predict import predict_pp, predict_tg

    per_core, _ = R.cpu_flops_per_core(p["machine"])
    costs, placement, sp = _inputs(p, per_core)
    if p["n_prompt"]:
        return predict_pp(costs, placement, sp, p["n_ubatch"], None, lengths=(p["n_prompt"],))[p["n_prompt"]]
    return predict_tg(costs, placement, sp)[0]


def fit_tg(pts: list[dict]) -> dict:
    """CPU_ONLY_TG_EFFICIENCY, CPU_LAYER_OVERHEAD_S, CPU_TOKEN_OVERHEAD_S from the reference machine's generation
    points: the time per token is linear in (1 / efficiency, per layer, per token), least squares on the relative
    error."""
    from orchestrator.plan.predict import predict_tg

    tg = [p for p in pts if p["n_gen"] and not p["n_prompt"] and p["machine"] == REFERENCE_MACHINE]
    rows, ys = [], []
    for p in tg:
        costs, placement, sp = _inputs(p, 1.0)
        cpu_bytes = predict_tg(costs, placement, sp)[1]["CPU"]      # the bytes the product counts per token
        t = 1.0 / p["ts"]
        rows.append([cpu_bytes / p["host_bw"] / t, costs.n_compute_layers / t, 1.0 / t])
        ys.append(1.0)
    inv_eff, layer, fixed = _lstsq(rows, ys)
    if fixed < 0:   # a cost cannot be negative: the points say it is nil, fit the other two alone
        (inv_eff, layer), fixed = _lstsq([r[:2] for r in rows], ys), 0.0
    return {"CPU_ONLY_TG_EFFICIENCY": 1.0 / inv_eff, "CPU_LAYER_OVERHEAD_S": layer, "CPU_TOKEN_OVERHEAD_S": fixed,
            "points": len(tg)}


def fit_layer_thread_exponent(pts: list[dict]) -> dict:
    """CPU_LAYER_THREAD_EXPONENT (to 0.01): the per-layer cost's growth with the threads, on the generation points
    that ran on every core of their node with more than one (there the probe's all-core bandwidth is the threads'
    own), on the other constants in rates.py. Least squares on the relative error; none without such points."""
    multi = [p for p in pts if p["n_gen"] and not p["n_prompt"] and p["threads"] > 1
             and p["threads"] == p.get("node_threads")]
    if not multi:
        return {}

    def error(e: float) -> float:
        with constants(CPU_LAYER_THREAD_EXPONENT=e):
            return sum((predict(p) / p["ts"] - 1.0) ** 2 for p in multi)

    best = min((error(e / 100), e / 100) for e in range(0, 51))
    return {"CPU_LAYER_THREAD_EXPONENT": best[1], "layer_thread_points": len(multi)}


# The machine the CPU prompt constants are fitted on (cpu_rate 1.0): the dev VM where the demo runs. Another
# machine's cpu_rate is what its probe point says: the demo model's 512-token prompt on one core (what
# `orchestrator probe` measures), measured over predicted at rate 1.
REFERENCE_MACHINE = "AMD EPYC"
PROBE_POINT = ("demo-moe.gguf", 1, 512)


def _minimize(f, x0: list[float], steps: list[float], iters: int = 400) -> list[float]:
    """Nelder-Mead on ``f`` (a handful of unknowns, each in log space by the caller)."""
    pts = [list(x0)] + [[x + (s if i == j else 0.0) for j, x in enumerate(x0)] for i, s in enumerate(steps)]
    vals = [f(p) for p in pts]
    for _ in range(iters):
        order = sorted(range(len(pts)), key=vals.__getitem__)
        pts, vals = [pts[i] for i in order], [vals[i] for i in order]
        n = len(x0)
        c = [sum(p[j] for p in pts[:-1]) / n for j in range(n)]
        refl = [c[j] + (c[j] - pts[-1][j]) for j in range(n)]
        fr = f(refl)
        if fr < vals[0]:
            exp = [c[j] + 2 * (c[j] - pts[-1][j]) for j in range(n)]
            fe = f(exp)
            pts[-1], vals[-1] = (exp, fe) if fe < fr else (refl, fr)
        elif fr < vals[-2]:
            pts[-1], vals[-1] = refl, fr
        else:
            con = [c[j] + 0.5 * (pts[-1][j] - c[j]) for j in range(n)]
            fc = f(con)
            if fc < vals[-1]:
                pts[-1], vals[-1] = con, fc
            else:
                pts = [pts[0]] + [[pts[0][j] + 0.5 * (p[j] - pts[0][j]) for j in range(n)] for p in pts[1:]]
                vals = [vals[0]] + [f(p) for p in pts[1:]]
    return pts[min(range(len(pts)), key=vals.__getitem__)]


def _pp_error(inputs, **values) -> float:
    from orchestrator.plan.predict import predict_pp

    with constants(**values):
        tot = 0.0
        for p, (costs, placement, sp) in inputs:
            pred = predict_pp(costs, placement, sp, p["n_ubatch"], None, lengths=(p["n_prompt"],))
            tot += (pred[p["n_prompt"]] / p["ts"] - 1.0) ** 2
        return tot


def machine_rates(pts: list[dict]) -> dict[str, float]:
    """Each machine's cpu_rate from its probe point (the reference machine: 1.0), with the constants in rates.py."""
    from orchestrator.plan import rates as R
    from orchestrator.plan.predict import predict_pp

    out = {REFERENCE_MACHINE: 1.0}
    for machine in sorted({p["machine"] for p in pts} - {REFERENCE_MACHINE}):
        probe = [p for p in pts if p["machine"] == machine and p["n_prompt"] == PROBE_POINT[2]
                 and p["threads"] == PROBE_POINT[1] and p["model"]["name"] == PROBE_POINT[0]]
        if not probe:
            continue
        p = max(probe, key=lambda q: q["ts"])
        costs, placement, sp = _inputs(p, R.cpu_flops_per_core(p["machine"])[0], cpu_rate=1.0)
        pred = predict_pp(costs, placement, sp, p["n_ubatch"], None, lengths=(p["n_prompt"],))[p["n_prompt"]]
        out[machine] = p["ts"] / pred
    return out


def with_rates(pts: list[dict], rates: dict[str, float]) -> list[dict]:
    return [{**p, "cpu_rate": rates.get(p["machine"], 0.0)} for p in pts]


# The thread exponent is fitted on prompts whose time is the work that threads share. In a shorter prompt every
# expert the micro-batch uses is read from memory for a token or two (at 32 tokens, 112 of 128 experts a layer), so
# its time is mostly those reads at the bandwidth of the run's own threads, which the model does not have (it reads
# at the node's all-core figure, as in generation): the H200's records probe 7 GB/s for one core and 27 for four
# against 77 for all 16, and their 32-token prompts at 1 and 4 threads run 10-24 ms a micro-batch slower than
# predicted, about those reads at those rates. Taken as the threads' scaling, that pulled the exponent down and
# priced W1's 16-thread prompts 25% slow. From 512 tokens the weights are read once for 512 tokens: a few percent.
THREAD_FIT_MIN_PROMPT = 512


def fit_pp(pts: list[dict]) -> dict:
    """The CPU-only prompt constants that make predict_pp closest to the prompt points (least squares on the
    relative error, Nelder-Mead in log space: predict_pp is not linear in them). On the reference machine's
    one-thread points: CPU_ONLY_PP_FLOPS_FACTOR (the share of rates.py's per-core FLOP/s table the matrix
    products reach), CPU_PP_LAYER_TOKEN_S and CPU_PP_ATTN_MAC_S (attention, from prompts of several lengths).
    Then each other machine's cpu_rate from its probe point, and CPU_PP_THREAD_EXPONENT on every point with more
    than one thread and a prompt of at least THREAD_FIT_MIN_PROMPT tokens."""
    import math

    from orchestrator.plan import rates as R

    pp = [p for p in pts if p["n_prompt"]]
    ref = [p for p in pp if p["machine"] == REFERENCE_MACHINE and p["threads"] == 1]
    if not ref:
        return {}
    inputs = [(p, _inputs(p, R.cpu_flops_per_core(p["machine"])[0], cpu_rate=1.0)) for p in ref]
    lengths = {p["n_prompt"] for p in ref}

    def err(x):
        f, layer, attn = (math.exp(v) for v in x)
        return _pp_error(inputs, CPU_ONLY_PP_FLOPS_FACTOR=f, CPU_PP_LAYER_TOKEN_S=layer,
                         CPU_PP_ATTN_MAC_S=attn if len(lengths) > 2 else 0.0)

    x = _minimize(err, [math.log(3.0), math.log(30e-6), math.log(1e-9)], [0.5, 0.5, 1.0])
    f, layer, attn = (math.exp(v) for v in x)
    out = {"CPU_ONLY_PP_FLOPS_FACTOR": f, "CPU_PP_LAYER_TOKEN_S": layer,
           "CPU_PP_ATTN_MAC_S": attn if len(lengths) > 2 else 0.0, "points": len(ref)}
    with constants(**{k: v for k, v in out.items() if k.isupper()}):
        rates = machine_rates(pts)
        multi = [p for p in with_rates(pp, rates) if p["threads"] > 1 and p["machine"] in rates
                 and p["n_prompt"] >= THREAD_FIT_MIN_PROMPT]
        if multi:
            out["CPU_PP_THREAD_EXPONENT"] = fit_thread_exponent(multi)
    out["cpu_rate"] = rates
    return out


def fit_thread_exponent(multi: list[dict]) -> float:
    """CPU_PP_THREAD_EXPONENT (to 0.01) that makes predict_pp closest to ``multi``: prompt points of several
    threads, each with its machine's cpu_rate (:func:`with_rates`), on the other constants in rates.py."""
    from orchestrator.plan import rates as R

    m_inputs = [(p, _inputs(p, R.cpu_flops_per_core(p["machine"])[0])) for p in multi]
    return min((_pp_error(m_inputs, CPU_PP_THREAD_EXPONENT=e / 100), e / 100) for e in range(30, 101))[1]


def probe_reference(values: dict[str, float]) -> float:
    """CPU_PROBE_REFERENCE_PP: the prompt tokens/s predict_pp gives, with the CPU constants ``values``, for the
    probe's measurement (the probe's model as ``orchestrator probe`` writes it, its prompt, one core) on the
    reference machine (cpu_rate 1, the reference core's FLOP/s): a machine's cpu_rate is its probe over this."""
    import tempfile

    from orchestrator.hardware.probe import CPU_PROBE_PROMPT, CPU_PROBE_SHAPE
    from orchestrator.model.reader import read_model
    from orchestrator.model.synth import write_header_only
    from orchestrator.plan import rates as R
    from orchestrator.plan.costs import model_costs
    from orchestrator.plan.placement import place_cpu_only
    from orchestrator.plan.predict import SpeedInputs, predict_pp

    like, scale, quant = CPU_PROBE_SHAPE
    with tempfile.TemporaryDirectory() as tmp:
        costs = model_costs(read_model(write_header_only(Path(tmp) / "probe.gguf", like, scale=scale, quant=quant)))
    sp = SpeedInputs((), (), 1.0, 20e9, R.CPU_REFERENCE_CORE_FLOPS, threads=1, cpu_rate=1.0)
    with constants(**values):
        return predict_pp(costs, place_cpu_only(costs, [0] * costs.n_layers), sp, 512, None,
                          lengths=(CPU_PROBE_PROMPT,))[CPU_PROBE_PROMPT]


def fit(args) -> int:
    docs = [load(f) for f in args.files]
    pts = points(docs)
    tg = fit_tg(pts)
    print(f"fitted on {tg['points']} generation points: CPU_ONLY_TG_EFFICIENCY {tg['CPU_ONLY_TG_EFFICIENCY']:.3f}, "
          f"CPU_LAYER_OVERHEAD_S {tg['CPU_LAYER_OVERHEAD_S'] * 1e6:.1f} us, "
          f"CPU_TOKEN_OVERHEAD_S {tg['CPU_TOKEN_OVERHEAD_S'] * 1e6:.1f} us")
    with constants(**{k: v for k, v in tg.items() if k.isupper()}):
        tg.update(fit_layer_thread_exponent(pts))
    if "CPU_LAYER_THREAD_EXPONENT" in tg:
        print(f"fitted on {tg['layer_thread_points']} generation points on every core of their node: "
              f"CPU_LAYER_THREAD_EXPONENT {tg['CPU_LAYER_THREAD_EXPONENT']:.2f}")
    pp = fit_pp(pts)
    if pp:
        print(f"fitted on {pp['points']} prompt points of the reference machine ({REFERENCE_MACHINE}, one thread): "
              f"CPU_ONLY_PP_FLOPS_FACTOR {pp['CPU_ONLY_PP_FLOPS_FACTOR']:.2f}, "
              f"CPU_PP_LAYER_TOKEN_S {pp['CPU_PP_LAYER_TOKEN_S'] * 1e6:.1f} us, "
              f"CPU_PP_ATTN_MAC_S {pp['CPU_PP_ATTN_MAC_S'] * 1e12:.3f} ps; "
              f"CPU_PP_THREAD_EXPONENT {pp.get('CPU_PP_THREAD_EXPONENT', float('nan')):.2f}")
    rates = machine_rates(pts)
    print("cpu_rate with rates.py's constants (probe point: "
          f"{PROBE_POINT[0]} pp{PROBE_POINT[2]}, {PROBE_POINT[1]} thread): "
          + ", ".join(f"{m} {r:.3f}" for m, r in rates.items()))
    pts = with_rates(pts, rates)
    print()
    print(f"{'set':>3s} {'model':24s} {'thr':>3s} {'test':7s} {'GB/s':>6s} {'fastest':>9s} {'median':>9s} "
          f"{'slowest':>9s} {'predicted':>9s} {'ratio':>6s}")
    worst = {"tg": 0.0, "pp": 0.0}
    for p in pts:
        pred = predict(p)
        ratio = pred / p["ts"]
        kind = "pp" if p["n_prompt"] else "tg"
        worst[kind] = max(worst[kind], abs(ratio - 1.0))
        what = f"pp{p['n_prompt']}" if p["n_prompt"] else f"tg{p['n_gen']}"
        print(f"{p['set']:3d} {p['model']['name']:24s} {p['threads']:3d} {what:7s} {p['host_bw'] / 1e9:6.1f} "
              f"{p['ts']:9.1f} {p['median']:9.1f} {p['spread'][0]:9.1f} {pred:9.1f} {ratio:6.2f}")
    print(f"\nwith rates.py's constants: generation within {worst['tg'] * 100:.0f}%, prompts within "
          f"{worst['pp'] * 100:.0f}% of the fastest runs")
    if args.write is not None:
        from lab.rates_file import RATES_JSON, write_fitted

        names = ("CPU_ONLY_TG_EFFICIENCY", "CPU_LAYER_OVERHEAD_S", "CPU_TOKEN_OVERHEAD_S", "CPU_LAYER_THREAD_EXPONENT",
                 "CPU_ONLY_PP_FLOPS_FACTOR", "CPU_PP_LAYER_TOKEN_S", "CPU_PP_ATTN_MAC_S", "CPU_PP_THREAD_EXPONENT")
        fitted = {**tg, **(pp or {})}
        missing = [n for n in names if n not in fitted]
        if missing:
            print(f"not written: these runs do not fit {', '.join(missing)}", file=sys.stderr)
            return 1
        # the probe's reference follows from the prompt constants as they are stored (rounded to their resolution)
        lines = write_fitted({n: fitted[n] for n in names}, args.write or None)
        from lab.rates_file import load as load_rates

        stored = load_rates(args.write or RATES_JSON)["constants"]
        ref = probe_reference({n: stored[n]["value"] for n in names})
        print(f"CPU_PROBE_REFERENCE_PP {ref:.1f} (predict_pp of the probe's measurement on the reference machine)")
        for line in lines + write_fitted({"CPU_PROBE_REFERENCE_PP": ref}, args.write or None):
            print(line)
    return 0


def _get(url: str, body: dict | None = None, timeout: float = 600.0) -> dict:
    import urllib.request

    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"} if data else {})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read() or b"{}")


def serve(args) -> int:
    """The plan's worker started as the plan says, timed by llama-server itself."""
    import urllib.error

    doc = json.loads(Path(args.plan).read_text())
    w = doc["workers"][args.worker]
    base = f"http://{w['host']}:{w['port']}"
    log = Path(args.out).with_suffix(".server.log") if args.out else Path(os.devnull)
    with open(log, "wb") as fh:
        proc = subprocess.Popen(w["argv"], env={**os.environ, **w["env"]}, stdout=fh, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + args.timeout
            while True:
                if proc.poll() is not None:
                    raise SystemExit(f"lab.cpu_speed: llama-server exited ({proc.returncode}) before it was ready")
                try:
                    _get(base + "/health", timeout=5)
                    break
                except (urllib.error.URLError, OSError, ValueError):
                    if time.monotonic() > deadline:
                        raise SystemExit(f"lab.cpu_speed: llama-server not ready after {args.timeout:.0f} s")
                    time.sleep(0.5)
            prompt = " ".join(f"word{i}" for i in range(args.prompt_words))
            rounds = []
            for i in range(args.rounds + 1):          # the first round warms the server up: not counted
                r = _get(base + "/completion", {"prompt": prompt, "n_predict": args.tokens, "temperature": 0,
                                                "cache_prompt": False, "ignore_eos": True})
                t = r.get("timings", {})
                if i:
                    rounds.append({"predicted_n": t.get("predicted_n"), "tg": t.get("predicted_per_second"),
                                   "prompt_n": t.get("prompt_n"), "pp": t.get("prompt_per_second")})
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    tg = [r["tg"] for r in rounds]
    pp = [r["pp"] for r in rounds]
    pred = w["predicted"]
    out = {"schema": SCHEMA + "+serve", "worker": w["name"], "argv": w["argv"], "env": w["env"], "rounds": rounds,
           "predicted": pred, "machine": {"cpu_model": _cpu_model(), "host": platform.node()},
           "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    n_prompt = rounds[0]["prompt_n"]
    print(f"{w['name']}: {' '.join(w['argv'])}")
    print(f"tg over {args.tokens} tokens, {len(tg)} rounds: median {statistics.median(tg):.1f} t/s "
          f"[{min(tg):.1f}-{max(tg):.1f}], predicted {pred['tg']:.1f}: ratio to the median "
          f"{pred['tg'] / statistics.median(tg):.2f}, to the fastest {pred['tg'] / max(tg):.2f}")
    print(f"prompt of {n_prompt} tokens: median {statistics.median(pp):.1f} t/s [{min(pp):.1f}-{max(pp):.1f}]")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lab.cpu_speed", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("measure")
    p.add_argument("--bench", required=True, help="llama-bench binary (a CPU build)")
    p.add_argument("--model", action="append", required=True, help="a GGUF model (repeat for several)")
    p.add_argument("--threads", default="1", help="comma-separated thread counts (first N physical cores)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=3, help="llama-bench -r")
    p.add_argument("--gen", type=int, default=64, help="llama-bench -n")
    p.add_argument("--prompts", default="32,512", help="llama-bench -p")
    p.add_argument("--ubatch", type=int, default=512, help="llama-bench -ub")
    p.add_argument("--flash-attn", default="on", choices=("on", "off", "auto"), help="llama-bench -fa")
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--out", required=True)
    p = sub.add_parser("fit")
    p.add_argument("files", nargs="+")
    p.add_argument("--write", nargs="?", const="", metavar="RATES_JSON",
                   help="store the fitted constants, rounded to their resolution, in "
                        "orchestrator/_data/rates.json (or the RATES_JSON given)")
    p = sub.add_parser("serve")
    p.add_argument("plan", help="`orchestrator plan --json` output")
    p.add_argument("--worker", type=int, default=0)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--prompt-words", type=int, default=32)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    return {"measure": measure, "fit": fit, "serve": serve}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
