"""make_plan: machines + model + request + backend -> Plan. Pure: no processes, files, network or clocks."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping

from orchestrator.backend import devices as D
from orchestrator.backend.info import BackendInfo
from orchestrator.errors import PlanError
from orchestrator.hardware.topology import Gpu, Machine
from orchestrator.launch.settings import ALL_LAYERS, WorkerSettings
from orchestrator.model.info import ModelInfo
from orchestrator.model.routing_profile import HitCurve, default_curve
from orchestrator.plan import buffers as M
from orchestrator.plan import rates as R
from orchestrator.plan.cache_choice import (NO_CACHE, CacheContext, CacheDecision, decide_expert_cache,
                                            host_layer_side_bytes)
from orchestrator.plan.candidates import (REPLY_TOKENS, WORKLOAD_PROMPTS, Candidate, choose, evaluate, gpu_free,
                                         kv_layers, request_seconds, speed_inputs)
from orchestrator.plan.planning_context import PlanningContext
from orchestrator.plan.costs import ModelCosts, model_costs
from orchestrator.plan.cpu import CpuChoice, CpuWants, choose_cpu, node_available
from orchestrator.plan.layout import worker_layout
from orchestrator.plan.placement import Placement, _DoesNotFit, cpu_expert_override, place_cpu_only
from orchestrator.plan.predict import predict_pp, predict_tg, predict_tg_streams
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


def _choose_cpu(ctx: PlanningContext, host_bytes: int, anchor: int | None) -> CpuChoice:
    """The worker's NUMA policy and threads for ``host_bytes`` in host memory, near ``anchor`` (the main GPU's
    node; None: no GPU)."""
    req = ctx.req
    return choose_cpu(ctx.machine, host_bytes=host_bytes, ram_reserve=ctx.node_req.ram_reserve, anchor_node=anchor,
                      package=ctx.package, share=ctx.share,
                      wants=CpuWants(req.numa, req.smt, req.threads, req.threads_batch))


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
    cache: CacheDecision = NO_CACHE          # the expert cache decision (its plan None: not considered)


@dataclass(frozen=True)
class _GpuWorker:
    """What every step of a GPU worker's plan reads: the planning context, the worker's GPUs, the KV cache by
    layer, the main GPU and the NUMA node nearest it, and the host memory available to load weights into."""

    ctx: PlanningContext
    gpus: list[Gpu]
    kv_layer: list[int]
    main: Gpu
    anchor: int | None
    avail: int


@dataclass(frozen=True)
class _Chosen:
    """The worker's candidates (one per micro-batch), the one chosen, and what they were evaluated under."""

    shown: list[Candidate]
    best: Candidate
    mode: str
    mode_why: str
    load_mode: str
    load_why: str
    cpu: CpuChoice
    cache: CacheDecision = NO_CACHE


def _gpu_side(ctx: PlanningContext, gpus: list[Gpu], kv_layer: list[int], mode: str, mode_why: str,
              decisions: list[Decision]) -> _Side:
    """Placement over the worker's GPUs: micro-batch candidates, load mode, expert cache, NUMA binding, op-offload
    threshold."""
    w = _gpu_worker(ctx, gpus, kv_layer)
    chosen = _with_expert_cache(w, _load_mode_again(w, _first_choice(w, mode, mode_why)))
    best = chosen.best
    placement = best.placement
    # with the final placement, re-check the NUMA choice with the real CPU-resident bytes
    cpu = _choose_cpu(ctx, placement.cpu_weights + _host_buffers(w, best), w.anchor)
    _placement_decisions(w, chosen, decisions)
    _batch_and_offload_decisions(w, chosen, decisions)
    n_cpu_exp = _n_host_expert_layers(ctx.costs, placement)
    streams = max(1, ctx.req.parallel)
    tg_streams = best.tg_streams or predict_tg_streams(ctx.costs, placement, best.speed, streams)
    pred = Prediction(pp=best.pp, tg=best.tg, tg_bytes_per_token=best.tg_bytes, streams=streams,
                      tg_streams=tg_streams)
    return _Side(placement=placement, memory=_gpu_memory(w, chosen), predicted=pred,
                 threshold=best.threshold if n_cpu_exp else None, ubatch=best.ubatch, load_mode=chosen.load_mode,
                 cpu=cpu, gpu_names=tuple(D.gpu(k) for k in range(len(gpus))), main=w.main, cache=chosen.cache)


