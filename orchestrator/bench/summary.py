"""From raw runs to medians, spread and the target ratios. Pure functions on the JSON-shaped data.

Metric names: ``pp<L>`` (prompt tokens/s at prompt length L), ``tg<N>@<D>`` (generated tokens/s, N tokens after
a context of D), ``ttft_p50_c<C>`` / ``ttft_p95_c<C>`` (seconds to the first token with C concurrent requests),
``load_x<S>`` / ``load_req_x<S>`` (tokens/s of S requests sent at once: all of them over the wall time, and
each request's own), ``load_s``, ``vram_peak_gpu<I>`` (bytes the configuration added on GPU I at its peak), ``rss_peak`` (host bytes of
the server's processes), ``power_mean_w_gpu<I>``, ``power_max_w_gpu<I>``, ``temp_max_c_gpu<I>``.

Spread: every metric has the median with min/max and the interquartile range over all samples of every
round. Time-to-first-token quantiles are taken over the requests of all rounds pooled; their min/max are the
per-round quantiles.
"""

from __future__ import annotations

import math
import re
from typing import Any, Iterable, Mapping, Sequence

from orchestrator.bench.logparse import device_totals
from orchestrator.bench.measure import COUNTERS, PROMPT_COUNTERS, quantile

# plan ÷ --fit targets
FIT_TARGETS = {"tg128@0": 1.05, "pp512": 3.0, "pp4096": 2.5, "pp32": 2.0, "pp64": 2.0, "pp128": 2.0}
SWEEP_TARGET = 0.97
THRESHOLD_TARGET = 0.97
CPU_ALTERNATIVES = ("defaults", "threads-sweep", "ub-sweep", "numa-sweep", "replicas")
# alternatives that change how one server runs on the plan's cores: a deployment's replica is compared with them,
# the deployment itself with the alternatives over the whole machine
PER_SERVER_ALTERNATIVES = ("threads-sweep", "ub-sweep", "numa-sweep")
REPLICA = "replica"
PREDICTION_BAND = (0.85, 1.15)

_PP = re.compile(r"^pp(\d+)$")
_TG = re.compile(r"^tg(\d+)@(\d+)$")
_TGS = re.compile(r"^tg(\d+)x(\d+)$")      # aggregate generation of N streams at once: tg<tokens>x<streams>
_LOAD = re.compile(r"^load(_req)?_x(\d+)$")   # S requests at once: aggregate / per request tokens/s


def stat(values: Sequence[float]) -> dict:
    v = [float(x) for x in values]
    return {"median": quantile(v, 0.5), "min": min(v), "max": max(v), "q1": quantile(v, 0.25),
            "q3": quantile(v, 0.75), "n": len(v), "values": sorted(v)}


CI_LEVEL = 0.90
CI_RESAMPLES = 2000
CI_MIN_SAMPLES = 3


def ratio_ci(a: Sequence[float], b: Sequence[float], *, level: float = CI_LEVEL,
             resamples: int = CI_RESAMPLES, seed: int = 0) -> tuple[float, float] | None:
    """A bootstrap interval of median(a) / median(b): both sample sets resampled with replacement (a fixed seed,
    so a report is reproducible). None with fewer than ``CI_MIN_SAMPLES`` samples on either side. Samples of one
    server start are correlated, so this is narrower than the start-to-start spread an A/A control shows."""
    import numpy as np

    if len(a) < CI_MIN_SAMPLES or len(b) < CI_MIN_SAMPLES:
        return None
    rng = np.random.default_rng(seed)
    xa, xb = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    ma = np.median(xa[rng.integers(0, len(xa), (resamples, len(xa)))], axis=1)
    mb = np.median(xb[rng.integers(0, len(xb), (resamples, len(xb)))], axis=1)
    r = ma / np.where(mb > 0, mb, np.nan)
    r = r[np.isfinite(r)]
    if not len(r):
        return None
    tail = (1 - level) / 2
    return float(np.quantile(r, tail)), float(np.quantile(r, 1 - tail))


