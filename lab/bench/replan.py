"""A recorded bench run replanned as it ran, for the fits that solve a constant through the planner itself.

The run's argv gives the placement (``-ot``'s host-resident layers), the cache (``--moe-cache-mib``), the
micro-batch and the streams; the machine is the recorded H200 (tests/fixtures/machines/h200.inspect.json) with the
run's VRAM budget free and the bandwidth its probe measured that day; the binary is the recorded mainline
llama-server's ``--help`` with the expert cache's features; the model is the workload's shape written as a
header-only GGUF. The prediction tests under tests/plan replan the same runs the same way.

:func:`rates` sets constants of orchestrator/plan/rates.py for a moment, so a fit can ask what the plan predicts at
another value of the constant it fits.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import lzma
import re
import tempfile
from pathlib import Path

from lab.cpu_speed import constants

REPO = Path(__file__).resolve().parents[2]
FIX = REPO / "tests" / "fixtures"
MiB = 1 << 20
# the workloads' shapes, as lab/device/run.sh writes them
SHAPES = {"w1": ("qwen3-30b-a3b", None), "w2": ("qwen3-235b-a22b", 24)}
_TMP = tempfile.TemporaryDirectory(prefix="replan-")


def read_json(path: Path) -> dict:
    if not Path(path).is_file():
        raise SystemExit(f"{path}: not found")
    data = Path(path).read_bytes()
    return json.loads(lzma.decompress(data) if str(path).endswith(".xz") else data)


def workload(path: Path) -> str:
    """The workload a bench file ran (its name starts with it: w1-12g.json.xz)."""
    name = Path(path).name
    for w in SHAPES:
        if name.startswith(w):
            return w
    raise SystemExit(f"{path}: the file name names no workload ({', '.join(SHAPES)})")


@functools.lru_cache(maxsize=None)
def model(w: str):
    from orchestrator.model import read_model, synth

    like, layers = SHAPES[w]
    path = Path(_TMP.name) / f"{w}.gguf"
    synth.write_header_only(path, like, quant="q4_0", layers=layers)
    return read_model(path)


@functools.lru_cache(maxsize=None)
def curve(path: Path):
    """The hit-rate curve (lru-layer) of a routing profile file as `orchestrator model --routing` caches it."""
    from orchestrator.model.routing_profile import RoutingProfile

    doc = read_json(path)
    return RoutingProfile.from_json(doc.get("profile", doc)).curve("lru-layer")


def host_layers_and_cache(argv: list[str]) -> tuple[tuple[int, ...], int]:
    """(host-resident expert layers, cache MiB) of a run's argv."""
    m = re.match(r"blk\\\.\(([0-9|]+)\)", argv[argv.index("-ot") + 1]) if "-ot" in argv else None
    if not m:
        raise SystemExit(f"the run's argv places no expert layer in host memory with -ot: {' '.join(argv)[:200]}")
    mib = int(argv[argv.index("--moe-cache-mib") + 1]) if "--moe-cache-mib" in argv else 0
    return tuple(int(x) for x in m.group(1).split("|")), mib


def replan(bench: dict, run: dict, w: str, routing, features: frozenset = frozenset(),
           without: frozenset = frozenset(), **request):
    """The worker the plan makes for ``run`` of ``bench`` (workload ``w``, hit-rate curve ``routing``), with the
    binary's ``features`` added and ``without`` removed, and more PlanRequest fields in ``request``."""
    args = run["argv"]
    layers, mib = host_layers_and_cache(args)
    worker = plan_worker(w, routing, layers, mib, int(args[args.index("-ub") + 1]),
                         int(args[args.index("-np") + 1]), bench["vram_budget"],
                         bench["plan_context"]["bandwidth"], features, without, **request)
    if worker.settings.expert_cache_mib != mib:
        raise SystemExit(f"the replan gives a cache of {worker.settings.expert_cache_mib} MiB where the run had {mib}")
    return worker


def plan_worker(w: str, routing, layers: tuple[int, ...], mib: int, ubatch: int, parallel: int,
                vram_budget: int | None, bandwidth: dict | None, features: frozenset = frozenset(),
                without: frozenset = frozenset(), **request):
    """The worker the plan makes for workload ``w`` with these expert layers in host memory and this cache, on the
    recorded H200 with ``vram_budget`` free (None: as recorded) and the probe's ``bandwidth`` (None: the one
    recorded with the machine)."""
    from orchestrator.backend.info import BackendInfo, parse_help
    from orchestrator.hardware.dump import load_machine
    from orchestrator.hardware.topology import Bandwidth
    from orchestrator.plan import NodeRequest, PlanRequest, make_plan

    node = NodeRequest(name="h200", vram_limit=vram_budget, vram_reserve=256 * MiB) if vram_budget else \
        NodeRequest(name="h200")
    req = PlanRequest(nodes=(node,), expert_layers_on_cpu=layers, expert_cache_bytes=mib * MiB, ubatch=ubatch,
                      parallel=parallel, **request)
    fl, feats, modes, gpu = parse_help((FIX / "backend" / "mainline-llama-server-help.txt").read_text())
    feats = (feats | {"expert_cache", "expert_cache_slot_reads"} | set(features)) - set(without)
    b = BackendInfo(server="/opt/llama/bin/llama-server", flavor=fl, version="recorded", cuda=True,
                    gpu_offload=gpu, features=feats, split_modes=modes)
    h200 = load_machine(FIX / "machines" / "h200.inspect.json")
    if vram_budget:
        h200 = dataclasses.replace(h200, gpus=tuple(dataclasses.replace(g, memory_free_bytes=vram_budget)
                                                    for g in h200.gpus))
    if bandwidth:
        h200 = dataclasses.replace(h200, bandwidth=Bandwidth.from_json(bandwidth))
    return make_plan(machines={"h200": h200}, model=model(w), request=req, backend=b, routing=routing).workers[0]


# rates.py's constants set for a moment: the plan reads them when it plans (one helper for every fit)
rates = constants


def solve(f, lo: float, hi: float, iters: int = 60) -> float:
    """The x in [lo, hi] where the monotone ``f`` crosses 0 (bisection); an end where it does not."""
    f_lo, f_hi = f(lo), f(hi)
    if f_lo * f_hi > 0:
        return lo if abs(f_lo) < abs(f_hi) else hi
    for _ in range(iters):
        mid = (lo + hi) / 2
        f_mid = f(mid)
        if (f_mid > 0) == (f_lo > 0):
            lo, f_lo = mid, f_mid
        else:
            hi = mid
    return (lo + hi) / 2