def _n_host_expert_layers(costs: ModelCosts, placement: Placement) -> int:
    """Layers whose routed experts the placement leaves in host memory."""
    return len([i for i in placement.cpu_expert_layers if costs.layer_experts[i]])


def _gpu_worker(ctx: PlanningContext, gpus: list[Gpu], kv_layer: list[int]) -> _GpuWorker:
    """The main GPU (best measured host bandwidth; ties: lowest index), the node nearest it, the host memory."""
    machine = ctx.machine
    bw = machine.bandwidth

    def h2d(g):
        if bw is None:
            return 0.0
        vals = [v for (gi, _n), v in dict(bw.gpu_h2d).items() if gi == g.index]
        return max(vals) if vals else 0.0
    main = max(gpus, key=lambda g: (h2d(g), -g.index))
    avail = machine.memory_available_bytes or sum(node_available(machine, n) for n in machine.numa_nodes)
    return _GpuWorker(ctx=ctx, gpus=gpus, kv_layer=kv_layer, main=main, anchor=machine.nearest_cpu_node(main),
                      avail=avail)


def _load_mode(w: _GpuWorker, host_bytes: int, buffers: int = 0) -> tuple[str, str]:
    """Pinned host buffers where ``host_bytes`` of CPU-resident weights, the ``buffers`` beside them (KV cache,
    compute and output buffers in host memory) and the reserve fit the available memory, else memory-mapped
    (unless the topology says)."""
    req, avail = w.ctx.req, w.avail
    if req.load_mode != "auto":
        return req.load_mode, "set by the topology"
    what = f"CPU-resident weights ({fmt_bytes(host_bytes)})" + (f" + buffers ({fmt_bytes(buffers)})" if buffers else "")
    if host_bytes + buffers + w.ctx.node_req.ram_reserve <= avail:
        return "pinned", (f"{what} + reserve fit the available "
                          f"{fmt_bytes(avail)}: load them into pinned host buffers, so batches are copied to "
                          f"the GPU at full PCIe speed (mmap'd pages copy ~{1 / R.PAGEABLE_FRACTION:.0f}x "
                          "slower)")
    return "mmap", (f"{what} + reserve exceed the available "
                    f"{fmt_bytes(avail)}: keep them memory-mapped")


def _host_buffers(w: _GpuWorker, cand: Candidate) -> int:
    """What ``cand`` puts in host memory beside the weights: the KV cache of host layers, the CPU compute buffer
    and the output buffer."""
    model, placement = w.ctx.model, cand.placement
    on_host = placement.n_gpu_layers <= model.n_layers
    compute = M.cpu_compute_bytes(model, w.ctx.buffers(cand.ubatch), has_layers=on_host, has_output=on_host)
    return placement.cpu_kv + compute + M.output_bytes(model, w.ctx.req.parallel)


def _load_mode_of(w: _GpuWorker, cand: Candidate) -> tuple[str, str]:
    return _load_mode(w, cand.placement.cpu_weights, _host_buffers(w, cand))


def _pinned_fits(w: _GpuWorker, cands: list[Candidate]) -> list[Candidate]:
    """The candidates whose host bytes fit pinned buffers (all of them where the topology sets the load mode)."""
    return [c for c in cands if _load_mode_of(w, c)[0] != "mmap"]


def _evaluate_ubatches(w: _GpuWorker, mode: str, load_mode: str, cpu: CpuChoice) -> tuple[list, list]:
    """A candidate for every micro-batch that fits (the request's, or each of UBATCH_CANDIDATES), and the
    (micro-batch, why not) of those that do not."""
    ctx = w.ctx
    cands, errors = [], []
    for ub in ([ctx.req.ubatch] if ctx.req.ubatch else list(UBATCH_CANDIDATES)):
        try:
            kv_ub = kv_layers(ctx.model, ctx.req, ctx.flavor, ub=ub, fa=ctx.fa)
            cands.append(evaluate(ctx, w.gpus, kv_ub, mode=mode, ub=ub, load_mode=load_mode, cpu=cpu))
        except _DoesNotFit as e:
            errors.append((ub, e))
    return cands, errors