def run_metrics(run: Mapping[str, Any]) -> dict[str, list[float]]:
    """The samples one run contributes, by metric name."""
    out: dict[str, list[float]] = {}
    if not run.get("loaded"):
        return out
    if run.get("load_s") is not None:
        out["load_s"] = [run["load_s"]]
    s = run.get("samples") or {}
    for p in s.get("pp", ()):
        out.setdefault(f"pp{p['n']}", []).append(p["tps"])
    for t in s.get("tg", ()):
        out.setdefault(f"tg{t['n']}@{t['depth']}", []).append(t["tps"])
    cache = s.get(COUNTERS) or {}
    if cache.get("lookups"):
        out["expert_cache_hit_rate"] = [cache["hits"] / cache["lookups"]]
    for n, c in (s.get(PROMPT_COUNTERS) or {}).items():
        moved = c.get("prefill_saved_bytes", 0.0) + c.get("prefill_copied_bytes", 0.0)
        if moved > 0:
            # the share of a prompt's expert bytes that came from the slots rather than over the host link
            out[f"expert_cache_read_pp{n}"] = [c.get("prefill_saved_bytes", 0.0) / moved]
    for n, entry in (s.get("tg_streams") or {}).items():
        for r in entry.get("runs", ()):
            out.setdefault(f"tg{round(r['predicted_n'] / int(n))}x{n}", []).append(r["tps"])
        c = entry.get(COUNTERS) or {}
        if c.get("lookups"):
            out[f"expert_cache_hit_rate_x{n}"] = [c["hits"] / c["lookups"]]
    for n, entry in (s.get("load") or {}).items():
        for r in entry.get("runs", ()):
            out.setdefault(f"load_x{n}", []).append(r["tps"])
            out.setdefault(f"load_req_x{n}", []).extend(r["per_request_tps"])
    res = run.get("resources") or {}
    for g, d in (res.get("gpus") or {}).items():
        out[f"vram_peak_gpu{g}"] = [d.get("peak_process") or d.get("peak_delta", 0)]
        for k in ("power_mean_w", "power_max_w", "temp_max_c"):
            if d.get(k) is not None:
                out[f"{k}_gpu{g}"] = [d[k]]
    if res.get("rss_peak"):
        out["rss_peak"] = [res["rss_peak"]]
    return out


def summarize(configs: Sequence[Mapping[str, Any]], runs: Sequence[Mapping[str, Any]]) -> dict:
    """Per configuration: runs, how many loaded, errors, and a stat per metric."""
    out: dict[str, Any] = {}
    for c in configs:
        name = c["name"]
        mine = [r for r in runs if r["config"] == name]
        samples: dict[str, list[float]] = {}
        ttft_pool: dict[str, list[float]] = {}
        ttft_round: dict[str, list[float]] = {}
        for r in mine:
            for k, v in run_metrics(r).items():
                samples.setdefault(k, []).extend(v)
            for conc, vals in ((r.get("samples") or {}).get("ttft") or {}).items():
                if not vals:
                    continue
                ttft_pool.setdefault(conc, []).extend(vals)
                for q in (50, 95):
                    ttft_round.setdefault(f"{q}_c{conc}", []).append(quantile(vals, q / 100))
        metrics = {k: stat(v) for k, v in samples.items() if v}
        for conc, vals in ttft_pool.items():
            for q in (50, 95):
                per_round = ttft_round[f"{q}_c{conc}"]
                metrics[f"ttft_p{q}_c{conc}"] = {"median": quantile(vals, q / 100), "min": min(per_round),
                                                 "max": max(per_round), "n": len(vals)}
        errors: list[str] = []
        for r in mine:
            for e in ([r["error"]] if r.get("error") else []) + list(r.get("errors") or []):
                if e not in errors:
                    errors.append(e)
        warnings: list[str] = []
        for r in mine:
            for w in list(r.get("warnings") or []) + list((r.get("samples") or {}).get("skipped") or []):
                if w not in warnings:
                    warnings.append(w)
        out[name] = {"group": c.get("group", "extra"), "params": dict(c.get("params") or {}),
                     "runs": len(mine), "loaded": sum(1 for r in mine if r.get("loaded")),
                     "crashed": sum(1 for r in mine if r.get("crashed")),
                     "errors": errors, "warnings": warnings, "metrics": metrics}
        buffers = next(((r.get("llama") or {}).get("buffers") for r in mine
                        if r.get("loaded") and (r.get("llama") or {}).get("buffers")), None)
        if buffers:
            out[name]["llama_buffers"] = device_totals(buffers)     # weights + KV + compute per buffer type
    return out


