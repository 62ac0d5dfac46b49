"""The expert cache of one GPU worker, decided in one pure step: whether to have one, its size, which expert layers
leave VRAM for it, where its slots are assigned, whether prompts stage their experts, and each GPU's banks.

:func:`decide_expert_cache` takes one candidate of the worker (a placement and its predictions) and a small
:class:`CacheContext`, and returns one :class:`CacheDecision`. Its steps, in order:

1. :func:`why_no_cache`: the topology, the placement or the split mode rules a cache out;
2. :func:`weigh_inputs`: what the split weighs (the bytes left for routed experts, the rates they run at, the room
   in host memory for layers that move out and, with several GPUs, the splits each GPU's room allows:
   :func:`layer_split_cache_splits`), and :func:`orchestrator.plan.expert_cache.plan_expert_cache` weighs them;
3. :func:`host_layers_for`: the layers whose experts the chosen split leaves in host memory, and what our patch
   allocates for them (:func:`orchestrator.model.memory.expert_cache_size`);
4. :func:`place_for_cache`: the worker placed again where layers moved to host memory, its prompts read from the
   slots;
5. :func:`prompt_staging`: whether prompts copy their uncached experts ahead, out of the cache's MiB;
6. :func:`cache_banks` and :func:`with_cache_speed`: each GPU's banks and what every device reads per token.

The pure split between whole expert layers and cache slots, and its prediction, is
:mod:`orchestrator.plan.expert_cache`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Mapping

from orchestrator.backend import devices as D
from orchestrator.hardware.topology import Gpu
from orchestrator.model.memory import (EXPERT_CACHE_MAX_BATCH, ExpertCacheSize, expert_cache_bank_bytes,
                                       expert_cache_size, expert_cache_stage_bytes)
from orchestrator.plan import expert_cache as X
from orchestrator.plan import rates as R
from orchestrator.plan.candidates import Candidate, evaluate, kv_layers, offload_threshold
from orchestrator.plan.planning_context import PlanningContext
from orchestrator.plan.costs import ModelCosts
from orchestrator.plan.cpu import CpuChoice, node_available
from orchestrator.plan.placement import Placement, layer_split_placement
from orchestrator.plan.predict import PromptCache, predict_pp, predict_tg, prefill_stageable, staging_min_batch
from orchestrator.plan.request import PlanRequest
from orchestrator.plan.types import Decision
from orchestrator.units import GiB, MiB


@dataclass(frozen=True)
class CacheContext:
    """What the expert-cache decision of one GPU worker reads beside its candidate: the planning context, the
    worker's GPUs, how its host-resident weights are loaded, its NUMA and thread choice, and its split mode."""

    plan: PlanningContext
    gpus: tuple[Gpu, ...]
    load_mode: str
    cpu: CpuChoice
    split_mode: str


@dataclass(frozen=True)
class CacheDecision:
    """The expert cache of one worker as decided. ``candidate``: the worker's candidate to run (placed again where
    layers moved to the cache, its predictions with the cache); ``plan``: the split weighed, whose arithmetic the
    plan prints (None: a cache was not considered); ``decision``: the plan's "expert cache" line, its reason
    followed by the notes of the steps (None: nothing to say). The rest is what the worker runs with."""

    candidate: Candidate | None = None
    plan: X.CachePlan | None = None
    decision: Decision | None = None
    bank_bytes: tuple[int, ...] = ()  # per GPU of the worker: VRAM of its banks (and the staging buffers on the first)
    cache_mib: int = 0                # --moe-cache-mib (0: no cache)
    max_batch: int | None = None      # --moe-cache-max-batch (None: the server's default)
    cpu_misses: bool = False          # misses computed on the CPU where they lie (--moe-cache-cpu-misses)
    prefetch: bool = False            # uploads ahead of need (--moe-cache-prefetch)
    slot_assignment: str = "host"     # where the slots are assigned: "device" or "host" (--moe-cache-slots)
    stage_buffers: int = 0            # prompts' staging buffers (--moe-cache-prefill-ahead; 0: not staged)
    stage_min_batch: int = 0          # micro-batches staged from this many tokens (0: the patch's rule)