def _first_choice(w: _GpuWorker, mode: str, mode_why: str) -> _Chosen:
    """The candidates under a first guess of the CPU-resident bytes (what the GPUs cannot hold), which picks the
    NUMA nodes to measure and the load mode; -sm layer in place of an automatic -sm tensor where experts overflow
    to host memory."""
    ctx, costs, node_req = w.ctx, w.ctx.costs, w.ctx.node_req
    gpu_room = sum(max(0, gpu_free(g, node_req)[0] - node_req.vram_reserve) for g in w.gpus)
    host_guess = max(costs.input_bytes, costs.total_bytes + sum(w.kv_layer) - gpu_room)
    cpu = _choose_cpu(ctx, host_guess, w.anchor)
    load_mode, lm_why = _load_mode(w, host_guess)
    cands, errors = _evaluate_ubatches(w, mode, load_mode, cpu)
    if mode == "tensor" and ctx.req.split_mode == "auto" and cands and \
            any(costs.layer_experts[i] for i in choose(cands).placement.cpu_expert_layers):
        # measured on two H200s (docs/benchmarks.md): with routed experts in host memory, mainline -sm tensor
        # ran prompts 7x slower than -sm layer and ran out of GPU memory at a 2048-token micro-batch
        layer_cands, layer_errors = _evaluate_ubatches(w, "layer", load_mode, cpu)
        if layer_cands:
            cands, errors = layer_cands, layer_errors
            mode, mode_why = "layer", ("-sm layer with balanced ranges (experts overflow to host memory, where "
                                       "mainline -sm tensor was measured 7x slower on prompts and ran out of "
                                       "memory)")
    if not cands:
        raise _does_not_fit(w, errors[0][1])
    return _Chosen(shown=cands, best=choose(cands), mode=mode, mode_why=mode_why, load_mode=load_mode,
                   load_why=lm_why, cpu=cpu)


def _does_not_fit(w: _GpuWorker, e: _DoesNotFit) -> PlanError:
    model, req = w.ctx.model, w.ctx.req
    return PlanError(
        f"model {model.paths[0]}: attention, norms, shared weights, output and the KV cache for "
        f"{req.context} tokens ({req.parallel} slots) need {fmt_bytes(e.need)} but the GPUs "
        f"{[g.index for g in w.gpus]} offer {fmt_bytes(e.have)} after reserves: lower model.context or "
        f"model.parallel, quantize the KV cache (model.cache_type_k and cache_type_v: q8_0), or add GPUs")


def _load_mode_again(w: _GpuWorker, first: _Chosen) -> _Chosen:
    """The load mode again with the bytes the placement really leaves in host memory (whole layers of experts
    can leave more there than the first guess): pinned stays with the best candidate that fits it (a bigger
    micro-batch can leave more layers and buffers there); where none does, evaluating again memory-mapped."""
    final_mode, lm_why = _load_mode_of(w, first.best)
    chosen = replace(first, load_why=lm_why)
    if final_mode != first.load_mode and first.load_mode == "pinned":
        fitting = _pinned_fits(w, first.shown)
        if fitting:
            best = choose(fitting)
            return replace(chosen, shown=fitting, best=best, load_why=_load_mode_of(w, best)[1])
    if final_mode != first.load_mode:
        chosen = replace(chosen, load_mode=final_mode)
        again, _errors = _evaluate_ubatches(w, first.mode, final_mode, first.cpu)
        if again:
            chosen = replace(chosen, shown=again, best=choose(again))
            mode, why = _load_mode_of(w, chosen.best)
            if mode == final_mode:      # the reason with the bytes this placement leaves in host memory
                chosen = replace(chosen, load_why=why)
    return chosen


