"""make_plan: machines + model + request + backend -> Plan. Pure: no processes, files, network or clocks."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping

from orchestrator.backend.info import BackendInfo, Flavor
from orchestrator.errors import PlanError
from orchestrator.hardware.topology import Gpu, Machine
from orchestrator.launch.settings import ALL_LAYERS, WorkerSettings
from orchestrator.model.info import ModelInfo
from orchestrator.plan import memory as M
from orchestrator.plan import rates as R
from orchestrator.plan.costs import ModelCosts, model_costs
from orchestrator.plan.layout import worker_layout
from orchestrator.plan.cpu import CpuChoice, choose_cpu, node_available
from orchestrator.model.memory import MOE_CACHE_MAX_BATCH, moe_cache_bank_bytes, moe_cache_size
from orchestrator.model.routing_profile import DEFAULT_CURVE, HitCurve, default_curve
from orchestrator.plan import expert_cache as X
from orchestrator.plan.placement import (
    GpuBudget, Placement, _DoesNotFit, cpu_expert_override, layer_split_placement, place_cpu_only,
    place_graph_split, place_layer_split, place_single,
)
from orchestrator.plan.predict import SpeedInputs, op_offload_threshold, predict_pp, predict_tg, predict_tg_streams
from orchestrator.plan.request import NodeRequest, PlanRequest
from orchestrator.plan.types import Decision, DeviceMemory, LayerRange, Plan, Prediction, WorkerPlan
from orchestrator.units import GiB, MiB, fmt_bytes

UBATCH_CANDIDATES = (512, 1024, 2048, 4096)
# mainline llama.cpp refuses -sm tensor for these architectures (src/llama-arch.cpp llm_arch_supports_sm_tensor)
SM_TENSOR_UNSUPPORTED = frozenset({
    "grok", "mpt", "plamo2", "minicpm3", "gemma3n", "mamba", "mamba2", "jamba", "falcon-h1", "olmo2", "olmoe",
    "deepseek2", "deepseek32", "bitnet", "t5", "nemotron_h", "nemotron_h_moe", "granitehybrid", "minimax01",
    "minimax-m2", "kimi-linear", "glm-dsa",
})
_QUANT_KV = {"q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl"}


@dataclass(frozen=True)
class _Candidate:
    ubatch: int
    placement: Placement
    threshold: int | None
    threshold_why: str
    tg: float
    tg_bytes: Mapping[str, int]
    pp: Mapping[int, float]
    compute_gpu: tuple[int, ...]            # per GPU of the worker (CUDA0, CUDA1, ...)
    overhead_gpu: int
    speed: SpeedInputs
    budgets: tuple[GpuBudget, ...] = ()
    tg_streams: float = 0.0                 # aggregate of the request's parallel streams (0: not predicted yet)


def _kv_layers(model: ModelInfo, req: PlanRequest, *, ub: int = 512, fa: str = "on",
                flavor: Flavor = Flavor.MAINLINE
               ) -> list[int]:
    return M.kv_by_layer(model, n_ctx=req.context, n_parallel=req.parallel, type_k=req.type_k, type_v=req.type_v,
                         n_ubatch=ub, n_batch=_n_batch(req, ub), flash_attn=fa != "off", flavor=flavor)


def _flash_attn(req: PlanRequest, has_gpu: bool) -> str:
    if req.flash_attn in ("on", "off"):
        return req.flash_attn
    if req.type_v.lower() in _QUANT_KV:
        return "on"  # a quantized V cache needs flash attention
    return "on" if has_gpu else "auto"


def _split_mode(req: PlanRequest, backend: BackendInfo, model: ModelInfo, n_gpus: int, fa: str) -> tuple[str, str]:
    if n_gpus <= 1:
        return "none", "one GPU"
    if req.split_mode != "auto":
        mode = req.split_mode
        if mode in ("tensor", "graph") and not backend.has(f"sm_{mode}"):
            raise PlanError(f"workers.split_mode: {mode!r} is not offered by {backend.server} ({backend.flavor}; "
                            f"it offers {', '.join(backend.split_modes) or 'none'}): choose one of those or 'auto'")
        return mode, "set by the topology"
    if backend.ik and backend.has("sm_graph"):
        return "graph", "ik_llama.cpp -sm graph: every GPU works on every layer; -ot only for CPU overflow"
    if backend.has("sm_tensor"):
        blockers = []
        if model.arch in SM_TENSOR_UNSUPPORTED:
            blockers.append(f"architecture {model.arch} is not supported by -sm tensor")
        if fa == "off":
            blockers.append("flash attention is off")
        if req.type_k.lower() in _QUANT_KV or req.type_v.lower() in _QUANT_KV:
            blockers.append("the KV cache is quantized")
        if not blockers:
            return "tensor", "mainline -sm tensor: weights and KV split over all GPUs (flash attention, f16 KV)"
        return "layer", "-sm layer with balanced ranges (" + "; ".join(blockers) + ")"
    return "layer", "-sm layer with balanced ranges (no tensor/graph split in this llama-server)"


def _speed_inputs(machine: Machine, gpus: list, load_mode: str, host_nodes: tuple[int, ...], threads: int
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
    return SpeedInputs(tuple(mem_bw), tuple(flops), h2d or 1.0, host_bw, per_core * max(threads, 1),
                       h2d_pinned or 0.0), notes


def _gpu_free(g, node_req: NodeRequest) -> tuple[int, str]:
    free = g.memory_free_bytes if g.memory_free_bytes is not None else g.memory_bytes
    if free is None:
        raise PlanError(f"GPU {g.index} ({g.name}): its memory size is unknown; set nodes[].vram_limit")
    limit = node_req.limit_for(g.index)
    if limit is not None:
        if limit > free:
            return free, f"vram_limit {fmt_bytes(limit)} > free {fmt_bytes(free)}: using the free memory"
        return limit, f"vram_limit {fmt_bytes(limit)}"
    return free, f"free {fmt_bytes(free)}"


def _place(costs, kv_layer, budgets, mode, req):
    forced = req.expert_layers_on_cpu
    if len(budgets) == 1:
        return place_single(costs, kv_layer, budgets[0], forced)
    if mode in ("tensor", "graph"):
        return place_graph_split(costs, kv_layer, budgets, mode, forced)
    return place_layer_split(costs, kv_layer, budgets)


def gpu_computes(model: ModelInfo, req: PlanRequest, *, ub: int, fa: str, flavor: Flavor, mode: str, n_gpus: int,
                 staging: int) -> tuple[int, ...]:
    """Compute buffer of each GPU of a worker (CUDA0, CUDA1, ...). ``staging``: room to copy in a host-resident
    expert tensor for an offloaded batch. An offloaded op runs on the first GPU backend that takes it (ggml's
    scheduler tries CUDA0 first), so with ``-sm layer`` only CUDA0 stages (measured on two H200s: CUDA1's buffer
    lacked exactly that copy); the tensor/graph splits keep it on every GPU (not measured)."""
    def one(st: int) -> int:
        return M.gpu_compute_bytes(model, n_ubatch=ub, n_batch=_n_batch(req, ub), n_ctx=req.context,
                                   n_parallel=req.parallel, flash_attn=fa != "off", type_k=req.type_k,
                                   type_v=req.type_v, has_output=True, staging=st, flavor=flavor)
    full = one(staging)
    base = one(0) if staging and mode == "layer" else full
    return tuple(full if k == 0 else base for k in range(n_gpus))


def _evaluate(model, costs, kv_layer, gpus, node_req, req, mode, fa, ub, load_mode, host_nodes, threads, machine,
              flavor=Flavor.MAINLINE):
    """Place the model for micro-batch ``ub`` and predict its speed."""
    overhead = M.cuda_overhead(model, ub)

    def budgets_for(staging: int) -> tuple[list[GpuBudget], tuple[int, ...]]:
        computes = gpu_computes(model, req, ub=ub, fa=fa, flavor=flavor, mode=mode, n_gpus=len(gpus),
                                staging=staging)
        out = []
        for k, g in enumerate(gpus):
            free, _why = _gpu_free(g, node_req)
            out.append(GpuBudget(g.index, g.name, free - node_req.vram_reserve - overhead - computes[k]))
        return out, computes

    budgets, compute = budgets_for(0)
    placement = _place(costs, kv_layer, budgets, mode, req)
    # CPU-resident experts are copied into the GPU's compute buffer for big batches: make room, place again
    for _ in range(3):
        staging = M.staging_bytes(model, placement.cpu_expert_layers)
        if not staging:
            break
        budgets, compute2 = budgets_for(staging)
        again = _place(costs, kv_layer, budgets, mode, req)
        compute = compute2
        if again.cpu_expert_layers == placement.cpu_expert_layers:
            placement = again
            break
        placement = again
    speed, _ = _speed_inputs(machine, gpus, load_mode, host_nodes, threads)
    if req.op_offload_min_batch is not None:
        threshold, why = req.op_offload_min_batch, "set by the topology"
    else:
        threshold, why = op_offload_threshold(costs, placement, speed, max_batch=max(ub, 4096),
                                              min_batch=req.parallel + 1)
    tg, tg_bytes = predict_tg(costs, placement, speed, 0.0)
    pp = predict_pp(costs, placement, speed, ub, threshold)
    return _Candidate(ub, placement, threshold, why, tg, tg_bytes, pp, compute, overhead, speed, tuple(budgets))


def _n_batch(req: PlanRequest, ub: int) -> int:
    return max(req.batch or 2048, ub)


def _choose(cands: list[_Candidate], objective: str = "generation") -> _Candidate:
    """Largest prompt speed at 4096 tokens among candidates whose generation speed is within 3% of the best
    (objective ``generation``); the largest prompt speed (``prompt``); the best geometric mean of both, each
    relative to its best (``balanced``)."""
    if objective == "prompt":
        return max(cands, key=lambda c: (round(c.pp.get(4096, 0.0), 1), c.tg, -c.ubatch))
    if objective == "balanced":
        top_tg = max(c.tg for c in cands) or 1.0
        top_pp = max(c.pp.get(4096, 0.0) for c in cands) or 1.0
        return max(cands, key=lambda c: (c.tg / top_tg * c.pp.get(4096, 0.0) / top_pp, -c.ubatch))
    best_tg = max(c.tg for c in cands)
    ok = [c for c in cands if c.tg >= 0.97 * best_tg]
    return max(ok, key=lambda c: (round(c.pp.get(4096, 0.0), 1), c.tg, -c.ubatch))


def _ranges(placement: Placement, n_layers: int, gpu_names: list[str]) -> tuple[LayerRange, ...]:
    def dev(g):
        if g is None:
            return "CPU"
        if placement.split_mode in ("tensor", "graph"):
            return "+".join(gpu_names)
        return gpu_names[g]

    out = []
    start = 0
    for i in range(1, n_layers + 1):
        if i == n_layers or (placement.layer_gpu[i], placement.experts_on_gpu[i]) != (
                placement.layer_gpu[start], placement.experts_on_gpu[start]):
            a = dev(placement.layer_gpu[start])
            e = a if placement.experts_on_gpu[start] else "CPU"
            out.append(LayerRange(start, i - 1, a, e))
            start = i
    return tuple(out)


@dataclass(frozen=True)
class _Side:
    """What the GPU or the CPU-only branch of a worker decided."""

    placement: Placement
    memory: tuple[DeviceMemory, ...]
    predicted: Prediction
    threshold: int | None
    ubatch: int
    load_mode: str
    cpu: CpuChoice
    gpu_names: tuple[str, ...] = ()
    main: Gpu | None = None                  # the main GPU (best measured host bandwidth)
    cache: X.CachePlan | None = None         # the expert cache decision (None: not considered)
    cache_mib: int = 0                       # --moe-cache-mib


def _gpu_side(*, model: ModelInfo, costs: ModelCosts, req: PlanRequest, machine: Machine, node_req: NodeRequest,
              gpus: list[Gpu], kv_layer: list[int], fa: str, flavor: Flavor, mode: str, mode_why: str,
              package: int | None, share: tuple[int, int] | None, decisions: list[Decision],
              backend: BackendInfo | None = None, curve: HitCurve = DEFAULT_CURVE) -> _Side:
    """Placement over the worker's GPUs: micro-batch candidates, load mode, NUMA binding, op-offload threshold."""
    n_ctx = req.context
    gpu_indexes = [g.index for g in gpus]
    # main GPU: best measured host bandwidth (ties: lowest index)
    bw = machine.bandwidth
    def h2d(g):
        if bw is None:
            return 0.0
        vals = [v for (gi, _n), v in dict(bw.gpu_h2d).items() if gi == g.index]
        return max(vals) if vals else 0.0
    main = max(gpus, key=lambda g: (h2d(g), -g.index))
    anchor = machine.nearest_cpu_node(main)
    # host memory of the anchor node decides pinned vs mmap; evaluate with a first guess of CPU bytes
    load_mode_req = req.load_mode
    ubs = [req.ubatch] if req.ubatch else list(UBATCH_CANDIDATES)
    # a first guess of the CPU-resident bytes (what the GPUs cannot hold) picks the NUMA nodes to measure
    gpu_room = sum(max(0, _gpu_free(g, node_req)[0] - node_req.vram_reserve) for g in gpus)
    host_guess = max(costs.input_bytes, costs.total_bytes + sum(kv_layer) - gpu_room)
    cpu = choose_cpu(machine, host_bytes=host_guess, ram_reserve=node_req.ram_reserve, anchor_node=anchor,
                     package=package, policy=req.numa, smt=req.smt, threads=req.threads,
                     threads_batch=req.threads_batch, share=share)
    avail = machine.memory_available_bytes or sum(node_available(machine, n) for n in machine.numa_nodes)

    def choose_load_mode(host_bytes: int) -> tuple[str, str]:
        if load_mode_req != "auto":
            return load_mode_req, "set by the topology"
        if host_bytes + node_req.ram_reserve <= avail:
            return "pinned", (f"CPU-resident weights ({fmt_bytes(host_bytes)}) + reserve fit the available "
                              f"{fmt_bytes(avail)}: load them into pinned host buffers, so batches are copied to "
                              f"the GPU at full PCIe speed (mmap'd pages copy ~{1 / R.PAGEABLE_FRACTION:.0f}x "
                              "slower)")
        return "mmap", (f"CPU-resident weights ({fmt_bytes(host_bytes)}) + reserve exceed the available "
                        f"{fmt_bytes(avail)}: keep them memory-mapped")

    load_mode, lm_why = choose_load_mode(host_guess)      # a first guess; checked again with the placement
    def evaluate(mode: str) -> tuple[list, list]:
        cands, errors = [], []
        for ub in ubs:
            try:
                kv_ub = _kv_layers(model, req, ub=ub, fa=fa, flavor=flavor)
                cands.append(_evaluate(model, costs, kv_ub, gpus, node_req, req, mode, fa, ub, load_mode,
                                       cpu.host_nodes, cpu.threads, machine, flavor))
            except _DoesNotFit as e:
                errors.append((ub, e))
        return cands, errors

    cands, errors = evaluate(mode)
    if mode == "tensor" and req.split_mode == "auto" and cands and \
            any(costs.layer_experts[i] for i in _choose(cands).placement.cpu_expert_layers):
        # measured on two H200s (docs/benchmarks.md): with routed experts in host memory, mainline -sm tensor
        # ran prompts 7x slower than -sm layer and ran out of GPU memory at a 2048-token micro-batch
        layer_cands, layer_errors = evaluate("layer")
        if layer_cands:
            cands, errors = layer_cands, layer_errors
            mode, mode_why = "layer", ("-sm layer with balanced ranges (experts overflow to host memory, where "
                                       "mainline -sm tensor was measured 7x slower on prompts and ran out of "
                                       "memory)")
    if not cands:
        ub, e = errors[0]
        raise PlanError(
            f"model {model.paths[0]}: attention, norms, shared weights, output and the KV cache for "
            f"{req.context} tokens ({req.parallel} slots) need {fmt_bytes(e.need)} but the GPUs "
            f"{list(gpu_indexes)} offer {fmt_bytes(e.have)} after reserves: lower model.context or "
            f"model.parallel, quantize the KV cache (model.cache_type_k and cache_type_v: q8_0), or add GPUs")
    best = _choose(cands)
    placement = best.placement
    # the load mode again with the bytes the placement really leaves in host memory (whole layers of experts
    # can leave more there than the first guess); a change means evaluating again under the other mode
    final_mode, lm_why = choose_load_mode(placement.cpu_weights)
    shown = cands
    if final_mode != load_mode:
        load_mode = final_mode
        cands2, _errors = evaluate(mode)
        if cands2:
            best = _choose(cands2)
            placement = best.placement
            shown = cands2
    cache_plan, cache_decision, cache_size = None, None, None
    if backend is not None and backend.has("moe_cache"):
        # the split between whole layers and the cache, for every micro-batch: a cache can make up for the
        # layers a bigger compute buffer displaces, so the micro-batch is chosen again with it
        results = [_expert_cache(model=model, costs=costs, req=req, backend=backend, gpus=gpus, best=c,
                                 node_req=node_req, fa=fa, flavor=flavor, load_mode=load_mode, cpu=cpu,
                                 machine=machine, mode=mode, curve=curve) for c in shown]
        shown = [r[2] for r in results]
        best = _choose(shown, req.objective)
        cache_plan, cache_decision, _c, cache_size = next(r for r in results if r[2] is best)
        placement = best.placement
        if cache_size and load_mode_req == "auto":
            # layers moved to the cache stay in host memory (their room there was checked): say so with the
            # bytes that are really there
            again, why = choose_load_mode(placement.cpu_weights)
            if again == load_mode:
                lm_why = why
    # with the final placement, re-check the NUMA choice with the real CPU-resident bytes
    host_bytes = placement.cpu_weights + placement.cpu_kv
    cpu = choose_cpu(machine, host_bytes=host_bytes, ram_reserve=node_req.ram_reserve, anchor_node=anchor,
                     package=package, policy=req.numa, smt=req.smt, threads=req.threads,
                     threads_batch=req.threads_batch, share=share)
    gpu_names = [f"CUDA{k}" for k in range(len(gpus))]
    decisions.append(Decision("gpus", ",".join(str(g.index) for g in gpus),
                              f"main GPU {main.index} ({main.name}); host memory nearest to it: node {anchor}"))
    decisions.append(Decision("split mode", mode, mode_why))
    n_cpu_exp = len([i for i in placement.cpu_expert_layers if costs.layer_experts[i]])
    decisions.append(Decision(
        "placement", f"{len(costs.moe_layers) - n_cpu_exp}/{len(costs.moe_layers)} expert layers in VRAM",
        f"always-used weights {fmt_bytes(sum(costs.layer_always) + costs.output_bytes)} + KV "
        f"{fmt_bytes(sum(kv_layer))} on the GPU first; routed experts by whole layers in the rest; "
        f"{n_cpu_exp} layers of experts ({fmt_bytes(sum(costs.layer_experts[i] for i in placement.cpu_expert_layers))}) "
        f"in host memory" + (" (forced)" if req.expert_layers_on_cpu is not None else "")))
    decisions.append(Decision("ubatch", f"-b {_n_batch(req, best.ubatch)} -ub {best.ubatch}",
                              "candidates " + ", ".join(f"ub {c.ubatch}: tg {c.tg:.1f} t/s, pp4096 "
                                                        f"{c.pp.get(4096, 0):.0f} t/s" for c in shown)
                              + {"generation": " -> fastest prompt within 3% of the best generation",
                                 "prompt": " -> fastest prompt (objective prompt)",
                                 "balanced": " -> best product of generation and prompt speed (objective "
                                             "balanced)"}[req.objective]))
    decisions.append(Decision("load mode", load_mode, lm_why if n_cpu_exp else
                              "no CPU-resident experts: " + lm_why))
    decisions.append(Decision("op offload", str(best.threshold), best.threshold_why))
    if cache_decision is not None:
        decisions.append(cache_decision)
    threshold = best.threshold if n_cpu_exp else None
    ub = best.ubatch
    memory = []
    for k, g in enumerate(gpus):
        free, why = _gpu_free(g, node_req)
        memory.append(DeviceMemory(gpu_names[k], weights=placement.gpu_weights[k], kv=placement.gpu_kv[k],
                                   compute=best.compute_gpu[k], overhead=best.overhead_gpu,
                                   budget=free - node_req.vram_reserve,
                                   cache=cache_size[k] if cache_size else 0))
    cpu_compute = M.cpu_compute_bytes(model, n_ubatch=ub, n_batch=_n_batch(req, ub), n_ctx=n_ctx,
                                      n_parallel=req.parallel, flash_attn=fa != "off", type_k=req.type_k,
                                      type_v=req.type_v, has_layers=placement.n_gpu_layers <= model.n_layers,
                                      has_output=placement.n_gpu_layers <= model.n_layers, flavor=flavor)
    memory.append(DeviceMemory("CPU", weights=placement.cpu_weights, kv=placement.cpu_kv, compute=cpu_compute,
                               overhead=M.output_bytes(model, req.parallel)))
    streams = max(1, req.parallel)
    tg_streams = best.tg_streams or predict_tg_streams(costs, placement, best.speed, streams)
    pred = Prediction(pp=best.pp, tg=best.tg, tg_bytes_per_token=best.tg_bytes, streams=streams,
                      tg_streams=tg_streams)
    return _Side(placement, tuple(memory), pred, threshold, ub, load_mode, cpu, tuple(gpu_names), main,
                 cache_plan, cache_plan.chosen.cache_mib if cache_plan is not None and cache_plan.use_cache else 0)