NO_CACHE = CacheDecision()


def decide_expert_cache(cc: CacheContext, best: Candidate) -> CacheDecision:
    """Split the VRAM the placement gives routed experts between whole expert layers and the expert cache
    (``--moe-cache-mib``, when the backend has it and some expert layers stay in host memory), with everything the
    worker then runs with (see the module docstring for the steps)."""
    costs = cc.plan.costs
    host = tuple(i for i in best.placement.cpu_expert_layers if costs.layer_experts[i])
    if not host or not costs.n_expert or not cc.plan.backend.has("expert_cache"):
        return CacheDecision(candidate=best)
    off = why_no_cache(cc, best)
    if off is not None:
        return CacheDecision(candidate=best, decision=Decision("expert cache", "off", off))
    weighed = weigh_inputs(cc, best, host)
    cplan = X.plan_expert_cache(weighed.inputs, cc.plan.req.objective, cache_bytes=cc.plan.req.expert_cache_bytes,
                                splits=weighed.splits)
    notes = cache_notes(cc)
    if not cplan.use_cache:
        return _decided(cc, best, cplan, Decision("expert cache", "off", cplan.reason + notes))
    c = cplan.chosen
    new_host = host_layers_for(cc, weighed, c)
    # every busy slot adds a token to a generation batch: the cache must serve batches of that many
    size = expert_cache_size(cc.plan.model, new_host, c.cache_mib, max_batch=cache_max_batch(cc.plan.req))
    if not size.active:
        return _decided(cc, best, cplan, Decision("expert cache", "off", f"{c.cache_mib} MiB holds less than one "
                                                  f"token's experts per layer" + notes))
    cand = place_for_cache(cc, best, host, new_host, size)
    staged = prompt_staging(cc, cand, c, weighed.inputs, new_host, size)
    if staged is not None:
        c, size, cand = staged.chosen, staged.size, replace(cand, pp=staged.pp)
        cplan, notes = replace(cplan, chosen=c), notes + staged.note
    banks = cache_banks(cc, cand.placement, new_host, size)
    if len(cc.gpus) > 1:
        cplan = replace(cplan, per_gpu=cache_shares(costs, cand.placement, new_host, size.slots, c, banks))
    cand = with_cache_speed(cand, cplan, weighed.per_token)
    return _decided(cc, cand, cplan, Decision("expert cache", f"{c.cache_mib} MiB", cplan.reason + notes), banks)


def _decided(cc: CacheContext, cand: Candidate, cplan: X.CachePlan, decision: Decision,
             banks: tuple[int, ...] = ()) -> CacheDecision:
    """The decision with what the worker runs with: the chosen split's options wherever the plan uses a cache."""
    c, req = cplan.chosen, cc.plan.req
    mib = c.cache_mib if cplan.use_cache else 0
    return CacheDecision(
        candidate=cand, plan=cplan, decision=decision, bank_bytes=banks, cache_mib=mib,
        max_batch=cache_max_batch(req) if mib and req.parallel > EXPERT_CACHE_MAX_BATCH else None,
        cpu_misses=bool(mib and c.miss_mode == "cpu"), prefetch=bool(mib and c.prefetch),
        slot_assignment="device" if mib and c.device_slots else "host",
        stage_buffers=c.stage_buffers if mib else 0, stage_min_batch=c.stage_min_batch if mib else 0)


