"""The candidates of one GPU worker: a placement for each micro-batch, its buffers, op-offload threshold and
predicted speed, and the choice among them (pure)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from orchestrator.backend.info import Flavor
from orchestrator.errors import PlanError
from orchestrator.hardware.topology import Gpu, Machine
from orchestrator.model.info import ModelInfo
from orchestrator.plan import buffers as M
from orchestrator.plan import rates as R
from orchestrator.plan.planning_context import PlanningContext, buffer_shape
from orchestrator.plan.costs import ModelCosts
from orchestrator.plan.cpu import CpuChoice
from orchestrator.plan.placement import (
    GpuBudget, Placement, place_graph_split, place_layer_split, place_single,
)
from orchestrator.plan.predict import SpeedInputs, op_offload_threshold, predict_pp, predict_tg
from orchestrator.plan.request import NodeRequest, PlanRequest
from orchestrator.units import fmt_bytes


@dataclass(frozen=True)
class Candidate:
    ubatch: int
    placement: Placement
    threshold: int | None
    threshold_why: str
    tg: float
    tg_bytes: Mapping[str, int]
    pp: Mapping[int, float]
    compute_gpu: tuple[int, ...]            # per GPU of the worker (CUDA0, CUDA1, ...: backend/devices.py)
    overhead_gpu: int
    speed: SpeedInputs
    budgets: tuple[GpuBudget, ...] = ()
    tg_streams: float = 0.0                 # aggregate of the request's parallel streams (0: not predicted yet)


def kv_layers(model: ModelInfo, req: PlanRequest, flavor: Flavor = Flavor.MAINLINE, *, ub: int = 512,
              fa: str = "on") -> list[int]:
    """KV cache bytes of every layer for the request's context and slots."""
    return M.kv_by_layer(model, buffer_shape(req, ub, fa, flavor))


def speed_inputs(machine: Machine, gpus: list, load_mode: str, host_nodes: tuple[int, ...], threads: int
                  ) -> tuple[SpeedInputs, list[str]]:
    notes = []
    bw = machine.bandwidth
    mem_bw, flops = [], []
    h2d = None
    h2d_pinned = None
    for g in gpus:
        b, src = R.gpu_memory_bandwidth(g.name)
        f, _ = R.gpu_flops(g.name)
        mem_bw.append(b)
        flops.append(f)
        measured = None
        if bw is not None:
            vals = [v for (gi, node), v in dict(bw.gpu_h2d).items() if gi == g.index and (not host_nodes or node in host_nodes)]
            if not vals:
                vals = [v for (gi, node), v in dict(bw.gpu_h2d).items() if gi == g.index]
            measured = max(vals) if vals else None
        if measured:
            pinned, src = measured, "measured by orchestrator probe"
        else:
            pinned, src = R.pcie_pinned_bandwidth(g.pcie_gen, g.pcie_width)
        eff = pinned * (R.PINNED_COPY_EFFICIENCY if load_mode == "pinned" else R.PAGEABLE_FRACTION)
        h2d = eff if h2d is None else min(h2d, eff)
        h2d_pinned = pinned if h2d_pinned is None else min(h2d_pinned, pinned)
        notes.append(f"GPU{g.index} host->device {pinned / 1e9:.1f} GB/s pinned ({src})")
    host_bw = 0.0
    if bw is not None and host_nodes:
        host = dict(bw.host)
        vals = [host.get((n, n)) for n in host_nodes]
        if all(vals):
            host_bw = float(sum(vals))
            notes.append(f"host memory {host_bw / 1e9:.0f} GB/s on nodes {list(host_nodes)} (measured)")
    if not host_bw:
        per, src = R.host_memory_bandwidth_default(len(machine.numa_nodes))
        host_bw = per * max(1, len(host_nodes))
        notes.append(f"host memory {host_bw / 1e9:.0f} GB/s ({src})")
    per_core, src = R.cpu_flops_per_core(machine.cpu_model)
    cpu_rate = 0.0
    if bw is not None and bw.cpu_probe_pp:
        cpu_rate = bw.cpu_probe_pp / R.CPU_PROBE_REFERENCE_PP
        notes.append(f"CPU prompt speed x{cpu_rate:.2f} of the reference machine (measured)")
    return SpeedInputs(tuple(mem_bw), tuple(flops), h2d or 1.0, host_bw, per_core * max(threads, 1),
                       h2d_pinned or 0.0, threads=max(threads, 1), cpu_rate=cpu_rate), notes


def gpu_free(g, node_req: NodeRequest) -> tuple[int, str]:
    free = g.memory_free_bytes if g.memory_free_bytes is not None else g.memory_bytes
    if free is None:
        raise PlanError(f"GPU {g.index} ({g.name}): its memory size is unknown; set nodes[].vram_limit")
    limit = node_req.limit_for(g.index)
    if limit is not None:
        if limit > free:
            return free, f"vram_limit {fmt_bytes(limit)} > free {fmt_bytes(free)}: using the free memory"
        return limit, f"vram_limit {fmt_bytes(limit)}"
    return free, f"free {fmt_bytes(free)}"


def place(costs: ModelCosts, kv_layer: list[int], budgets: list[GpuBudget], mode: str, req: PlanRequest) -> Placement:
    forced = req.expert_layers_on_cpu
    if len(budgets) == 1:
        return place_single(costs, kv_layer, budgets[0], forced)
    if mode in ("tensor", "graph"):
        return place_graph_split(costs, kv_layer, budgets, mode, forced)
    return place_layer_split(costs, kv_layer, budgets)


