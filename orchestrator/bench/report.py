"""Outputs: the JSON file (raw samples + summary + ratios), the tables (rich: on the terminal, and as plain text in
bench.txt) and PNG charts (matplotlib). Files are written under a temporary name and renamed, never left
half-written."""

from __future__ import annotations

import io
import json
import os
import re
from pathlib import Path
from typing import Any, Mapping, Sequence

from orchestrator.bench.summary import _metric_order, comparison
from orchestrator.fsutil import write_atomic
from orchestrator.units import fmt_bytes

_PP = re.compile(r"^pp(\d+)$")
_TG = re.compile(r"^tg(\d+)@(\d+)$")
_TGS = re.compile(r"^tg(\d+)x(\d+)$")
_LOAD = re.compile(r"^load(_req)?_x(\d+)$")


def write_json(path: Path, data: Mapping[str, Any]) -> None:
    write_atomic(path, (json.dumps(data, indent=1, default=_default) + "\n").encode())


def _default(o: Any) -> Any:
    if isinstance(o, (set, tuple)):
        return list(o)
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


# --- table ---------------------------------------------------------------------------------------------------

def _columns(summary: Mapping[str, Any], part: str) -> list[str]:
    """``speed``: load time, prompt and generation rates; ``latency``: time to first token, memory, power."""
    keys: set[str] = set()
    for s in summary.values():
        keys.update(s.get("metrics", {}))
    if part == "speed":
        speed = sorted((k for k in keys if _PP.match(k) or _TG.match(k) or _TGS.match(k) or _LOAD.match(k)),
                       key=_metric_order)
        streams = sorted((k for k in keys if k.startswith("expert_cache_hit_rate_x")),
                         key=lambda k: int(k.rsplit("x", 1)[1]))
        read = sorted((k for k in keys if k.startswith("expert_cache_read_pp")),
                      key=lambda k: int(k[len("expert_cache_read_pp"):]))
        return (["load_s"] * ("load_s" in keys) + speed
                + ["expert_cache_hit_rate"] * ("expert_cache_hit_rate" in keys) + streams + read)
    ttft = sorted((k for k in keys if k.startswith("ttft_")),
                  key=lambda k: (int(k.rsplit("_c", 1)[1]), k))
    mem = sorted(k for k in keys if k.startswith("vram_peak_gpu")) + (["rss_peak"] if "rss_peak" in keys else [])
    gpu = sorted(k for k in keys if k.startswith(("power_mean_w_gpu", "temp_max_c_gpu")))
    return ttft + mem + gpu


def _header(k: str) -> str:
    if k.startswith("ttft_p"):
        q, c = k[len("ttft_p"):].split("_c")
        return f"ttft p{q} c{c} s"
    if k.startswith("expert_cache_hit_rate_x"):
        return f"cache hits x{k.rsplit('x', 1)[1]}"
    if k.startswith("expert_cache_read_pp"):
        return f"slots read pp{k[len('expert_cache_read_pp'):]}"
    if _TGS.match(k):
        return f"{k} agg"
    if m := _LOAD.match(k):
        return f"x{m.group(2)} {'per req' if m.group(1) else 'agg'}"
    named = {"load_s": "load s", "rss_peak": "RSS peak", "expert_cache_hit_rate": "cache hits"}
    return named.get(k, k.replace("vram_peak_", "VRAM ").replace("power_mean_w_", "W ").replace("temp_max_c_", "°C "))


def _cell(k: str, m: Mapping[str, Any] | None) -> str:
    if m is None:
        return "-"
    v = m["median"]
    if k.startswith(("vram_peak", "rss_peak")):
        return fmt_bytes(v)
    if k == "expert_cache_hit_rate" or k.startswith(("expert_cache_hit_rate_x", "expert_cache_read_pp")):
        return f"{v:.1%}"
    if k.startswith("ttft_"):
        s = f"{v:.3f}"
    elif k == "load_s" or k.startswith(("power", "temp")):
        s = f"{v:.1f}"
    else:
        s = f"{v:.1f}" if v < 100 else f"{v:.0f}"
    if m.get("n", 1) > 1 and v and m["max"] != m["min"] and (k.startswith(("pp", "tg", "ttft"))):
        spread = (m["max"] - m["min"]) / 2 / abs(v) * 100
        s += f" ±{spread:.0f}%"
    return s