def _med(summary: Mapping[str, Any], config: str, metric: str) -> float | None:
    m = (summary.get(config) or {}).get("metrics", {}).get(metric)
    return None if m is None else m["median"]


def _best(summary: Mapping[str, Any], names: Sequence[str], metric: str) -> tuple[str, float] | None:
    """The configuration among ``names`` with the highest median of ``metric`` (None when none has it)."""
    cands = [(n, v) for n in names if (v := _med(summary, n, metric))]
    return max(cands, key=lambda x: x[1]) if cands else None


def _speed_metrics(summary: Mapping[str, Any], config: str) -> list[str]:
    ms = (summary.get(config) or {}).get("metrics", {})
    return sorted((k for k in ms if _PP.match(k) or _TG.match(k) or _TGS.match(k) or _LOAD.match(k)),
                  key=_metric_order)


def _metric_order(k: str) -> tuple:
    m = _PP.match(k)
    if m:
        return (0, int(m.group(1)), 0)
    m = _TG.match(k)
    if m:
        return (1, int(m.group(2)), int(m.group(1)))
    m = _TGS.match(k)
    if m:
        return (2, int(m.group(2)), int(m.group(1)))
    m = _LOAD.match(k)
    if m:
        return (3, int(m.group(2)), bool(m.group(1)))
    return (4, 0, 0)


def _entry(kind: str, metric: str, plan: float, other: float, other_config: str, target: float | None,
           higher_is_better: bool = True) -> dict:
    value = plan / other if other else None
    ok = None
    if target is not None and value is not None:
        ok = value >= target if higher_is_better else value <= target
    return {"kind": kind, "metric": metric, "value": value, "plan": plan, "other": other,
            "other_config": other_config, "target": target, "ok": ok}


SAFE_HEADROOM = 256 << 20   # a sweep point that left less VRAM free than this ran at the edge of out-of-memory