def why_no_cache(cc: CacheContext, best: Candidate) -> str | None:
    """Why the worker has no cache whatever the split would say (the topology, the placement, the split mode), or
    None where the split decides."""
    req, gpus, mode = cc.plan.req, cc.gpus, cc.split_mode
    if req.expert_cache_bytes == 0:
        return "set by the topology"
    if best.placement.n_gpu_layers <= cc.plan.costs.n_layers:
        return "some layers' attention is in host memory: the cache serves layers computed on a GPU"
    if len(gpus) > 1 and mode != "layer":
        return f"-sm {mode} spreads every layer over all GPUs: the cache is planned for one GPU or -sm layer"
    if len(gpus) > 1 and req.expert_cache_bytes is not None:
        return ("a cache of a set size is planned for one-GPU workers; leave workers.expert_cache auto to split "
                "several GPUs")
    if req.expert_layers_on_cpu is not None and req.expert_cache_bytes is None:
        return "the expert placement is forced: set workers.expert_cache to a size to add a cache beside it"
    return None


def cache_notes(cc: CacheContext) -> str:
    """What the decision's line says after its reason: the hit-rate curve, and options asked for but not taken."""
    req, backend = cc.plan.req, cc.plan.backend
    notes = f"; hit-rate curve: {cc.plan.curve.source}"
    why_host = slots_on_device(cc.plan, cc.gpus, cc.load_mode)
    if req.expert_cache_slots == "device" and why_host:
        notes += f"; slots assigned on the host: {why_host}"
    if req.expert_cache_misses == "cpu" and not backend.has("expert_cache_cpu_misses"):
        notes += "; misses uploaded: this llama-server has no --moe-cache-cpu-misses"
    return notes


@dataclass(frozen=True)
class CacheWeighing:
    """What the split between whole expert layers and cache slots weighs for one worker."""

    inputs: X.CacheInputs
    moe: tuple[int, ...]             # the model's MoE layers
    host: tuple[int, ...]            # the layers whose experts the placement leaves in host memory
    per_token: float                 # one layer's routed-expert bytes a token reads
    splits: tuple[tuple[int, int], ...] | None = None    # several GPUs: the (whole layers, cache bytes) that fit
    split_hosts: Mapping[tuple[int, int], tuple[int, ...]] = field(default_factory=dict)  # and each one's host layers


def weigh_inputs(cc: CacheContext, best: Candidate, host: tuple[int, ...]) -> CacheWeighing:
    """The split's inputs at ``best``'s placement: the VRAM its routed experts may use (one GPU: what they have and
    what is left; several: each GPU's splits), the effective rates of the roofline, the host memory's room."""
    ctx, costs = cc.plan, cc.plan.costs
    moe = tuple(costs.moe_layers)
    layer_bytes = max(costs.layer_experts[i] for i in moe)
    on_gpu = sum(costs.layer_experts[i] for i in moe if i not in host)
    min_gpu_layers = _min_gpu_layers(cc, best, len(moe) - len(host), layer_bytes)
    per_token = layer_bytes * costs.n_expert_used / costs.n_expert
    splits, split_hosts = None, {}
    if len(cc.gpus) > 1:
        vram = on_gpu
        splits, split_hosts = layer_split_cache_splits(costs, best, list(moe), list(host), layer_bytes,
                                                       min_gpu_layers)
    elif ctx.req.expert_layers_on_cpu is not None:
        # the layers and the cache as set, and beside the cache what those layers keep on the GPU (their biases)
        vram = on_gpu + ctx.req.expert_cache_bytes + len(host) * host_layer_side_bytes(costs)
    else:
        vram = on_gpu + max(0, best.budgets[0].budget - best.placement.gpu_weights[0] - best.placement.gpu_kv[0])
    inputs = _cache_inputs(cc, best, host, layer_bytes, vram_free=vram, min_gpu_layers=min_gpu_layers)
    return CacheWeighing(inputs=inputs, moe=moe, host=host, per_token=per_token, splits=splits,
                         split_hosts=split_hosts)