def _buffers_cell(b: Mapping[str, int] | None) -> str:
    if not b:
        return "-"
    return ", ".join(f"{dev} {fmt_bytes(v)}" for dev, v in sorted(b.items(), key=lambda x: -x[1]))


def table_rows(summary: Mapping[str, Any], part: str = "speed") -> tuple[list[str], list[list[str]]]:
    cols = _columns(summary, part)
    buffers = part == "latency" and any(s.get("llama_buffers") for s in summary.values())
    scoped = part == "speed" and any((s.get("params") or {}).get("scope") for s in summary.values())
    header = (["config"] + (["runs as"] if scoped else []) + (["loaded"] if part == "speed" else [])
              + [_header(k) for k in cols])
    header += ["llama.cpp buffers"] if buffers else []
    rows = []
    for name, s in summary.items():
        row = [name]
        if scoped:
            row.append((s.get("params") or {}).get("scope") or "")
        if part == "speed":
            row.append(f"{s['loaded']}/{s['runs']}" + (f" ({s['crashed']} crashed)" if s.get("crashed") else ""))
        row += [_cell(k, s["metrics"].get(k)) for k in cols]
        if buffers:
            row.append(_buffers_cell(s.get("llama_buffers")))
        rows.append(row)
    return header, rows


TITLES = {"speed": "tokens/s (median ±half the range over all samples; xS: S requests sent at once, all of them "
                   "per second of wall time and each request's own)",
          "latency": "time to first token, peak memory, power and temperature; llama.cpp's own buffers"}