def _with_expert_cache(w: _GpuWorker, chosen: _Chosen) -> _Chosen:
    """The split between whole layers and the expert cache for every micro-batch: a cache can make up for the
    layers a bigger compute buffer displaces, so the micro-batch is chosen again with it."""
    ctx = w.ctx
    if not ctx.backend.has("expert_cache"):
        return chosen
    cc = CacheContext(plan=ctx, gpus=tuple(w.gpus), load_mode=chosen.load_mode, cpu=chosen.cpu,
                      split_mode=chosen.mode)
    decided = [decide_expert_cache(cc, c) for c in chosen.shown]
    if chosen.load_mode == "pinned":
        # layers the cache moves to host memory must still fit its pinned buffers
        decided = [d for d in decided if _pinned_fits(w, [d.candidate])] or decided
    shown = [d.candidate for d in decided]
    best = choose(shown, ctx.req.objective)
    cache = next(d for d in decided if d.candidate is best)
    lm_why = chosen.load_why
    if cache.bank_bytes and ctx.req.load_mode == "auto":
        # layers moved to the cache stay in host memory (their room there was checked): say so with the
        # bytes that are really there
        again, why = _load_mode_of(w, best)
        if again == chosen.load_mode:
            lm_why = why
    return replace(chosen, shown=shown, best=best, load_why=lm_why, cache=cache)


def _placement_decisions(w: _GpuWorker, chosen: _Chosen, decisions: list[Decision]) -> None:
    """The GPUs, the split mode and where the routed experts went."""
    costs, req, gpus, main, placement = w.ctx.costs, w.ctx.req, w.gpus, w.main, chosen.best.placement
    decisions.append(Decision("gpus", ",".join(str(g.index) for g in gpus),
                              f"main GPU {main.index} ({main.name}); host memory nearest to it: node {w.anchor}"))
    decisions.append(Decision("split mode", chosen.mode, chosen.mode_why))
    n_cpu_exp = _n_host_expert_layers(costs, placement)
    decisions.append(Decision(
        "placement", f"{len(costs.moe_layers) - n_cpu_exp}/{len(costs.moe_layers)} expert layers in VRAM",
        f"always-used weights {fmt_bytes(sum(costs.layer_always) + costs.output_bytes)} + KV "
        f"{fmt_bytes(sum(w.kv_layer))} on the GPU first; routed experts by whole layers in the rest; "
        f"{n_cpu_exp} layers of experts ({fmt_bytes(sum(costs.layer_experts[i] for i in placement.cpu_expert_layers))}) "
        f"in host memory" + (" (forced)" if req.expert_layers_on_cpu is not None else "")))


def _batch_and_offload_decisions(w: _GpuWorker, chosen: _Chosen, decisions: list[Decision]) -> None:
    """The micro-batch among the candidates, the load mode, the op-offload threshold and the expert cache."""
    ctx, req, best, shown, load_mode = w.ctx, w.ctx.req, chosen.best, chosen.shown, chosen.load_mode
    n_cpu_exp = _n_host_expert_layers(ctx.costs, best.placement)
    decisions.append(Decision("ubatch", f"-b {ctx.n_batch(best.ubatch)} -ub {best.ubatch}",
                              "candidates " + ", ".join(f"ub {c.ubatch}: tg {c.tg:.1f} t/s, pp4096 "
                                                        f"{c.pp.get(4096, 0):.0f} t/s, {request_seconds(c):.2f} s"
                                                        for c in shown)
                              + {"generation": f" -> least mean time of a {WORKLOAD_PROMPTS[0]}- and a "
                                               f"{WORKLOAD_PROMPTS[1]}-token prompt, each answered with "
                                               f"{REPLY_TOKENS} tokens",
                                 "prompt": " -> fastest prompt (objective prompt)",
                                 "balanced": " -> best product of generation and prompt speed (objective "
                                             "balanced)"}[req.objective]))
    decisions.append(Decision("load mode", load_mode, chosen.load_why if n_cpu_exp else
                              "no CPU-resident experts: " + chosen.load_why))
    decisions.append(Decision("op offload", str(best.threshold), best.threshold_why))
    if chosen.cache.decision is not None:
        decisions.append(chosen.cache.decision)


