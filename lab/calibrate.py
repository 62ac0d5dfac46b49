"""Calibrate the memory model against what a real llama-server reports, and print predicted vs measured.

    python -m lab.calibrate cpu  --server /path/llama-server --out tests/fixtures/calibration/cpu
    python -m lab.calibrate gpu  --server /path/llama-server --out /tmp/calib-gpu
    python -m lab.calibrate report tests/fixtures/calibration/cpu [more dirs]
    python -m lab.calibrate grid --server /path/llama-server --out tests/fixtures/calibration/grid

``cpu`` and ``gpu`` generate real-architecture models (:mod:`lab.calibmodels`: sparse files, so
a 20 GB model costs nothing), start llama-server once per case, parse the buffer sizes it logs, and write one
``<case>.log`` (the full log, first line the exact command) plus ``cases.json`` (settings, placement, measured
buffers, and for ``gpu`` nvidia-smi's used memory before and after one full micro-batch). ``grid`` measures
the CPU compute buffer of models whose widths differ one at a time from the real ones (the data behind the
phase formulas in :mod:`orchestrator.model.memory`). ``report`` rebuilds each case's model header, predicts with :func:`orchestrator.model.memory.predict_memory`, and prints the table
(exit 1 if a case misses the target: within 3 % or 256 MiB, whichever is larger, per device). The tests read
the fixtures' logs and grid xz-compressed: run ``xz -9 *.log grid.jsonl`` in an output directory before committing it.

Standard library only: on the GPU machine ``PYTHONPATH=. python3 -m lab.calibrate gpu ...``
needs nothing installed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lab.calibmodels import PRESETS, variant, write_model
from orchestrator.backend import devices as D
from orchestrator.bench.logparse import parse_load_log
from orchestrator.model.memory import LayerOffload, ServerSettings, predict_memory
from orchestrator.model.reader import read_model
from orchestrator.model.shapes import ModelShape
from lab.serverrun import run_server

MiB = 1024 * 1024
TOL_REL = 0.03
TOL_ABS = 256 * MiB


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    preset: str
    layers: int
    experts: int
    ctx: int
    ubatch: int
    parallel: int = 1
    flash_attn: bool = True
    type_k: str = "f16"
    type_v: str = "f16"
    kv_unified: bool = False
    placement: str = "cpu"          # "cpu" | "gpu" (all layers on the GPU) | "cpu-moe" (experts on the host)
    vocab: int | None = None
    batch: bool = False             # decode one full micro-batch after loading

    def spec(self) -> ModelShape:
        return variant(PRESETS[self.preset], layers=self.layers, experts=self.experts, vocab=self.vocab)

    def args(self) -> list[str]:
        a = ["-c", str(self.ctx), "-ub", str(self.ubatch), "-b", str(max(self.ubatch, 2048)),
             "-np", str(self.parallel), "-fa", "on" if self.flash_attn else "off", "--no-warmup",
             "-lm", "none", "--fit", "off", "-ctk", self.type_k, "-ctv", self.type_v,
             "--kv-unified" if self.kv_unified else "--no-kv-unified"]
        if self.placement == "cpu":
            a += ["-ngl", "0"]
        elif self.placement == "gpu":
            a += ["-ngl", "all"]
        elif self.placement == "cpu-moe":
            a += ["-ngl", "all", "--cpu-moe"]
        else:
            raise ValueError(self.placement)
        return a

    def settings(self) -> ServerSettings:
        return ServerSettings(n_ctx=self.ctx, n_parallel=self.parallel, n_ubatch=self.ubatch,
                              n_batch=max(self.ubatch, 2048), flash_attn=self.flash_attn, type_k=self.type_k,
                              type_v=self.type_v, kv_unified=self.kv_unified)

    def placement_for(self, n_layers: int, moe_layers: tuple[int, ...]) -> LayerOffload:
        if self.placement == "cpu":
            return LayerOffload()
        layers = tuple(range(n_layers))
        if self.placement == "gpu":
            return LayerOffload(gpu_layers=layers, output_on_gpu=True)
        return LayerOffload(gpu_layers=layers, cpu_moe_layers=moe_layers, output_on_gpu=True)


def _matrix(placements: list[str], presets: dict[str, tuple[int, int]], *, batch: bool) -> list[Case]:
    cases = []
    for preset, (layers, experts) in presets.items():
        for ctx in (4096, 32768):
            for ub in (512, 4096):
                for pl in placements:
                    short = {"qwen3-30b-a3b": "qwen3", "gpt-oss-120b": "gptoss", "deepseek-v3": "deepseek"}.get(
                        preset, preset)
                    cases.append(Case(f"{short}-{pl}-c{ctx // 1024}k-ub{ub}", preset, layers, experts, ctx, ub,
                                      placement=pl, batch=batch))
    return cases


CPU_PRESETS = {"qwen3-30b-a3b": (4, 8), "gpt-oss-120b": (4, 8), "deepseek-v3": (4, 8)}
CPU_CASES = _matrix(["cpu"], CPU_PRESETS, batch=False) + [
    Case("qwen3-cpu-np4-c16k-ub512", "qwen3-30b-a3b", 4, 8, 16384, 512, parallel=4),
    Case("qwen3-cpu-np4u-c16k-ub512", "qwen3-30b-a3b", 4, 8, 16384, 512, parallel=4, kv_unified=True),
    Case("qwen3-cpu-q8kv-c32k-ub512", "qwen3-30b-a3b", 4, 8, 32768, 512, type_k="q8_0", type_v="q8_0"),
    Case("qwen3-cpu-nofa-c4k-ub512", "qwen3-30b-a3b", 4, 8, 4096, 512, flash_attn=False),
    Case("gptoss-cpu-np4-c16k-ub512", "gpt-oss-120b", 4, 8, 16384, 512, parallel=4),
    Case("gptoss-cpu-nofa-c4k-ub512", "gpt-oss-120b", 4, 8, 4096, 512, flash_attn=False),
    Case("deepseek-cpu-q8kv-c32k-ub512", "deepseek-v3", 4, 8, 32768, 512, type_k="q8_0", type_v="q8_0"),
    Case("llama8b-cpu-c32k-ub512", "llama-8b", 4, 0, 32768, 512),
    Case("qwen3-cpu-batch-c4k-ub512", "qwen3-30b-a3b", 4, 8, 4096, 512, batch=True),
]
# the GPU machine: full-size qwen3-30b-a3b and gpt-oss-120b (all on the GPU, and experts on the host), and a
# deepseek-v3 with all 61 layers but 32 experts (its full 256 experts do not fit 128 GiB of host memory)
GPU_PRESETS = {"qwen3-30b-a3b": (48, 128), "deepseek-v3": (61, 32)}
GPU_CASES = _matrix(["cpu-moe"], GPU_PRESETS, batch=True) + [
    Case("qwen3-gpu-c32k-ub4096", "qwen3-30b-a3b", 48, 128, 32768, 4096, placement="gpu", batch=True),
    Case("deepseek-gpu-c32k-ub4096", "deepseek-v3", 61, 32, 32768, 4096, placement="gpu", batch=True),
    Case("gptoss-cpumoe-c32k-ub4096", "gpt-oss-120b", 36, 128, 32768, 4096, placement="cpu-moe", batch=True),
    Case("qwen3-cpumoe-q8kv-c32k-ub4096", "qwen3-30b-a3b", 48, 128, 32768, 4096, placement="cpu-moe",
         type_k="q8_0", type_v="q8_0", batch=True),
]


# (preset, width overrides): one width at a time around the real models, plus the real widths themselves
GRID: list[tuple[str, dict]] = [
    ("qwen3-30b-a3b", {}), ("qwen3-30b-a3b", {"n_embd": 1024}), ("qwen3-30b-a3b", {"n_embd": 4096}),
    ("qwen3-30b-a3b", {"n_ff_exp": 384}), ("qwen3-30b-a3b", {"n_ff_exp": 1536}),
    ("qwen3-30b-a3b", {"n_expert_used": 4}), ("qwen3-30b-a3b", {"n_head": 16}), ("qwen3-30b-a3b", {"n_head": 64}),
    ("qwen3-30b-a3b", {"n_head_kv": 8}), ("qwen3-30b-a3b", {"head_dim": 64}), ("qwen3-30b-a3b", {"head_dim": 256}),
    ("qwen3-235b-a22b", {}),
    ("gpt-oss-120b", {}), ("gpt-oss-120b", {"n_expert_used": 2}), ("gpt-oss-120b", {"n_expert_used": 8}),
    ("gpt-oss-120b", {"n_ff_exp": 1440}), ("gpt-oss-120b", {"n_embd": 1440, "n_ff_exp": 1440}),
    ("gpt-oss-120b", {"n_head": 32}),
    ("deepseek-v3", {}), ("deepseek-v3", {"n_head": 64}), ("deepseek-v3", {"n_head": 32}),
    ("deepseek-v3", {"n_expert_used": 4}), ("deepseek-v3", {"n_ff_exp": 1024}),
    ("deepseek-v3", {"n_embd": 2048, "n_ff": 6144}), ("deepseek-v3", {"n_dense_lead": 0}),
    ("llama-8b", {}),
]
GRID_RUNS = [(512, 4096, True), (1024, 4096, True), (512, 8192, True), (512, 4096, False), (512, 8192, False)]


def grid_spec(preset: str, dims: dict) -> ModelShape:
    base = PRESETS[preset]
    d = {"n_layer": 3, "n_vocab": 32000, **({"n_expert": 8} if base.n_expert else {}),
         **({"n_dense_lead": 1} if base.n_dense_lead else {}), **dims}
    return dataclasses.replace(base, **d)


def run_grid(server: str, out: Path, *, model_dir: Path, timeout: float) -> int:
    out.mkdir(parents=True, exist_ok=True)
    model_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for preset, dims in GRID:
        spec = grid_spec(preset, dims)
        tag = "-".join(f"{k}{v}" for k, v in sorted(dims.items())) or "real"
        path = model_dir / f"grid-{preset}-{tag}.gguf"
        if not path.exists():
            write_model(str(path), spec)
        for T, ctx, fa in GRID_RUNS:
            args = ["-c", str(ctx), "-ub", str(T), "-b", str(max(T, 2048)), "-np", "1", "-fa", "on" if fa else "off",
                    "--no-warmup", "-lm", "none", "--fit", "off", "-ngl", "0"]
            r = run_server(server, str(path), args, timeout=timeout)
            rep = parse_load_log(r.log)
            rows.append({"preset": preset, "dims": dims, "spec": dataclasses.asdict(spec), "ubatch": T, "ctx": ctx,
                         "flash_attn": fa, "argv": [os.path.basename(r.argv[0]), *r.argv[1:]], "loaded": r.loaded,
                         "error": r.error, "compute": rep.compute, "kv": rep.kv, "model": rep.model,
                         "output": rep.output})
            print(f"{preset:16s} {tag:28s} T{T:5d} ctx{ctx:6d} fa={fa!s:5s} compute "
                  f"{ {k: round(v / MiB, 2) for k, v in rep.compute.items()} } {r.error or ''}", flush=True)
    tmp = out / "grid.jsonl.tmp"
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tmp.replace(out / "grid.jsonl")
    return 0 if all(r["loaded"] for r in rows) else 1


def _nvidia_used() -> list[int] | None:
    exe = shutil.which("nvidia-smi")
    if not exe:
        return None
    try:
        out = subprocess.run([exe, "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20).stdout
        return [int(x.strip()) * MiB for x in out.splitlines() if x.strip()]
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


def run_cases(cases: list[Case], server: str, out: Path, *, model_dir: Path, timeout: float) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    model_dir.mkdir(parents=True, exist_ok=True)
    results = []
    for c in cases:
        spec = c.spec()
        path = model_dir / f"{c.preset}-L{c.layers}-X{c.experts}-V{spec.n_vocab}.gguf"
        if not path.exists():
            write_model(str(path), spec)
        before = _nvidia_used()
        t0 = time.monotonic()
        r = run_server(server, str(path), c.args(), timeout=timeout,
                       # a prompt must leave room in the context: -c 4096 -ub 4096 takes 4096 - 16 tokens
                       batch_tokens=min(c.ubatch, c.ctx - 16) if c.batch else None,
                       probe=_nvidia_used if before is not None else None, n_vocab=spec.n_vocab)
        rep = parse_load_log(r.log)
        row = {"case": dataclasses.asdict(c), "argv": [os.path.basename(r.argv[0]), *r.argv[1:]],
               "loaded": r.loaded, "batch_ok": r.batch_ok, "error": r.error, "seconds": round(time.monotonic() - t0, 1),
               "report": rep.to_json(), "nvidia_used_before": before,
               "nvidia_used_loaded": r.probes.get("loaded"), "nvidia_used_batch": r.probes.get("batch")}
        (out / f"{c.name}.log").write_text("# " + " ".join(row["argv"]) + "\n" + r.log)
        results.append(row)
        print(f"{c.name:34s} loaded={r.loaded} batch={r.batch_ok} "
              f"{ {k: round(v['total'] / MiB) for k, v in rep.by_device().items()} } {r.error or ''}", flush=True)
        tmp = out / "cases.json.tmp"
        tmp.write_text(json.dumps(results, indent=1))
        tmp.replace(out / "cases.json")
    return results


def predict_case(c: Case, model_path: str) -> dict[str, dict]:
    m = read_model(model_path)
    pred = predict_memory(m, c.settings(), c.placement_for(m.n_layers, m.moe_layers))
    return {d: v.to_json() for d, v in pred.items()}


def recorded_by_device(row: dict) -> dict[str, dict]:
    """A recorded case's bytes per device under today's device names: the records keep the lower-case
    ``cuda0``/``cpu`` they were written with."""
    return {D.canonical(k): v for k, v in row["report"]["by_device"].items()}


def within(pred: int, meas: int) -> bool:
    return abs(pred - meas) <= max(TOL_ABS, TOL_REL * meas)


def report(dirs: list[Path], *, model_dir: Path) -> tuple[list[dict], bool]:
    rows = []
    ok_all = True
    model_dir.mkdir(parents=True, exist_ok=True)
    for d in dirs:
        for row in json.loads((d / "cases.json").read_text()):
            if not row["loaded"]:
                rows.append({"name": row["case"]["name"], "error": row["error"]})
                ok_all = False
                continue
            c = Case(**row["case"])
            spec = c.spec()
            path = model_dir / f"{c.preset}-L{c.layers}-X{c.experts}-V{spec.n_vocab}.gguf"
            if not path.exists():
                write_model(str(path), spec)
            pred = predict_case(c, str(path))
            meas = recorded_by_device(row)
            for dev in sorted(set(pred) | set(meas)):
                p = pred.get(dev, {"weights": 0, "kv": 0, "compute": 0, "output": 0, "total": 0})
                m = meas.get(dev, {"model": 0, "kv": 0, "compute": 0, "output": 0, "total": 0})
                ok = within(p["total"], m["total"])
                ok_all &= ok
                out = {"name": c.name, "device": dev, "pred": p, "meas": m, "ok": ok,
                       "err": (p["total"] - m["total"]) / m["total"] if m["total"] else 0.0}
                if D.kind_of(dev) == D.CUDA and row.get("nvidia_used_before"):
                    gi = D.parse(dev).index
                    before = row["nvidia_used_before"][gi]
                    for stage in ("loaded", "batch"):
                        used = row.get(f"nvidia_used_{stage}")
                        if used:
                            out[f"nvml_{stage}"] = used[gi] - before
                    out["pred_with_overhead"] = p["total"] + p["overhead"]
                rows.append(out)
    return rows, ok_all


def format_report(rows: list[dict]) -> str:
    f = lambda b: f"{b / MiB:9.1f}"  # noqa: E731
    lines = [f"{'case':34s} {'dev':6s} {'weights p/m (MiB)':>21s} {'KV p/m':>21s} {'compute p/m':>21s} "
             f"{'total p/m':>21s} {'err':>7s} ok"]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['name']:34s} FAILED: {r['error']}")
            continue
        p, m = r["pred"], r["meas"]
        lines.append(f"{r['name']:34s} {r['device']:6s} {f(p['weights'])} {f(m['model'])}  {f(p['kv'])} {f(m['kv'])}  "
                     f"{f(p['compute'])} {f(m['compute'])}  {f(p['total'])} {f(m['total'])} {r['err'] * 100:6.2f}% "
                     f"{'yes' if r['ok'] else 'NO'}")
    gpu = [r for r in rows if "pred_with_overhead" in r]
    if gpu:
        lines.append("")
        lines.append(f"{'case':34s} {'dev':6s} {'buffers (log)':>14s} {'nvidia-smi loaded':>18s} "
                     f"{'after 1st batch':>16s} {'pred + overhead':>16s} (MiB; nvidia-smi minus its value before)")
        for r in gpu:
            nl, nb = r.get("nvml_loaded"), r.get("nvml_batch")
            lines.append(f"{r['name']:34s} {r['device']:6s} {r['meas']['total'] / MiB:14.1f} "
                         f"{(nl or 0) / MiB:18.1f} {(nb or 0) / MiB:16.1f} {r['pred_with_overhead'] / MiB:16.1f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lab.calibrate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("cpu", "gpu"):
        p = sub.add_parser(name)
        p.add_argument("--server", required=True, help="llama-server binary")
        p.add_argument("--out", required=True, type=Path)
        p.add_argument("--models", type=Path, default=None, help="where to write the generated models (sparse)")
        p.add_argument("--only", default=None, help="run only cases whose name contains one of these (comma-separated)")
        p.add_argument("--timeout", type=float, default=300.0)
    p = sub.add_parser("grid")
    p.add_argument("--server", required=True, help="llama-server binary")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--models", type=Path, default=None)
    p.add_argument("--timeout", type=float, default=300.0)
    p = sub.add_parser("report")
    p.add_argument("dirs", nargs="+", type=Path)
    p.add_argument("--models", type=Path, default=None)
    p.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    models = args.models or Path(tempfile.gettempdir()) / "orchestrator-calib-models"
    if args.cmd == "grid":
        return run_grid(args.server, args.out, model_dir=models, timeout=args.timeout)
    if args.cmd in ("cpu", "gpu"):
        cases = CPU_CASES if args.cmd == "cpu" else GPU_CASES
        if args.only:
            terms = [t for t in args.only.split(",") if t]
            cases = [c for c in cases if any(t in c.name for t in terms)]
        res = run_cases(cases, args.server, args.out, model_dir=models, timeout=args.timeout)
        return 0 if all(r["loaded"] for r in res) else 1
    rows, ok = report(args.dirs, model_dir=models)
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print(format_report(rows))
        n_ok = sum(1 for r in rows if r.get("ok"))
        print(f"\n{n_ok}/{len(rows)} device rows within max(3 %, 256 MiB)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