def ratios(summary: Mapping[str, Any], configs: Sequence[Mapping[str, Any]], plan: str = "plan",
           fit: str = "fit", vram_budget: int | None = None) -> list[dict]:
    """The target ratios, each with its target and whether it is met:

    - ``plan/fit``: every pp and tg metric the two share (targets: tg128@0 ≥ 1.05, pp512 ≥ 3, pp4096 ≥ 2.5,
      pp32/64/128 ≥ 2);
    - ``plan/best-sweep``: against the best point of the ``--n-cpu-moe`` × ``-ub`` × load-mode sweep, per metric
      (≥ 0.97);
    - ``threshold/best``: at every prompt length, the plan's op-offload threshold (the plan itself) against the
      best of the plan and the threshold sweep (≥ 0.97);
    - ``predicted/measured``: the plan's predicted pp, tg and memory against the measurement (tg within ±15%);
    - ``plan/best-safe-sweep`` (with ``vram_budget``): the same against the sweep points that left at least
      ``SAFE_HEADROOM`` of the budget free on every GPU (no target: it says how much of a ``plan/best-sweep``
      gap comes from placements at the edge of out-of-memory, which the plan's reserve rules out);
    - ``plan/best-cpu``: a plan on the CPU only against the best of its CPU alternatives (no target);
    - ``plan/control``: the plan against itself run again (A/A): the noise floor, within 0.97–1.03 to read the
      0.97 targets meaningfully. When it was run, a ``plan/fit`` or ``plan/best-sweep`` verdict whose distance
      from its target is smaller than the A/A difference of the same metric gets ``"within_noise": True``
      (the verdict stands, but the run cannot tell it apart from noise).
    """
    out: list[dict] = []
    if plan not in summary:
        return out
    groups = {c["name"]: c.get("group", "extra") for c in configs}
    plan_metrics = _speed_metrics(summary, plan)

    if fit in summary:
        for m in plan_metrics:
            a, b = _med(summary, plan, m), _med(summary, fit, m)
            if b:
                out.append(_entry("plan/fit", m, a, b, fit, FIT_TARGETS.get(m)))

    for ctl in (n for n, g in groups.items() if g == "control" and n in summary):
        for m in plan_metrics:
            b = _med(summary, ctl, m)
            if b:
                e = _entry("plan/control", m, _med(summary, plan, m), b, ctl, None)
                e["target"] = [SWEEP_TARGET, 1 / SWEEP_TARGET]
                e["ok"] = SWEEP_TARGET <= e["value"] <= 1 / SWEEP_TARGET
                out.append(e)

    sweep = [n for n, g in groups.items() if g == "ncmoe-sweep" and n in summary]
    def safe(name: str) -> bool:
        peaks = [v["median"] for k, v in summary[name]["metrics"].items()
                 if k.startswith("vram_peak_") and v.get("median") is not None]
        return bool(peaks) and max(peaks) <= vram_budget - SAFE_HEADROOM

    safe_sweep = [n for n in sweep if safe(n)] if vram_budget else sweep
    for kind, names, target in (("plan/best-sweep", sweep, SWEEP_TARGET), ("plan/best-safe-sweep", safe_sweep, None)):
        if kind == "plan/best-safe-sweep" and len(safe_sweep) == len(sweep):
            continue                                    # every sweep point was safe: the row above says it
        for m in plan_metrics:
            if best := _best(summary, names, m):
                out.append(_entry(kind, m, _med(summary, plan, m), best[1], best[0], target))

    # a plan on the CPU only, against the CPU alternatives (llama.cpp's defaults, threads, -ub, NUMA policy, one
    # replica over the machine): no target, the GPU targets above do not apply to it. A plan of several replicas
    # (a deployment) against the alternatives over the whole machine; its replica against the alternatives that
    # run one server on the same cores
    deployment = bool(next((c.get("members") for c in configs if c["name"] == plan), None))
    whole = CPU_ALTERNATIVES if not deployment else tuple(g for g in CPU_ALTERNATIVES
                                                          if g not in PER_SERVER_ALTERNATIVES)
    cpu = [n for n, g in groups.items() if g in whole and n in summary]
    for m in plan_metrics if cpu else ():
        if best := _best(summary, cpu, m):
            out.append(_entry("plan/best-cpu", m, _med(summary, plan, m), best[1], best[0], None))
    per_server = [n for n, g in groups.items() if g in PER_SERVER_ALTERNATIVES and n in summary]
    if deployment and REPLICA in summary and per_server:
        for m in _speed_metrics(summary, REPLICA):
            if not _LOAD.match(m) and (best := _best(summary, per_server, m)):
                e = _entry("replica/best-cpu", m, _med(summary, REPLICA, m), best[1], best[0], None)
                e["config"] = REPLICA
                out.append(e)
    _say_what_is_compared(out, configs, plan)

    thresholds = [n for n, g in groups.items() if g == "offload-sweep" and n in summary]
    if thresholds:
        for m in plan_metrics:
            if not _PP.match(m):
                continue
            best, v = _best(summary, [plan] + thresholds, m)
            out.append(_entry("threshold/best", m, _med(summary, plan, m), v, best, THRESHOLD_TARGET))

    for e in out:     # how sure each ratio is: an interval over the samples, and whether it spans the target
        va = (summary.get(e.get("config", plan)) or {}).get("metrics", {}).get(e["metric"], {}).get("values")
        vb = (summary.get(e["other_config"]) or {}).get("metrics", {}).get(e["metric"], {}).get("values")
        ci = (ratio_ci(va, vb) if va and vb and e["other_config"] != e.get("config", plan)
              and e["kind"] != "predicted/measured" else None)
        if ci is not None:
            e["ci90"] = [ci[0], ci[1]]
            if isinstance(e["target"], (int, float)):
                e["ci_spans_target"] = ci[0] < e["target"] < ci[1]

    noise = {e["metric"]: abs(math.log(e["value"])) for e in out if e["kind"] == "plan/control" and e["value"]}
    for e in out:
        if e["kind"] in ("plan/fit", "plan/best-sweep") and e["metric"] in noise and e["target"] and e["value"]:
            e["within_noise"] = abs(math.log(e["value"] / e["target"])) < noise[e["metric"]]

    pred = next((c.get("predicted") or {} for c in configs if c["name"] == plan), {})
    lo, hi = PREDICTION_BAND
    if pred.get("tg"):
        tg0 = next((m for m in plan_metrics if _TG.match(m) and _TG.match(m).group(2) == "0"), None)
        meas = _med(summary, plan, tg0) if tg0 else None
        if meas:
            e = _entry("predicted/measured", tg0, float(pred["tg"]), meas, plan, None)
            e["ok"] = lo <= e["value"] <= hi
            e["target"] = [lo, hi]
            out.append(e)
    for streams, v in sorted((int(k), float(v)) for k, v in (pred.get("tg_streams") or {}).items()):
        metric = next((m for m in plan_metrics if (g := _TGS.match(m)) and int(g.group(2)) == streams), None)
        meas = _med(summary, plan, metric) if metric else None
        if meas:
            e = _entry("predicted/measured", metric, v, meas, plan, None)
            e["ok"] = lo <= e["value"] <= hi
            e["target"] = [lo, hi]
            out.append(e)
    for length, v in sorted((int(k), float(v)) for k, v in (pred.get("pp") or {}).items()):
        meas = _med(summary, plan, f"pp{length}")
        if meas:
            out.append(_entry("predicted/measured", f"pp{length}", v, meas, plan, None))
    # memory is predicted per server: a deployment's is its replica's row (the deployment's is their sum)
    one = REPLICA if deployment and REPLICA in summary else plan
    for dev, v in sorted((pred.get("memory") or {}).items()):
        metric = "rss_peak" if dev == "CPU" else f"vram_peak_{dev}"
        meas = _med(summary, one, metric)
        if meas and (one != plan or not deployment):
            e = _entry("predicted/measured", metric, float(v), meas, one, None)
            e["config"] = one
            out.append(e)
    return out