def comparisons(rs: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """What each CPU ratio compares, numbered in order of first use: ``{text: "[n]"}``."""
    out: dict[str, str] = {}
    for r in rs:
        if (c := r.get("compares")) and c not in out:
            out[c] = f"[{len(out) + 1}]"
    return out


def ratio_rows(rs: Sequence[Mapping[str, Any]]) -> tuple[list[str], list[list[str]]]:
    keys = comparisons(rs)
    header = ["ratio", "metric", "value", "90% interval", "target", "against"] + ["compares"] * bool(keys) + ["met"]
    rows = []
    for r in rs:
        t = r.get("target")
        ts = "-" if t is None else (f"{t[0]:.2f}–{t[1]:.2f}" if isinstance(t, (list, tuple)) else f"≥ {t:.2f}")
        ok = {True: "yes", False: "NO", None: ""}[r.get("ok")]
        notes = [n for n, on in (("within A/A noise", r.get("within_noise")),
                                  ("90% interval spans the target", r.get("ci_spans_target"))) if on]
        if ok and notes:
            ok += f" ({'; '.join(notes)})"
        val = "-" if r.get("value") is None else f"{r['value']:.2f}"
        ci = "" if not r.get("ci90") else f"{r['ci90'][0]:.2f}–{r['ci90'][1]:.2f}"
        if r.get("fewer_cores"):
            ok = (ok + " " if ok else "") + f"(on fewer cores: {r['fewer_cores']})"
        rows.append([r["kind"], r["metric"], val, ci, ts, r.get("other_config", "")]
                    + [keys.get(r.get("compares", ""), "")] * bool(keys) + [ok])
    return header, rows


def _table(title: str, header: Sequence[str], rows: Sequence[Sequence[str]], *, numbers: bool = True,
           red_when_not_met: bool = False):
    from rich import box
    from rich.table import Table

    t = Table(title=title, box=box.SIMPLE_HEAD, title_justify="left")
    for i, c in enumerate(header):
        t.add_column(c, justify="right" if numbers and i > 0 else "left", no_wrap=True)
    for r in rows:
        t.add_row(*r, style="red" if red_when_not_met and r[-1].startswith("NO") else None)
    return t


def _renderables(data: Mapping[str, Any]) -> list:
    """The table of configurations (speed, then latency and memory), the ratios with their targets, problems."""
    from rich.text import Text

    out: list = []
    for part in ("speed", "latency"):
        h, rows = table_rows(data["summary"], part)
        if len(h) > 1:
            out.append(_table(TITLES[part], h, rows))
    if data.get("ratios"):
        rh, rr = ratio_rows(data["ratios"])
        line = data.get("comparison") or comparison(data.get("configs") or [])
        title = "ratios and their targets" + (f"\n{line}" if line else "")
        out.append(_table(title, rh, rr, numbers=False, red_when_not_met=True))
        if notes := comparisons(data["ratios"]):
            out.append(Text("\n".join(f"  {key} {text}" for text, key in notes.items())))
    errs = _problems(data)
    if errs:
        out.append(Text("problems:\n" + "\n".join(f"  {n}: {e}" for n, e in errs), style="yellow"))
    return out


def render_text(data: Mapping[str, Any], width: int = 200) -> str:
    """The tables as plain text (what bench.txt holds): the same rich tables, without colour, ``width`` wide."""
    from rich.console import Console

    buf = io.StringIO()
    console = Console(file=buf, width=width, color_system=None, force_terminal=False, legacy_windows=False)
    for r in _renderables(data):
        console.print(r)
    return "\n".join(line.rstrip() for line in buf.getvalue().splitlines()).strip("\n")


def _problems(data: Mapping[str, Any]) -> list[tuple[str, str]]:
    out = [(n, e) for n, s in data["summary"].items() for e in s.get("errors", [])]
    out += [(n, f"warning: {w}") for n, s in data["summary"].items() for w in s.get("warnings", [])]
    for note in (data.get("stopped_early"), data.get("interrupted")):
        if note:
            out.append(("bench", note))
    return out


PIPED_WIDTH = 200      # as bench.txt: a pipe or file has no width, and rich would cut the tables at 80 columns


def print_tables(data: Mapping[str, Any], file=None) -> None:
    """Print the tables on ``file`` (stdout): coloured and as wide as a terminal, else plain and
    :data:`PIPED_WIDTH` wide (``bench ... | tee`` keeps every column)."""
    import sys

    from rich.console import Console

    out = file if file is not None else sys.stdout
    tty = hasattr(out, "isatty") and out.isatty()
    console = Console(file=out) if tty else Console(file=out, width=PIPED_WIDTH, color_system=None)
    for r in _renderables(data):
        console.print(r)


# --- charts --------------------------------------------------------------------------------------------------

def _chart_metrics(summary: Mapping[str, Any]) -> list[str]:
    keys: set[str] = set()
    for s in summary.values():
        keys.update(s.get("metrics", {}))
    pp = sorted((int(_PP.match(k).group(1)) for k in keys if _PP.match(k)))
    want = [f"pp{n}" for n in (512, 4096) if f"pp{n}" in keys]
    if not want and pp:
        want = [f"pp{pp[-1]}"]
    tg = sorted((k for k in keys if _TG.match(k) or _TGS.match(k)), key=_metric_order)
    return want + tg


def write_charts(data: Mapping[str, Any], out_dir: Path) -> list[Path]:
    """``speed.png`` (t/s per configuration for pp512, pp4096 and each tg depth, error bars = min/max);
    when there is a threshold sweep, ``offload.png`` (prompt t/s vs prompt length per threshold); when there is
    a cache grid, ``cache.png`` (generation t/s against the cache size, the plan marked)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = data["summary"]
    paths: list[Path] = []
    metrics = _chart_metrics(summary)
    names = [n for n, s in summary.items() if s["metrics"]]
    if metrics and names:
        fig, axes = plt.subplots(len(metrics), 1, figsize=(max(6.0, 0.55 * len(names) + 2), 2.6 * len(metrics)),
                                 squeeze=False)
        for ax, m in zip(axes[:, 0], metrics):
            vals = [summary[n]["metrics"].get(m) for n in names]
            med = [v["median"] if v else 0.0 for v in vals]
            err = [[(v["median"] - v["min"]) if v else 0.0 for v in vals],
                   [(v["max"] - v["median"]) if v else 0.0 for v in vals]]
            colors = ["tab:red" if n == "plan" else ("tab:gray" if summary[n]["group"] in ("fit", "cpu-moe")
                                                     else "tab:blue") for n in names]
            ax.bar(range(len(names)), med, yerr=err, color=colors, capsize=3)
            ax.set_ylabel("tokens/s")
            ax.set_title(m)
            ax.set_xticks(range(len(names)))
            ax.set_xticklabels(names, rotation=45, ha="right", fontsize=8)
            ax.grid(axis="y", alpha=0.3)
        fig.tight_layout()
        paths.append(_save(fig, out_dir / "speed.png"))
        plt.close(fig)

    sweep = [n for n, s in summary.items() if s["group"] in ("offload-sweep", "plan") and s["metrics"]]
    if any(summary[n]["group"] == "offload-sweep" for n in sweep):
        fig, ax = plt.subplots(figsize=(7, 4.5))

        def threshold(n: str) -> int:
            return int(summary[n]["params"].get("op_offload_min_batch") or 32)

        palette = [c for c in plt.get_cmap("tab10").colors if c != plt.get_cmap("tab10").colors[3]]  # no red
        lengths: set[int] = set()
        others = 0
        for n in sorted(sweep, key=threshold):
            pts = sorted((int(_PP.match(k).group(1)), v["median"]) for k, v in summary[n]["metrics"].items()
                         if _PP.match(k))
            if not pts:
                continue
            lengths.update(p[0] for p in pts)
            t = threshold(n)
            label = f"{n} (threshold {'never' if t >= 10**9 else t})"
            if n == "plan":
                color = "tab:red"
            else:
                color = palette[others % len(palette)]
                others += 1
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label,
                    linewidth=2.5 if n == "plan" else 1.2, color=color)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(lengths))
        ax.set_xticklabels([str(x) for x in sorted(lengths)])
        ax.minorticks_off()
        ax.set_xlabel("prompt length (tokens)")
        ax.set_ylabel("prompt tokens/s")
        ax.set_title("GGML_OP_OFFLOAD_MIN_BATCH sweep")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        paths.append(_save(fig, out_dir / "offload.png"))
        plt.close(fig)

    grid = [n for n, s in summary.items() if s["group"] in ("cache-grid", "plan") and s["metrics"]]
    tg = sorted({k for n in grid for k in summary[n]["metrics"] if _TG.match(k)}, key=_metric_order)
    if tg and any(summary[n]["group"] == "cache-grid" for n in grid):
        m = tg[0]                                   # generation at the shallowest depth
        fig, ax = plt.subplots(figsize=(7, 4.5))
        pts = [(float(summary[n]["params"].get("expert_cache_mib") or 0), summary[n]["metrics"][m], n)
               for n in grid if m in summary[n]["metrics"]]
        for x, v, n in sorted(pts):
            plan = n == "plan"
            ax.errorbar([x], [v["median"]], yerr=[[v["median"] - v["min"]], [v["max"] - v["median"]]],
                        fmt="*" if plan else "o", markersize=14 if plan else 7, capsize=3,
                        color="tab:red" if plan else "tab:blue")
            ax.annotate(n, (x, v["median"]), textcoords="offset points", xytext=(6, 6), fontsize=8)
        ax.set_xlabel("expert cache (MiB, --moe-cache-mib)")
        ax.set_ylabel("generation tokens/s")
        ax.set_title(f"expert cache grid ({m}); the plan marked")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        paths.append(_save(fig, out_dir / "cache.png"))
        plt.close(fig)
    return paths


def _save(fig, path: Path) -> Path:
    tmp = path.with_name(f".{path.stem}.tmp.png")
    fig.savefig(tmp, dpi=110)
    os.replace(tmp, path)
    return path