def _gpu_memory(w: _GpuWorker, chosen: _Chosen) -> tuple[DeviceMemory, ...]:
    """Predicted memory on each GPU (the expert cache's banks included) and in host memory."""
    model, req, node_req, best = w.ctx.model, w.ctx.req, w.ctx.node_req, chosen.best
    placement, banks = best.placement, chosen.cache.bank_bytes
    # the cached layers' expert biases stay on their GPU (cpu_expert_override(weights_only=True))
    kept = [0] * len(w.gpus)
    if chosen.cache.cache_mib and w.ctx.costs.layer_expert_side_bytes:
        for i in placement.cpu_expert_layers:
            kept[placement.layer_gpu[i]] += w.ctx.costs.layer_expert_side_bytes[i]
    memory = []
    for k, g in enumerate(w.gpus):
        free, _why = gpu_free(g, node_req)
        memory.append(DeviceMemory(D.gpu(k), weights=placement.gpu_weights[k] + kept[k], kv=placement.gpu_kv[k],
                                   compute=best.compute_gpu[k], overhead=best.overhead_gpu,
                                   budget=free - node_req.vram_reserve, cache=banks[k] if banks else 0))
    cpu_compute = M.cpu_compute_bytes(model, w.ctx.buffers(best.ubatch),
                                      has_layers=placement.n_gpu_layers <= model.n_layers,
                                      has_output=placement.n_gpu_layers <= model.n_layers)
    memory.append(DeviceMemory("CPU", weights=placement.cpu_weights - sum(kept), kv=placement.cpu_kv,
                               compute=cpu_compute, overhead=M.output_bytes(model, req.parallel)))
    return tuple(memory)


def _cpu_side(ctx: PlanningContext, kv_layer: list[int], decisions: list[Decision]) -> _Side:
    """Everything in host memory: NUMA binding decides the load mode."""
    model, costs, req, machine = ctx.model, ctx.costs, ctx.req, ctx.machine
    placement = place_cpu_only(costs, kv_layer)
    cpu = _choose_cpu(ctx, placement.cpu_weights + placement.cpu_kv, None)
    ub = req.ubatch or 512
    threshold = None
    bind = cpu.numa.mode == "bind" and len(machine.numa_nodes) > 1
    load_mode = req.load_mode if req.load_mode != "auto" else ("pinned" if bind else "mmap")
    lm_why = ("set by the topology" if req.load_mode != "auto" else
              "bound to one node: read the weights into memory allocated under the binding (mmap'd pages "
              "stay wherever the page cache put them)" if bind else "memory-mapped (the default)")
    decisions.append(Decision("gpus", "none", "no GPU selected or present: everything in host memory"))
    decisions.append(Decision("ubatch", f"-b {ctx.n_batch(ub)} -ub {ub}", "llama.cpp's default: on the CPU a prompt is bound by "
                              "its arithmetic, which the micro-batch does not change"))
    decisions.append(Decision("load mode", "read" if load_mode == "pinned" else load_mode, lm_why))
    speed, _ = speed_inputs(machine, [], load_mode, cpu.host_nodes, cpu.threads)
    tg, tg_bytes = predict_tg(costs, placement, speed)
    pp = predict_pp(costs, placement, speed, ub, None)
    streams = max(1, req.parallel)
    pred = Prediction(pp=pp, tg=tg, tg_bytes_per_token=tg_bytes, streams=streams,
                      tg_streams=predict_tg_streams(costs, placement, speed, streams))
    cpu_compute = M.cpu_compute_bytes(model, ctx.buffers(ub), has_layers=True, has_output=True)
    memory = [DeviceMemory("CPU", weights=placement.cpu_weights, kv=placement.cpu_kv, compute=cpu_compute,
                           overhead=M.output_bytes(model, req.parallel))]
    return _Side(placement=placement, memory=tuple(memory), predicted=pred, threshold=threshold, ubatch=ub,
                 load_mode=load_mode, cpu=cpu)