def _min_gpu_layers(cc: CacheContext, best: Candidate, gpu_layers: int, layer_bytes: int) -> int:
    """The fewest whole expert layers the GPUs must keep: layers moved to the cache stay in host memory, read into
    it (unless memory-mapped), so they must fit beside what is there."""
    machine, p = cc.plan.machine, best.placement
    if cc.load_mode == "mmap":
        return 0
    avail = sum(node_available(machine, n) for n in machine.numa_nodes
                if not cc.cpu.host_nodes or n.id in cc.cpu.host_nodes) or (machine.memory_available_bytes or 0)
    if not avail:
        return 0
    room = avail - (cc.plan.node_req.ram_reserve or 0) - p.cpu_weights - p.cpu_kv - GiB
    return max(0, gpu_layers - max(0, room) // layer_bytes)


def _cache_inputs(cc: CacheContext, best: Candidate, host: tuple[int, ...], layer_bytes: int, *, vram_free: int,
                  min_gpu_layers: int) -> X.CacheInputs:
    """The split's inputs: the routed experts' shape, the VRAM they may use (whole layers and cache), the fewest
    whole layers host memory allows, and the rates at ``best``'s placement."""
    ctx, costs, req, backend, sp = cc.plan, cc.plan.costs, cc.plan.req, cc.plan.backend, best.speed
    gpu_bw = sp.gpu_mem_bw[0] * R.GPU_TG_EFFICIENCY
    host_bw = sp.host_bw * R.CPU_TG_EFFICIENCY
    pinned = sp.h2d_pinned or sp.h2d / R.PINNED_COPY_EFFICIENCY
    pcie = pinned * (R.PAGEABLE_FRACTION if cc.load_mode == "mmap" else R.CACHE_UPLOAD_EFFICIENCY)
    return X.CacheInputs(
        curve=ctx.curve, layer_expert_bytes=layer_bytes, n_expert=costs.n_expert, n_expert_used=costs.n_expert_used,
        n_moe_layers=len(costs.moe_layers), vram_free=vram_free, pcie_bw=pcie, host_bw=host_bw, gpu_bw=gpu_bw,
        base_seconds=_base_seconds(costs, best, host, gpu_bw, host_bw),
        cpu_misses=req.expert_cache_misses != "upload" and backend.has("expert_cache_cpu_misses"),
        upload_misses=req.expert_cache_misses != "cpu",
        host_layer_overhead_s=R.CROSS_DEVICE_LAYER_OVERHEAD_S,
        cache_layer_overhead_s=(R.CACHE_LAYER_OVERHEAD_HOST_S if backend.has("expert_cache_slots")
                                else R.CACHE_LAYER_OVERHEAD_S), cache_fixed_s=R.CACHE_FIXED_S,
        cpu_miss_hop_s=R.CACHE_CPU_MISS_HOP_S, cpu_miss_fixed_s=R.CACHE_CPU_MISS_FIXED_S,
        min_gpu_layers=min_gpu_layers, prefill_reads_cache=backend.has("expert_cache_slot_reads"),
        prefill_read_saving=R.PREFILL_READ_SAVING, prefill_read_overhead_s=R.PREFILL_READ_OVERHEAD_S,
        streams=req.parallel, stream_share_exponent=R.STREAM_SHARE_EXPONENT,
        prefetch=prefetch_mode(ctx), prefetch_miss_cut=tuple(R.PREFETCH_MISS_CUT.items()),
        prefetch_uploads=tuple(R.PREFETCH_UPLOADS_PER_MISS.items()),
        prefetch_overlap=tuple(R.PREFETCH_OVERLAP.items()),
        device_slots=slots_on_device(ctx, cc.gpus, cc.load_mode) is None,
        device_layer_overhead_s=R.CACHE_LAYER_OVERHEAD_DEVICE_S,
        host_layer_vram=host_layer_side_bytes(costs))


def host_layer_side_bytes(costs: ModelCosts) -> int:
    """VRAM that each host-resident layer the cache serves keeps on its GPU: its routed-expert tensors beside the
    MUL_MAT_IDs' weights (gpt-oss's biases). The plan keeps them there (``cpu_expert_override(weights_only=True)``):
    left in host memory, each of their ops ran on the CPU between the layer's GPU splits, three hops GPU -> CPU ->
    GPU per layer and token: on the H200 gpt-oss-120b generated 1.51x faster with them on the GPU
    (docs/benchmarks.md, W4)."""
    return max((costs.layer_expert_side_bytes[i] for i in costs.moe_layers), default=0) \
        if costs.layer_expert_side_bytes else 0


def _base_seconds(costs: ModelCosts, best: Candidate, host: tuple[int, ...], gpu_bw: float, host_bw: float) -> float:
    """What the roofline gives everything but the routed experts: the no-cache candidate at this placement then
    predicts exactly the plan's generation speed."""
    moe = costs.moe_layers
    per_token = max(costs.layer_experts[i] for i in moe) * costs.n_expert_used / costs.n_expert
    on_gpu = sum(costs.layer_experts[i] for i in moe if i not in host)
    t_experts = (on_gpu * costs.n_expert_used / costs.n_expert / gpu_bw
                 + len(host) * (per_token / host_bw + R.CROSS_DEVICE_LAYER_OVERHEAD_S))
    return max(0.0, 1.0 / best.tg - t_experts) if best.tg > 0 else 0.0


def host_layers_for(cc: CacheContext, weighed: CacheWeighing, chosen: X.CacheCandidate) -> tuple[int, ...]:
    """The layers whose experts the chosen split leaves in host memory (a forced placement keeps its own; one GPU:
    the first ones, as --n-cpu-moe would; several: each GPU's first ones)."""
    if cc.plan.req.expert_layers_on_cpu is not None:
        return tuple(weighed.host)
    if len(cc.gpus) > 1:
        return weighed.split_hosts[(chosen.gpu_layers, chosen.cache_bytes)]
    return tuple(weighed.moe[:chosen.host_layers])


def place_for_cache(cc: CacheContext, best: Candidate, host: tuple[int, ...], new_host: tuple[int, ...],
                    size: ExpertCacheSize) -> Candidate:
    """``best`` placed again where the split moves layers to host memory, with its prompt speed where big batches
    read the experts the slots hold from them (only the rest crosses PCIe)."""
    ctx = cc.plan
    cand = best
    if set(new_host) != set(host):
        kv_ub = kv_layers(ctx.model, ctx.req, ctx.flavor, ub=best.ubatch, fa=ctx.fa)
        if len(cc.gpus) > 1:
            cand = relayout(ctx.costs, kv_ub, best, new_host, ctx.req)
        else:
            cand = evaluate(replace(ctx, req=ctx.req.copy(expert_layers_on_cpu=new_host)), list(cc.gpus), kv_ub,
                            mode=cc.split_mode, ub=best.ubatch, load_mode=cc.load_mode, cpu=cc.cpu)
    if ctx.backend.has("expert_cache_slot_reads"):
        cand = replace(cand, pp=predict_pp(ctx.costs, cand.placement, cand.speed, cand.ubatch, cand.threshold,
                                           cache=PromptCache(size.slots / ctx.costs.n_expert)))
    return cand


def cache_banks(cc: CacheContext, placement: Placement, host: tuple[int, ...], size: ExpertCacheSize
                ) -> tuple[int, ...]:
    """What our patch allocates on each GPU: every bank the same slot count (cache MiB, less the prompts' staging
    buffers, / one expert of every host-resident expert tensor), each on the GPU that runs its layer; the staging
    buffers on the first."""
    return tuple(expert_cache_bank_bytes(cc.plan.model, [i for i in host if placement.layer_gpu[i] == g],
                                      size.slots, size.batch_cap) + (size.stage_bytes if g == 0 else 0)
                 for g in range(len(cc.gpus)))


def with_cache_speed(cand: Candidate, cplan: X.CachePlan, per_token: float) -> Candidate:
    """``cand`` with the chosen cache's generation speed and the bytes each device reads per token: each GPU its
    banks' hits and the misses copied in, host memory less the layers the cache serves, PCIe the misses."""
    c = cplan.chosen
    tg_bytes = dict(cand.tg_bytes)
    if cplan.per_gpu:
        for share in cplan.per_gpu:
            tg_bytes[share.device] = int(tg_bytes.get(share.device, 0) + share.hit_bytes + share.pcie_bytes)
    else:
        gpu0 = next(iter(k for k in tg_bytes if D.is_gpu(k)), D.gpu(0))
        tg_bytes[gpu0] = int(tg_bytes.get(gpu0, 0) + c.cache_hit_bytes + c.pcie_bytes)
    tg_bytes["CPU"] = max(0, int(tg_bytes.get("CPU", 0) - c.host_layers * per_token))
    tg_bytes["PCIe"] = int(c.pcie_bytes)
    return replace(cand, tg=c.tokens_per_s, tg_bytes=tg_bytes, tg_streams=c.stream_tokens_per_s)


@dataclass(frozen=True)
class Staging:
    """Prompts' staging as decided: the cache candidate (with fewer slots where prompts are staged), what the patch
    allocates for it, the prompt prediction, and the note the decision's line carries."""

    chosen: X.CacheCandidate
    size: ExpertCacheSize
    pp: Mapping[int, float]
    note: str


def prompt_staging(cc: CacheContext, cand: Candidate, c: X.CacheCandidate, inp: X.CacheInputs,
                   host: tuple[int, ...], size: ExpertCacheSize) -> Staging | None:
    """Whether prompts through op offload copy their uncached experts ahead into staging buffers
    (``--moe-cache-prefill-ahead``): the buffers come out of the cache's MiB, so generation has fewer slots, and
    prompts hide part of their copies behind the layers before. None where the plan keeps it off without a word;
    else the staging, with why it is off in its note where the topology asked for it or the gain is too small."""
    req, backend = cc.plan.req, cc.plan.backend
    if req.expert_cache_staging == "off" or not backend.has("expert_cache_staging") or \
            not backend.has("expert_cache_slot_reads"):
        return None
    # where the model's routing was measured, micro-batches too small to use nearly every expert under it are left
    # unstaged (--moe-cache-prefill-ahead-min-batch); a server without the option stages by the uniform rule
    min_batch = (staging_min_batch(cc.plan.costs.n_expert, cc.plan.costs.n_expert_used, cc.plan.curve.distinct)
                 if backend.has("expert_cache_stage_min_batch") else 0)
    why = why_not_staged(cc, cand, min_batch)
    buffers = R.PREFILL_STAGE_BUFFERS
    if why is None:
        stage = expert_cache_stage_bytes(cc.plan.model, host, buffers)
        size_s = expert_cache_size(cc.plan.model, host, c.cache_mib, max_batch=cache_max_batch(req),
                                   stage_bytes=stage)
        if not size_s.stage_bytes or not size_s.active:
            why = f"{c.cache_mib} MiB would keep too few slots beside {buffers} staging buffers"
    if why is not None:
        return (None if req.expert_cache_staging == "auto"
                else Staging(c, size, cand.pp, f"; prompts not staged: {why}"))
    staged = _staged_candidate(inp, c, size_s, buffers, min_batch)
    pp_s = predict_pp(cc.plan.costs, cand.placement, cand.speed, cand.ubatch, cand.threshold,
                      cache=PromptCache(size_s.slots / cc.plan.costs.n_expert, staged=True, stage_min_batch=min_batch))
    return _staging_worth(req, Staging(c, size, cand.pp, ""), Staging(staged, size_s, pp_s, ""), buffers)


def why_not_staged(cc: CacheContext, cand: Candidate, min_batch: int) -> str | None:
    """Why prompts cannot be staged on this worker (None: they can)."""
    costs = cc.plan.costs
    if not cc.plan.backend.cuda:
        return "the staging stream and its events are CUDA's"
    if len(cc.gpus) != 1:
        return "planned for one GPU per worker"
    if cc.load_mode == "mmap":
        return "memory-mapped weights are not pinned: their copies would not run beside the compute"
    if cand.threshold is None or cand.threshold > cand.ubatch:
        return f"a {cand.ubatch}-token micro-batch is not offloaded"
    if not prefill_stageable(costs.n_expert, costs.n_expert_used, cand.ubatch, min_batch):
        return (f"a {cand.ubatch}-token micro-batch uses too few of the {costs.n_expert} experts to copy them "
                f"before its picks are known" + (f" (the measured routing needs {min_batch} tokens)"
                                                  if cand.ubatch < min_batch else ""))
    return None


def _staged_candidate(inp: X.CacheInputs, c: X.CacheCandidate, size_s: ExpertCacheSize, buffers: int,
                      min_batch: int) -> X.CacheCandidate:
    """``c`` with prompts staged: generation as measured with the buffers, as if they took PREFILL_STAGE_SLOT_COST
    of their bytes from the slots; the banks, the VRAM and the prompts' share read from the slots are those of the
    slots really left."""
    real = X._candidate(inp, c.gpu_layers, c.cache_bytes - size_s.stage_bytes, c.miss_mode)
    gen = X._candidate(inp, c.gpu_layers, c.cache_bytes - int(R.PREFILL_STAGE_SLOT_COST * size_s.stage_bytes),
                       c.miss_mode)
    return replace(gen, cache_bytes=c.cache_bytes, slots=real.slots, slots_per_layer=real.slots_per_layer,
                   fraction=real.fraction, slot_bytes=real.slot_bytes, stage_buffers=buffers,
                   stage_bytes=size_s.stage_bytes, stage_min_batch=min_batch)


def _staging_worth(req: PlanRequest, plain: Staging, staged: Staging, buffers: int) -> Staging:
    """Staged where the topology says on, or where the objective gains by it; the note says which and why."""
    pp, pp_s, c = plain.pp, staged.pp, plain.chosen
    n = 512 if 512 in pp else max(pp)
    tg_ratio = staged.chosen.generation / c.generation if c.generation else 1.0
    pp_ratio = pp_s[n] / pp[n] if pp.get(n) else 1.0
    gain = (f"predicted pp{n} {pp_ratio:.2f}x, generation {tg_ratio:.2f}x of the same cache without them")
    take = {"generation": tg_ratio >= 1.0 - X.GENERATION_TOLERANCE and pp_ratio > 1.0 + X.MIN_GAIN,
            "prompt": pp_ratio > 1.0 + X.MIN_GAIN,
            "balanced": (tg_ratio * pp_ratio) ** 0.5 > 1.0 + X.MIN_GAIN}[req.objective]
    if req.expert_cache_staging == "on" or take:
        min_batch, size_s = staged.chosen.stage_min_batch, staged.size
        return replace(staged, note=f"; prompts staged: {buffers} buffers of "
                       f"{size_s.stage_bytes / buffers / MiB:.1f} MiB copy their uncached experts ahead ({gain})"
                       + (f", micro-batches from {min_batch} tokens, where the measured routing uses all but "
                          f"{R.PREFILL_STAGE_UNUSED_MAX:.0%} of the experts" if min_batch else ""))
    return replace(plain, note=f"; prompts not staged: {gain}, not worth the slots for objective {req.objective}")


def cache_shares(costs: ModelCosts, placement: Placement, host: tuple[int, ...], slots: int,
                  chosen: X.CacheCandidate, banks: tuple[int, ...]) -> tuple[X.GpuCacheShare, ...]:
    """Each GPU's banks and what they serve per token: its host-resident layers' picks, the chosen hit rate."""
    pick = costs.n_expert_used * max(costs.layer_experts[i] for i in costs.moe_layers) / costs.n_expert
    out = []
    for g, bank in enumerate(banks):
        mine = [i for i in costs.moe_layers if placement.layer_gpu[i] == g]
        h = sum(1 for i in mine if i in host)
        picks = h * pick
        out.append(X.GpuCacheShare(D.gpu(g), len(mine) - h, h, slots if h else 0, bank, chosen.hit_rate,
                                   chosen.hit_rate * picks, (1.0 - chosen.hit_rate) * picks))
    return tuple(out)


def prefetch_mode(ctx: PlanningContext) -> str:
    """Uploads ahead of need as the plan weighs them: "off" where the backend or the model's architecture has
    none (or the topology says off), else the topology's auto or on."""
    if ctx.req.expert_cache_prefetch == "off" or not ctx.backend.has("expert_cache_prefetch") or \
            ctx.costs.arch not in R.PREFETCH_ARCHS:
        return "off"
    return ctx.req.expert_cache_prefetch


def slots_on_device(ctx: PlanningContext, gpus: list[Gpu], load_mode: str) -> str | None:
    """None where the worker's slots can be assigned on the GPU (``--moe-cache-slots device``), else why not. The
    device kernels read the misses from the weights' host memory, so it must be pinned (not memory-mapped); the
    CUDA backend exports them; one GPU per worker is what was measured (several keep the host's assignment)."""
    if ctx.req.expert_cache_slots == "host":
        return "set by the topology"
    if not ctx.backend.has("expert_cache_slots"):
        return "this llama-server has no --moe-cache-slots"
    if not ctx.backend.cuda:
        return "the device assignment is CUDA's"
    if len(gpus) != 1:
        return "planned for one GPU per worker"
    if load_mode == "mmap":
        return "memory-mapped weights are not pinned"
    return None


def cache_max_batch(req: PlanRequest) -> int:
    return max(EXPERT_CACHE_MAX_BATCH, req.parallel)


def layer_split_cache_splits(costs: ModelCosts, best: Candidate, moe: list[int], host: list[int],
                              layer_bytes: int, min_gpu_layers: int):
    """With ``-sm layer`` every GPU holds the banks of its own layers, all with the same slot count: for each
    slot count, the most whole layers each GPU keeps beside the banks of its host-resident layers (never more
    than the placement gave it). Returns the (whole layers, cache bytes) pairs and, for each, the host-resident
    layers (each GPU's first ones, as --n-cpu-moe would)."""
    p = best.placement
    expert = layer_bytes / costs.n_expert
    side = host_layer_side_bytes(costs)
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
            # k layers whole + banks of s experts and what stays on the GPU (v) for the other n - k:
            # k L + (s e + v) (n - k) <= room
            free = room[g] - (s * expert + side) * n
            if free < 0:
                keep = -1
                break
            k = n if layer_bytes <= s * expert + side else int(free // (layer_bytes - s * expert - side))
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


def relayout(costs: ModelCosts, kv_layer: list[int], best: Candidate, cpu_layers: tuple[int, ...],
             req: PlanRequest) -> Candidate:
    """The plan's -sm layer ranges with the experts of ``cpu_layers`` in host memory: threshold, prompt speed and
    bytes per token again (the generation speed is then the cache's prediction)."""
    counts = list(best.placement.tensor_split)
    counts[-1] -= 1                                   # the output layer
    placement = layer_split_placement(costs, kv_layer, counts, cpu_layers)
    threshold, why = offload_threshold(req, costs, placement, best.speed, best.ubatch)
    pp = predict_pp(costs, placement, best.speed, best.ubatch, threshold)
    # the bytes each device reads per token follow the layers moved (the speed itself is the cache's prediction)
    tg, tg_bytes = predict_tg(costs, placement, best.speed, 0.0)
    return replace(best, placement=placement, threshold=threshold, threshold_why=why, pp=pp, tg=tg,
                   tg_bytes=tg_bytes)