def _expert_cache(*, model: ModelInfo, costs: ModelCosts, req: PlanRequest, backend: BackendInfo, gpus: list[Gpu],
                  best: _Candidate, node_req: NodeRequest, fa: str, flavor: Flavor, load_mode: str, cpu: CpuChoice,
                  machine: Machine, mode: str, curve: HitCurve):
    """Split the VRAM the placement gives routed experts between whole expert layers and the expert cache
    (``--moe-cache-mib``, when the backend has it and some expert layers stay in host memory). Returns
    (the cache plan or None, its decision or None, the candidate to run -- re-placed when layers moved to the
    cache -- and the cache's size in VRAM or None)."""
    host = [i for i in best.placement.cpu_expert_layers if costs.layer_experts[i]]
    if not host or not costs.n_expert or not backend.has("moe_cache"):
        return None, None, best, None
    if req.expert_cache == 0:
        return None, Decision("expert cache", "off", "set by the topology"), best, None
    if best.placement.n_gpu_layers <= costs.n_layers:
        return None, Decision("expert cache", "off", "some layers' attention is in host memory: the cache serves "
                                                     "layers computed on a GPU"), best, None
    if len(gpus) > 1 and mode != "layer":
        return None, Decision("expert cache", "off", f"-sm {mode} spreads every layer over all GPUs: the cache is "
                                                     f"planned for one GPU or -sm layer"), best, None
    if len(gpus) > 1 and req.expert_cache is not None:
        return None, Decision("expert cache", "off", "a cache of a set size is planned for one-GPU workers; "
                                                     "leave workers.expert_cache auto to split several GPUs"), best, None
    if req.expert_layers_on_cpu is not None and req.expert_cache is None:
        return None, Decision("expert cache", "off", "the expert placement is forced: set workers.expert_cache "
                                                     "to a size to add a cache beside it"), best, None
    moe = list(costs.moe_layers)
    layer_bytes = max(costs.layer_experts[i] for i in moe)
    sp = best.speed
    gpu_bw = sp.gpu_mem_bw[0] * R.GPU_TG_EFFICIENCY
    host_bw = sp.host_bw * R.CPU_TG_EFFICIENCY
    per_token = layer_bytes * costs.n_expert_used / costs.n_expert
    on_gpu = sum(costs.layer_experts[i] for i in moe if i not in host)
    # what the roofline gives everything but the routed experts: the no-cache candidate at this placement then
    # predicts exactly the plan's generation speed
    t_experts = (on_gpu * costs.n_expert_used / costs.n_expert / gpu_bw
                 + len(host) * (per_token / host_bw + R.CROSS_DEVICE_LAYER_OVERHEAD_S))
    base = max(0.0, 1.0 / best.tg - t_experts) if best.tg > 0 else 0.0
    b = best.budgets[0]
    leftover = max(0, b.budget - best.placement.gpu_weights[0] - best.placement.gpu_kv[0])
    pinned = sp.h2d_pinned or sp.h2d / R.PINNED_COPY_EFFICIENCY
    pcie = pinned * (R.PAGEABLE_FRACTION if load_mode == "mmap" else R.CACHE_UPLOAD_EFFICIENCY)
    size_req = req.expert_cache
    forced = req.expert_layers_on_cpu is not None
    min_gpu_layers = 0
    if load_mode != "mmap":
        # layers moved to the cache stay in host memory, read into it: they must fit beside what is there
        avail = sum(node_available(machine, n) for n in machine.numa_nodes
                    if not cpu.host_nodes or n.id in cpu.host_nodes) or (machine.memory_available_bytes or 0)
        if avail:
            room = avail - (node_req.ram_reserve or 0) - best.placement.cpu_weights - best.placement.cpu_kv - GiB
            min_gpu_layers = max(0, len(moe) - len(host) - max(0, room) // layer_bytes)
    inp = X.CacheInputs(curve=curve, layer_expert_bytes=layer_bytes, n_expert=costs.n_expert,
                        n_expert_used=costs.n_expert_used, n_moe_layers=len(moe),
                        vram_free=on_gpu + (size_req if forced else leftover), pcie_bw=pcie, host_bw=host_bw,
                        gpu_bw=gpu_bw, base_seconds=base,
                        cpu_misses=req.expert_cache_misses != "upload" and backend.has("moe_cache_cpu_misses"),
                        upload_misses=req.expert_cache_misses != "cpu",
                        host_layer_overhead_s=R.CROSS_DEVICE_LAYER_OVERHEAD_S,
                        cache_layer_overhead_s=R.CACHE_LAYER_OVERHEAD_S, cache_fixed_s=R.CACHE_FIXED_S,
                        cpu_miss_hop_s=R.CACHE_CPU_MISS_HOP_S, cpu_miss_fixed_s=R.CACHE_CPU_MISS_FIXED_S,
                        min_gpu_layers=min_gpu_layers, prefill_reads_cache=backend.has("moe_cache_prefill"),
                        prefill_read_saving=R.PREFILL_READ_SAVING, prefill_read_overhead_s=R.PREFILL_READ_OVERHEAD_S,
                        streams=req.parallel, stream_share_exponent=R.STREAM_SHARE_EXPONENT)
    splits, per_gpu_host = None, {}
    if len(gpus) > 1:
        splits, per_gpu_host = _layer_split_cache_splits(costs, best, moe, host, layer_bytes, min_gpu_layers)
        inp = replace(inp, vram_free=on_gpu)
    cplan = X.plan_expert_cache(inp, req.objective, cache_bytes=size_req, splits=splits)
    curve_note = f"; hit-rate curve: {curve.source}"
    if req.expert_cache_misses == "cpu" and not backend.has("moe_cache_cpu_misses"):
        curve_note += "; misses uploaded: this llama-server has no --moe-cache-cpu-misses"
    if not cplan.use_cache:
        return cplan, Decision("expert cache", "off", cplan.reason + curve_note), best, None
    c = cplan.chosen
    if forced:
        new_host = tuple(host)
    elif len(gpus) > 1:
        new_host = per_gpu_host[(c.gpu_layers, c.cache_bytes)]
    else:
        new_host = tuple(moe[:c.host_layers])
    # every busy slot adds a token to a generation batch: the cache must serve batches of that many
    size = moe_cache_size(model, new_host, c.cache_mib, max_batch=_cache_max_batch(req))
    if not size.active:
        return cplan, Decision("expert cache", "off", f"{c.cache_mib} MiB holds less than one token's experts "
                                                      f"per layer" + curve_note), best, None
    cand = best
    if set(new_host) != set(host):
        kv_ub = _kv_layers(model, req, ub=best.ubatch, fa=fa, flavor=flavor)
        if len(gpus) > 1:
            cand = _relayout(costs, kv_ub, best, new_host, req)
        else:
            cand = _evaluate(model, costs, kv_ub, gpus, node_req, req.copy(expert_layers_on_cpu=new_host), mode,
                             fa, best.ubatch, load_mode, cpu.host_nodes, cpu.threads, machine, flavor)
    # what our patch allocates: every bank the same slot count (cache MiB / one expert of every host-resident
    # expert tensor), each on the GPU that runs its layer
    banks = tuple(moe_cache_bank_bytes(model, [i for i in new_host if cand.placement.layer_gpu[i] == g],
                                       size.slots, size.batch_cap) for g in range(len(gpus)))
    tg_bytes = dict(cand.tg_bytes)
    if len(gpus) > 1:
        cplan = replace(cplan, per_gpu=_cache_shares(costs, cand.placement, new_host, size.slots, c, banks))
        for share in cplan.per_gpu:         # each GPU reads its own banks (hits and the misses copied in)
            tg_bytes[share.device] = int(tg_bytes.get(share.device, 0) + share.hit_bytes + share.pcie_bytes)
    else:
        gpu0 = next(iter(k for k in tg_bytes if k.startswith("CUDA")), "CUDA0")
        tg_bytes[gpu0] = int(tg_bytes.get(gpu0, 0) + c.cache_hit_bytes + c.pcie_bytes)
    tg_bytes["CPU"] = max(0, int(tg_bytes.get("CPU", 0) - c.host_layers * per_token))
    tg_bytes["PCIe"] = int(c.pcie_bytes)
    pp = cand.pp
    if backend.has("moe_cache_prefill"):
        # big batches read the experts the slots hold from them: only the rest crosses PCIe
        pp = predict_pp(costs, cand.placement, cand.speed, cand.ubatch, cand.threshold,
                        cached_fraction=size.slots / costs.n_expert)
    cand = replace(cand, tg=c.tokens_per_s, tg_bytes=tg_bytes, pp=pp, tg_streams=c.stream_tokens_per_s)
    return cplan, Decision("expert cache", f"{c.cache_mib} MiB", cplan.reason + curve_note), cand, banks


def _cache_shares(costs: ModelCosts, placement: Placement, host: tuple[int, ...], slots: int,
                  chosen: X.CacheCandidate, banks: tuple[int, ...]) -> tuple[X.GpuCacheShare, ...]:
    """Each GPU's banks and what they serve per token: its host-resident layers' picks, the chosen hit rate."""
    pick = costs.n_expert_used * max(costs.layer_experts[i] for i in costs.moe_layers) / costs.n_expert
    out = []
    for g, bank in enumerate(banks):
        mine = [i for i in costs.moe_layers if placement.layer_gpu[i] == g]
        h = sum(1 for i in mine if i in host)
        picks = h * pick
        out.append(X.GpuCacheShare(f"CUDA{g}", len(mine) - h, h, slots if h else 0, bank, chosen.hit_rate,
                                   chosen.hit_rate * picks, (1.0 - chosen.hit_rate) * picks))
    return tuple(out)


def _cache_max_batch(req: PlanRequest) -> int:
    return max(MOE_CACHE_MAX_BATCH, req.parallel)


def _layer_split_cache_splits(costs: ModelCosts, best: _Candidate, moe: list[int], host: list[int],
                              layer_bytes: int, min_gpu_layers: int):
    """With ``-sm layer`` every GPU holds the banks of its own layers, all with the same slot count: for each
    slot count, the most whole layers each GPU keeps beside the banks of its host-resident layers (never more
    than the placement gave it). Returns the (whole layers, cache bytes) pairs and, for each, the host-resident
    layers (each GPU's first ones, as --n-cpu-moe would)."""
    p = best.placement
    expert = layer_bytes / costs.n_expert
    host_set = set(host)
    by_gpu: dict[int, list[int]] = {}
    for i in moe:
        by_gpu.setdefault(p.layer_gpu[i], []).append(i)
    room = {}
    for g, layers in by_gpu.items():
        resident = sum(costs.layer_experts[i] for i in layers if i not in host_set)
        room[g] = best.budgets[g].budget - (p.gpu_weights[g] - resident) - p.gpu_kv[g]
    splits, hosts = [], {}
    for s in range(costs.n_expert_used, costs.n_expert + 1):
        keep, new_host = 0, []
        for g, layers in by_gpu.items():
            now = sum(1 for i in layers if i not in host_set)
            n = len(layers)
            # k layers whole + banks of s experts for the other n - k: k L + s (n - k) e <= room
            free = room[g] - s * n * expert
            if free < 0:
                keep = -1
                break
            k = n if layer_bytes <= s * expert else int(free // (layer_bytes - s * expert))
            k = max(0, min(k, now))
            keep += k
            new_host += layers[:n - k]
        if keep < min_gpu_layers or not new_host:
            continue
        # --moe-cache-mib is whole MiB and llama.cpp's slot count is MiB / (host layers x one expert): the MiB
        # that hold s slots, never so many more that the banks get s + 1 (small experts) and outgrow the room
        bank = s * len(new_host) * expert
        size = -(-int(bank) // MiB) * MiB
        if s < costs.n_expert and size >= bank + len(new_host) * expert:
            size = int(bank + len(new_host) * expert - 1) // MiB * MiB
            if size < costs.n_expert_used * len(new_host) * expert:
                continue
        if (keep, size) not in hosts:
            splits.append((keep, size))
            hosts[(keep, size)] = tuple(sorted(new_host))
    return tuple(splits), hosts


def _relayout(costs: ModelCosts, kv_layer: list[int], best: _Candidate, cpu_layers: tuple[int, ...],
              req: PlanRequest) -> _Candidate:
    """The plan's -sm layer ranges with the experts of ``cpu_layers`` in host memory: threshold, prompt speed and
    bytes per token again (the generation speed is then the cache's prediction)."""
    counts = list(best.placement.tensor_split)
    counts[-1] -= 1                                   # the output layer
    placement = layer_split_placement(costs, kv_layer, counts, cpu_layers)
    if req.op_offload_min_batch is not None:
        threshold, why = req.op_offload_min_batch, "set by the topology"
    else:
        threshold, why = op_offload_threshold(costs, placement, best.speed, max_batch=max(best.ubatch, 4096),
                                              min_batch=req.parallel + 1)
    pp = predict_pp(costs, placement, best.speed, best.ubatch, threshold)
    # the bytes each device reads per token follow the layers moved (the speed itself is the cache's prediction)
    tg, tg_bytes = predict_tg(costs, placement, best.speed, 0.0)
    return replace(best, placement=placement, threshold=threshold, threshold_why=why, pp=pp, tg=tg,
                   tg_bytes=tg_bytes)


def _cpu_side(*, model: ModelInfo, costs: ModelCosts, req: PlanRequest, machine: Machine, node_req: NodeRequest,
              kv_layer: list[int], fa: str, flavor: Flavor, package: int | None, share: tuple[int, int] | None,
              decisions: list[Decision]) -> _Side:
    """Everything in host memory: NUMA binding decides the load mode."""
    n_ctx = req.context
    placement = place_cpu_only(costs, kv_layer)
    host_bytes = placement.cpu_weights + placement.cpu_kv
    cpu = choose_cpu(machine, host_bytes=host_bytes, ram_reserve=node_req.ram_reserve, anchor_node=None,
                     package=package, policy=req.numa, smt=req.smt, threads=req.threads,
                     threads_batch=req.threads_batch, share=share)
    ub = req.ubatch or 512
    threshold = None
    bind = cpu.numa.mode == "bind" and len(machine.numa_nodes) > 1
    load_mode = req.load_mode if req.load_mode != "auto" else ("pinned" if bind else "mmap")
    lm_why = ("set by the topology" if req.load_mode != "auto" else
              "bound to one node: read the weights into memory allocated under the binding (mmap'd pages "
              "stay wherever the page cache put them)" if bind else "memory-mapped (the default)")
    decisions.append(Decision("gpus", "none", "no GPU selected or present: everything in host memory"))
    decisions.append(Decision("ubatch", f"-b {_n_batch(req, ub)} -ub {ub}", "CPU prompt speed barely depends on it"))
    decisions.append(Decision("load mode", "read" if load_mode == "pinned" else load_mode, lm_why))
    speed, _ = _speed_inputs(machine, [], load_mode, cpu.host_nodes, cpu.threads)
    tg, tg_bytes = predict_tg(costs, placement, speed)
    pp = predict_pp(costs, placement, speed, ub, None)
    streams = max(1, req.parallel)
    pred = Prediction(pp=pp, tg=tg, tg_bytes_per_token=tg_bytes, streams=streams,
                      tg_streams=predict_tg_streams(costs, placement, speed, streams))
    cpu_compute = M.cpu_compute_bytes(model, n_ubatch=ub, n_batch=_n_batch(req, ub), n_ctx=n_ctx,
                                      n_parallel=req.parallel, flash_attn=fa != "off", type_k=req.type_k,
                                      type_v=req.type_v, has_layers=True, has_output=True, flavor=flavor)
    memory = [DeviceMemory("CPU", weights=placement.cpu_weights, kv=placement.cpu_kv, compute=cpu_compute,
                           overhead=M.output_bytes(model, req.parallel))]
    return _Side(placement, tuple(memory), pred, threshold, ub, load_mode, cpu)


def plan_worker(*, name: str, node_req: NodeRequest, machine: Machine, model: ModelInfo, costs: ModelCosts,
                req: PlanRequest, backend: BackendInfo, gpu_indexes: tuple[int, ...], port: int,
                package: int | None = None, share: tuple[int, int] | None = None,
                curve: HitCurve = DEFAULT_CURVE) -> WorkerPlan:
    decisions: list[Decision] = []
    node_req = node_req.for_machine(machine.memory_total_bytes)
    by_index = {g.index: g for g in machine.gpus}
    gpus = [by_index[i] for i in gpu_indexes]
    has_gpu = bool(gpus) and backend.cuda
    if gpus and not backend.cuda:
        decisions.append(Decision("gpus", "none", f"{backend.server} was built without CUDA: CPU only "
                                                  f"(build one with `orchestrator build --cuda`)"))
        gpus = []
    fa = _flash_attn(req, has_gpu)
    flavor = backend.flavor
    kv_layer = _kv_layers(model, req, fa=fa, flavor=flavor)
    mode, mode_why = _split_mode(req, backend, model, len(gpus), fa)
    if gpus:
        side = _gpu_side(model=model, costs=costs, req=req, machine=machine, node_req=node_req, gpus=gpus,
                         kv_layer=kv_layer, fa=fa, flavor=flavor, mode=mode, mode_why=mode_why, package=package,
                         share=share, decisions=decisions, backend=backend, curve=curve)
    else:
        side = _cpu_side(model=model, costs=costs, req=req, machine=machine, node_req=node_req, kv_layer=kv_layer,
                         fa=fa, flavor=flavor, package=package, share=share, decisions=decisions)
    placement, memory, cpu, load_mode = side.placement, side.memory, side.cpu, side.load_mode
    decisions.extend(cpu.decisions)
    avail_host = sum(node_available(machine, n) for n in machine.numa_nodes
                     if not cpu.host_nodes or n.id in cpu.host_nodes) or (machine.memory_available_bytes or 0)
    host = memory[-1]
    # KV cache and compute buffers are anonymous memory; weights too unless memory-mapped (then the page cache
    # holds them and may evict them, at the price of re-reading from disk)
    anon = host.kv + host.compute + host.overhead + (host.weights if load_mode != "mmap" else 0)
    if avail_host and anon + node_req.ram_reserve > avail_host:
        where = f"nodes {list(cpu.host_nodes)}" if cpu.host_nodes else "this machine"
        raise PlanError(
            f"model {model.paths[0]}: host memory needed {fmt_bytes(anon)} (KV cache {fmt_bytes(host.kv)}, "
            f"compute {fmt_bytes(host.compute)}"
            + (f", weights {fmt_bytes(host.weights)}" if load_mode != "mmap" else "")
            + f") + ram_reserve {fmt_bytes(node_req.ram_reserve)} exceeds the {fmt_bytes(avail_host)} available on "
            f"{where}: lower model.context ({req.context}) or model.parallel, quantize the KV cache, or add memory")
    if load_mode == "mmap" and avail_host and host.total > 2 * avail_host:
        decisions.append(Decision("warning", "weights exceed RAM",
                                  f"{fmt_bytes(host.total)} in host memory vs {fmt_bytes(avail_host)} available: "
                                  f"weights will be re-read from disk (slow)"))
    overrides = cpu_expert_override(
        [i for i in placement.cpu_expert_layers if costs.layer_experts[i] > 0]) if gpus else ()
    n_layers = len(placement.layer_gpu)
    settings = WorkerSettings(
        model_path=model.paths[0], context=req.context, parallel=req.parallel, alias=req.alias, host=req.host,
        port=port,
        gpus=tuple(g.index for g in gpus) if gpus else (() if machine.gpus else None),
        n_gpu_layers=(ALL_LAYERS if placement.n_gpu_layers > n_layers else placement.n_gpu_layers) if gpus else 0,
        split_mode=placement.split_mode if len(gpus) > 1 else None,
        tensor_split=tuple(placement.tensor_split) if len(gpus) > 1 else (),
        main_gpu=gpus.index(side.main) if len(gpus) > 1 else None,
        tensor_overrides=overrides, fit=False, op_offload_min_batch=side.threshold, load_mode=load_mode,
        moe_cache_mib=side.cache_mib,
        moe_cache_max_batch=_cache_max_batch(req) if side.cache_mib and req.parallel > MOE_CACHE_MAX_BATCH else None,
        moe_cache_cpu_misses=bool(side.cache_mib and side.cache is not None and side.cache.chosen.miss_mode == "cpu"),
        numa=cpu.numa, numa_flag=cpu.numa_flag,
        disable_numa_balancing=req.disable_numa_balancing and len(machine.numa_nodes) > 1,
        threads=cpu.threads, threads_batch=cpu.threads_batch, n_batch=_n_batch(req, side.ubatch),
        n_ubatch=side.ubatch,
        flash_attn=fa, type_k=req.type_k, type_v=req.type_v, extra_args=req.extra_args,
    )
    return WorkerPlan(
        name=name, node=node_req.name, settings=settings, backend=backend,
        placement=_ranges(placement, model.n_layers, list(side.gpu_names)), memory=memory,
        predicted=side.predicted, decisions=tuple(decisions),
        cpu_expert_layers=tuple(i for i in placement.cpu_expert_layers if costs.layer_experts[i] > 0),
        expert_cache=side.cache,
    )


def _selected_gpus(machine: Machine, node_req: NodeRequest) -> tuple[int, ...]:
    have = [g.index for g in machine.gpus]
    if node_req.gpus is None:
        return tuple(have)
    missing = [i for i in node_req.gpus if i not in have]
    if missing:
        raise PlanError(f"nodes[{node_req.name}].gpus: GPU {missing[0]} does not exist on this machine "
                        f"(it has {', '.join(map(str, have)) or 'no GPUs'})")
    return tuple(node_req.gpus)


def make_plan(*, machines: Mapping[str, Machine], model: ModelInfo, request: PlanRequest,
              backend: BackendInfo, routing: HitCurve | None = None) -> Plan:
    """The whole deployment: workers on every node of the topology. When the topology left the KV cache type
    to the plan and an f16 cache does not fit, the plan uses q8_0 (with flash attention) and says so.

    ``routing``: the model's measured hit-rate curve (its routing profile); None = the stated default curve."""
    # without a measured profile: the stated default for the model's shape (expert count, top-k)
    curve = routing or default_curve(model.n_expert, model.n_expert_used)
    try:
        return _make_plan(machines=machines, model=model, request=request, backend=backend, curve=curve)
    except PlanError as first:
        if not (request.kv_auto and request.type_k == "f16" and request.type_v == "f16"):
            raise
        q8 = request.copy(type_k="q8_0", type_v="q8_0", kv_auto=False,
                          flash_attn="on" if request.flash_attn == "auto" else request.flash_attn)
        try:
            plan = _make_plan(machines=machines, model=model, request=q8, backend=backend, curve=curve)
        except PlanError:
            raise first from None
        why = Decision("KV cache", "q8_0", f"an f16 cache does not fit ({first}); q8_0 halves it")
        return replace(plan, decisions=(why, *plan.decisions))


def _make_plan(*, machines: Mapping[str, Machine], model: ModelInfo, request: PlanRequest,
               backend: BackendInfo, curve: HitCurve = DEFAULT_CURVE) -> Plan:
    costs = model_costs(model)
    if costs.n_expert and costs.n_expert_used > costs.n_expert:
        raise PlanError(f"{model.paths[0]}: expert_used_count {costs.n_expert_used} > expert_count {costs.n_expert}")
    if request.context <= 0 or request.parallel <= 0:
        raise PlanError("model.context and model.parallel must be positive")
    if request.context > model.n_ctx_train > 0:
        warn = (f"model.context {request.context} exceeds the model's training context {model.n_ctx_train}")
    else:
        warn = None
    kv_total = sum(_kv_layers(model, request, flavor=backend.flavor))
    workers: list[WorkerPlan] = []
    decisions: list[Decision] = []
    port = request.port_base
    for node_req in request.nodes:
        machine = machines[node_req.name]
        node_req = node_req.for_machine(machine.memory_total_bytes)
        gpus = _selected_gpus(machine, node_req)
        groups, why = worker_layout(machine, costs, request, gpus, kv_total, node_req)
        decisions.append(Decision(f"layout {node_req.name}", why.value, why.why))
        for k, (gidx, pkg, share) in enumerate(groups):
            name = f"{node_req.name}-{k}" if len(groups) > 1 or len(request.nodes) > 1 else node_req.name
            workers.append(plan_worker(name=name, node_req=node_req, machine=machine, model=model, costs=costs,
                                       req=request, backend=backend, gpu_indexes=gidx, port=port, package=pkg,
                                       share=share, curve=curve))
            port += 1
    summary = {
        "path": model.paths[0], "arch": model.arch, "n_layers": model.n_layers, "n_expert": costs.n_expert,
        "n_expert_used": costs.n_expert_used, "bytes": costs.total_bytes,
        "routed_expert_bytes": sum(costs.layer_experts), "context": request.context, "parallel": request.parallel,
        "kv_bytes": kv_total,
    }
    return Plan(workers=tuple(workers), model=summary, decisions=tuple(decisions),
                warnings=tuple(w for w in (warn,) if w))


__all__ = ["make_plan", "plan_worker", "GiB", "MiB"]