def plan_worker(ctx: PlanningContext, *, name: str, gpu_indexes: tuple[int, ...], port: int) -> WorkerPlan:
    """One worker on ``ctx.machine`` over the GPUs ``gpu_indexes`` (none: CPU only), serving on ``port``."""
    decisions: list[Decision] = []
    machine, model, costs, req, backend = ctx.machine, ctx.model, ctx.costs, ctx.req, ctx.backend
    node_req = ctx.node_req.for_machine(machine.memory_total_bytes)
    by_index = {g.index: g for g in machine.gpus}
    gpus = [by_index[i] for i in gpu_indexes]
    has_gpu = bool(gpus) and backend.cuda
    if gpus and not backend.cuda:
        decisions.append(Decision("gpus", "none", f"{backend.server} was built without CUDA: CPU only "
                                                  f"(build one with `orchestrator build --cuda`)"))
        gpus = []
    fa = _flash_attn(req, has_gpu)
    ctx = replace(ctx, node_req=node_req, fa=fa)
    kv_layer = kv_layers(model, req, ctx.flavor, fa=fa)
    mode, mode_why = _split_mode(req, backend, model, len(gpus), fa)
    if gpus:
        side = _gpu_side(ctx, gpus, kv_layer, mode, mode_why, decisions)
    else:
        side = _cpu_side(ctx, kv_layer, decisions)
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
        [i for i in placement.cpu_expert_layers if costs.layer_experts[i] > 0],
        weights_only=bool(side.cache.cache_mib and host_layer_side_bytes(costs))) if gpus else ()
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
        expert_cache_mib=side.cache.cache_mib, expert_cache_max_batch=side.cache.max_batch,
        expert_cache_cpu_misses=side.cache.cpu_misses, expert_cache_prefetch=side.cache.prefetch,
        expert_cache_slots="device" if side.cache.slot_assignment == "device" else None,
        expert_cache_stage_buffers=side.cache.stage_buffers,
        expert_cache_stage_min_batch=side.cache.stage_min_batch,
        numa=cpu.numa, numa_flag=cpu.numa_flag,
        disable_numa_balancing=req.disable_numa_balancing and len(machine.numa_nodes) > 1,
        threads=cpu.threads, threads_batch=cpu.threads_batch, n_batch=ctx.n_batch(side.ubatch),
        n_ubatch=side.ubatch,
        flash_attn=fa, type_k=req.type_k, type_v=req.type_v, extra_args=req.extra_args,
    )
    return WorkerPlan(
        name=name, node=node_req.name, settings=settings, backend=backend,
        placement=_ranges(placement, model.n_layers, list(side.gpu_names)), memory=memory,
        predicted=side.predicted, decisions=tuple(decisions),
        cpu_expert_layers=tuple(i for i in placement.cpu_expert_layers if costs.layer_experts[i] > 0),
        expert_cache=side.cache.plan,
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
    # without a measured profile: the stated default for the model's family and shape (expert count, top-k)
    curve = routing or default_curve(model.n_expert, model.n_expert_used, model.arch)
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
               backend: BackendInfo, curve: HitCurve) -> Plan:
    costs = model_costs(model)
    if costs.n_expert and costs.n_expert_used > costs.n_expert:
        raise PlanError(f"{model.paths[0]}: expert_used_count {costs.n_expert_used} > expert_count {costs.n_expert}")
    if request.context <= 0 or request.parallel <= 0:
        raise PlanError("model.context and model.parallel must be positive")
    if request.context > model.n_ctx_train > 0:
        warn = (f"model.context {request.context} exceeds the model's training context {model.n_ctx_train}")
    else:
        warn = None
    kv_total = sum(kv_layers(model, request, backend.flavor))
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
            ctx = PlanningContext(machine=machine, model=model, costs=costs, req=request, node_req=node_req,
                              backend=backend, curve=curve, package=pkg, share=share)
            workers.append(plan_worker(ctx, name=name, gpu_indexes=gidx, port=port))
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
