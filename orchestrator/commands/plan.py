"""orchestrator plan: what `up` will run, and why."""

from __future__ import annotations

import argparse
import json

HELP = "Decide placement, flags and NUMA policy for a topology; print exactly what `up` will run, and why"
DESCRIPTION = """\
Read the topology, the machine(s) (live, or recorded with `orchestrator inspect --save`), the model and the
llama-server binary; decide where every tensor goes, the batch sizes, threads, NUMA policy, load mode and
GGML_OP_OFFLOAD_MIN_BATCH; predict memory per device and speed. Prints, per worker, the exact environment and
argv that `orchestrator up` runs, the placement by layer range, predicted memory and speed, and one line of
reason per decision. Nothing is started."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("topology", help="topology.yaml")
    p.add_argument("--json", action="store_true", help="machine-readable plan (workers[] with argv, env, devices, "
                                                       "predicted)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a topology key, e.g. --set nodes.0.vram_limit=12GiB (repeatable; a relative path "
                        "given this way is taken from the current directory)")


def plan_document(res) -> dict:
    """The plan document of a resolved topology as JSON (orchestrator.plan.document)."""
    from orchestrator.plan.document import PlanDocument

    return PlanDocument.from_resolved(res).to_dict()


def _gib(n: int | None) -> str:
    from orchestrator.units import fmt_bytes

    return fmt_bytes(n)


def _mib(n: int) -> str:
    """A cache size as every cache size is shown: in MiB, as ``--moe-cache-mib`` takes it."""
    from orchestrator.units import MiB

    return f"{n / MiB:.1f} MiB"


def render_text(res) -> str:
    plan = res.plan
    m = plan.model
    lines = [f"model   {m['path']}  ({m['arch']}, {m['n_layers']} layers, {m['n_expert']} experts / "
             f"{m['n_expert_used']} used, {_gib(m['bytes'])}; context {m['context']} x {m['parallel']} slots, "
             f"KV {_gib(m['kv_bytes'])})",
             f"backend {res.backend.server} ({res.backend.flavor}, {'CUDA' if res.backend.cuda else 'CPU'})"]
    for n in res.notes:
        lines.append(f"note    {n}")
    for d in plan.decisions:
        lines.append(f"{d.what}: {d.value} -- {d.why}")
    for w in plan.warnings:
        lines.append(f"warning: {w}")
    for w, spec in zip(plan.workers, res.specs):
        lines.append("")
        lines.append(f"== worker {w.name} on {w.node} -> http://{w.host}:{w.port}  "
                     f"(GPUs {','.join(map(str, w.gpus)) or 'none'})")
        lines.append("placement:")
        for r in w.placement:
            rng = f"{r.first}-{r.last}" if r.first != r.last else f"{r.first}"
            lines.append(f"  layers {rng:<8} attention {r.attn:<12} experts {r.experts}")
        lines.append("memory (predicted):")
        for dm in w.memory:
            budget = f" of {_gib(dm.budget)}" if dm.budget else ""
            cache = f", expert cache {_mib(dm.cache)}" if dm.cache else ""
            lines.append(f"  {dm.device:<6} {_gib(dm.total):>10}{budget}  (weights {_gib(dm.weights)}, KV {_gib(dm.kv)},"
                         f" compute {_gib(dm.compute)}, other {_gib(dm.overhead)}{cache})")
        lines.append(f"speed (predicted): {w.predicted.summary()}")
        if w.expert_cache is not None:
            lines.extend(w.expert_cache.arithmetic())
        lines.append("why:")
        for d in w.decisions:
            lines.append(f"  {d.what:<11} {d.value}")
            lines.append(f"  {'':<11}   {d.why}")
        lines.append("runs:")
        for k, v in sorted(spec.env.items()):
            lines.append(f"  env {k}={v}")
        lines.append("  " + spec.shell_line().split(" ", len(spec.env))[-1] if spec.env else "  " + spec.shell_line())
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from orchestrator.config import parse_overrides
    from orchestrator.resolve import resolve

    res = resolve(args.topology, overrides=parse_overrides(args.set) if args.set else None)
    if args.json:
        print(json.dumps(plan_document(res), indent=1))
    else:
        print(render_text(res))
    return 0