def gpu_computes(model: ModelInfo, req: PlanRequest, *, ub: int, fa: str, flavor: Flavor, mode: str, n_gpus: int,
                 offload_copy: int) -> tuple[int, ...]:
    """Compute buffer of each GPU of a worker (CUDA0, CUDA1, ...). ``offload_copy``: room to copy in a
    host-resident expert tensor for an offloaded batch. An offloaded op runs on the first GPU backend that takes it
    (ggml's scheduler tries CUDA0 first), so with ``-sm layer`` only CUDA0 holds the copy (measured on two H200s:
    CUDA1's buffer lacked exactly that copy); the tensor/graph splits keep it on every GPU (not measured)."""
    shape = buffer_shape(req, ub, fa, flavor)

    def one(st: int) -> int:
        return M.gpu_compute_bytes(model, shape, has_output=True, offload_copy=st)
    full = one(offload_copy)
    base = one(0) if offload_copy and mode == "layer" else full
    return tuple(full if k == 0 else base for k in range(n_gpus))


def offload_threshold(req: PlanRequest, costs: ModelCosts, placement: Placement, speed: SpeedInputs,
                      ub: int) -> tuple[int, str]:
    """``GGML_OP_OFFLOAD_MIN_BATCH`` for a placement: the topology's, else the smallest batch from which copying
    the host-resident experts wins, above the request's generation batches."""
    if req.op_offload_min_batch is not None:
        return req.op_offload_min_batch, "set by the topology"
    return op_offload_threshold(costs, placement, speed, max_batch=max(ub, 4096),
                                min_batch=max(req.parallel + 1, R.OP_OFFLOAD_MIN_BATCH_FLOOR))


def evaluate(ctx: PlanningContext, gpus: list[Gpu], kv_layer: list[int], *, mode: str, ub: int, load_mode: str,
             cpu: CpuChoice) -> Candidate:
    """Place the model for micro-batch ``ub`` and predict its speed."""
    model, costs, req, node_req = ctx.model, ctx.costs, ctx.req, ctx.node_req
    overhead = M.cuda_overhead(model, ub)

    def budgets_for(offload_copy: int) -> tuple[list[GpuBudget], tuple[int, ...]]:
        computes = gpu_computes(model, req, ub=ub, fa=ctx.fa, flavor=ctx.flavor, mode=mode, n_gpus=len(gpus),
                                offload_copy=offload_copy)
        out = []
        for k, g in enumerate(gpus):
            free, _why = gpu_free(g, node_req)
            out.append(GpuBudget(g.index, g.name, free - node_req.vram_reserve - overhead - computes[k]))
        return out, computes

    budgets, compute = budgets_for(0)
    placement = place(costs, kv_layer, budgets, mode, req)
    # CPU-resident experts are copied into the GPU's compute buffer for big batches: make room, place again
    for _ in range(3):
        offload_copy = M.offload_copy_bytes(model, placement.cpu_expert_layers)
        if not offload_copy:
            break
        budgets, compute2 = budgets_for(offload_copy)
        again = place(costs, kv_layer, budgets, mode, req)
        compute = compute2
        if again.cpu_expert_layers == placement.cpu_expert_layers:
            placement = again
            break
        placement = again
    speed, _ = speed_inputs(ctx.machine, gpus, load_mode, cpu.host_nodes, cpu.threads)
    threshold, why = offload_threshold(req, costs, placement, speed, ub)
    tg, tg_bytes = predict_tg(costs, placement, speed, 0.0)
    pp = predict_pp(costs, placement, speed, ub, threshold)
    return Candidate(ub, placement, threshold, why, tg, tg_bytes, pp, compute, overhead, speed, tuple(budgets))


# The requests the micro-batch is chosen for under objective ``generation``: the project's benchmark workload, one
# prompt of 512 and one of 4096 tokens, each answered with REPLY_TOKENS tokens. The reply length is our choice (a
# chat answer of a few paragraphs): long enough that generation weighs as much as a short prompt, short enough that
# a 4096-token prompt's time to first token still counts.
WORKLOAD_PROMPTS = (512, 4096)
REPLY_TOKENS = 256


def request_seconds(c: Candidate) -> float:
    """Predicted mean seconds of the workload's requests on ``c``: each prompt at its predicted prompt speed, then
    the reply at one stream's predicted generation speed."""
    if c.tg <= 0:
        return float("inf")
    prompts = [n / c.pp[n] if c.pp.get(n) else float("inf") for n in WORKLOAD_PROMPTS]
    return sum(prompts) / len(prompts) + REPLY_TOKENS / c.tg


def choose(cands: list[Candidate], objective: str = "generation") -> Candidate:
    """The least predicted time for the workload's requests, the fastest generation among those within 1% of it
    (objective ``generation``: a bigger micro-batch speeds long prompts up, but its compute buffer takes VRAM the
    experts or the cache would use, which slows generation); the largest prompt speed (``prompt``); the best geometric mean of both, each relative to its best
    (``balanced``)."""
    if objective == "prompt":
        return max(cands, key=lambda c: (round(c.pp.get(4096, 0.0), 1), c.tg, -c.ubatch))
    if objective == "balanced":
        top_tg = max(c.tg for c in cands) or 1.0
        top_pp = max(c.pp.get(4096, 0.0) for c in cands) or 1.0
        return max(cands, key=lambda c: (c.tg / top_tg * c.pp.get(4096, 0.0) / top_pp, -c.ubatch))
    # within 1% of the least time the difference is below what the predictions resolve: generation decides
    least = min(request_seconds(c) for c in cands)
    near = [c for c in cands if request_seconds(c) <= least * 1.01]
    return max(near, key=lambda c: (c.tg, -c.ubatch))