def _say_what_is_compared(out: list[dict], configs: Sequence[Mapping[str, Any]], plan: str) -> None:
    """Each ratio of the CPU comparisons says what it compares: the scope of both sides (``2 replicas × 1 core``
    against ``one server on 2 cores``), whether it is the same load on the whole deployment or one request at a
    time, and a note when the plan's side had fewer cores than the other."""
    by = {c["name"]: c for c in configs}
    for e in out:
        if e["kind"] not in ("plan/best-cpu", "replica/best-cpu"):
            continue
        mine, other = by.get(e.get("config", plan)) or {}, by.get(e["other_config"]) or {}
        a, b = (mine.get("params") or {}).get("cores"), (other.get("params") or {}).get("cores")
        m = _LOAD.match(e["metric"])
        if m:
            how = f"the same {m.group(2)} requests at once, " + ("per request" if m.group(1) else "aggregate")
        elif mine.get("members"):
            how = f"one request at a time: each served by one replica of {len(mine['members'])}"
            a = (mine["members"][0].get("params") or {}).get("cores") or a       # one replica serves it
        else:
            how = "one request at a time"
        scope_a = (mine.get("params") or {}).get("scope") or e.get("config", plan)
        scope_b = (other.get("params") or {}).get("scope") or e["other_config"]
        e["compares"] = f"{scope_a} vs {scope_b}: {how}"
        if a and b and a < b:
            e["fewer_cores"] = f"{a} core{'s' * (a > 1)} against {b}"


def comparison(configs: Sequence[Mapping[str, Any]], plan: str = "plan") -> str | None:
    """One line for the head of the ratios: what the plan is measured as, and against what."""
    c = next((c for c in configs if c["name"] == plan), None)
    scope = ((c or {}).get("params") or {}).get("scope")
    if not scope:
        return None
    if c.get("members"):
        streams = (c.get("params") or {}).get("load_streams")
        load = f" under the same load ({streams} requests at once: the load_x rows)" if streams else ""
        return (f"plan = the deployment, {scope}, all replicas serving at once, against one server over the "
                f"machine{load}; pp/tg rows are one request at a time (one replica serves it); the replica row "
                f"is one replica on its own cores, against the same-core sweeps")
    return f"plan = {scope}, against the alternatives each run as one server"


def failed_targets(rs: Iterable[Mapping[str, Any]]) -> list[dict]:
    return [r for r in rs if r.get("ok") is False]
