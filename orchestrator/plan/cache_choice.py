"""The expert cache of one GPU worker: whether to have one, its size, and which expert layers leave VRAM for it.

The pure split between whole expert layers and cache slots, and its prediction, is :mod:`orchestrator.plan.expert_cache`;
this module feeds it one worker's placement (the bytes left for routed experts, the rates it runs at, the room in
host memory), places the worker again when layers move to host memory for the cache, and says what it chose.
"""

from __future__ import annotations

from dataclasses import replace

from orchestrator.backend import devices as D
from orchestrator.hardware.topology import Gpu
from orchestrator.model.memory import (MOE_CACHE_MAX_BATCH, moe_cache_bank_bytes, moe_cache_size,
                                       moe_cache_stage_bytes)
from orchestrator.plan import expert_cache as X
from orchestrator.plan import rates as R
from orchestrator.plan.candidates import Candidate, evaluate, kv_layers, offload_threshold
from orchestrator.plan.context import PlanContext
from orchestrator.plan.costs import ModelCosts
from orchestrator.plan.cpu import CpuChoice, node_available
from orchestrator.plan.placement import Placement, layer_split_placement
from orchestrator.plan.predict import PromptCache, predict_pp, predict_tg, prefill_stageable, staging_min_batch
from orchestrator.plan.request import PlanRequest
from orchestrator.plan.types import Decision
from orchestrator.units import GiB, MiB


def worker_cache(ctx: PlanContext, gpus: list[Gpu], best: Candidate, *, load_mode: str, cpu: CpuChoice,
                 mode: str):
    """Split the VRAM the placement gives routed experts between whole expert layers and the expert cache
    (``--moe-cache-mib``, when the backend has it and some expert layers stay in host memory). Returns
    (the cache plan or None, its decision or None, the candidate to run -- re-placed when layers moved to the
    cache -- and the cache's size in VRAM or None)."""
    model, costs, req, backend, node_req, machine, curve = (ctx.model, ctx.costs, ctx.req, ctx.backend,
                                                             ctx.node_req, ctx.machine, ctx.curve)
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
                        cache_layer_overhead_s=(R.CACHE_LAYER_OVERHEAD_HOST_S if backend.has("moe_cache_slots")
                                                else R.CACHE_LAYER_OVERHEAD_S), cache_fixed_s=R.CACHE_FIXED_S,
                        cpu_miss_hop_s=R.CACHE_CPU_MISS_HOP_S, cpu_miss_fixed_s=R.CACHE_CPU_MISS_FIXED_S,
                        min_gpu_layers=min_gpu_layers, prefill_reads_cache=backend.has("moe_cache_prefill"),
                        prefill_read_saving=R.PREFILL_READ_SAVING, prefill_read_overhead_s=R.PREFILL_READ_OVERHEAD_S,
                        streams=req.parallel, stream_share_exponent=R.STREAM_SHARE_EXPONENT,
                        prefetch=prefetch_mode(ctx), prefetch_miss_cut=tuple(R.PREFETCH_MISS_CUT.items()),
                        prefetch_uploads=tuple(R.PREFETCH_UPLOADS_PER_MISS.items()),
                        prefetch_overlap=tuple(R.PREFETCH_OVERLAP.items()),
                        device_slots=slots_on_device(ctx, gpus, load_mode) is None,
                        device_layer_overhead_s=R.CACHE_LAYER_OVERHEAD_DEVICE_S)
    splits, per_gpu_host = None, {}
    if len(gpus) > 1:
        splits, per_gpu_host = layer_split_cache_splits(costs, best, moe, host, layer_bytes, min_gpu_layers)
        inp = replace(inp, vram_free=on_gpu)
    cplan = X.plan_expert_cache(inp, req.objective, cache_bytes=size_req, splits=splits)
    curve_note = f"; hit-rate curve: {curve.source}"
    why_host = slots_on_device(ctx, gpus, load_mode)
    if req.expert_cache_slots == "device" and why_host:
        curve_note += f"; slots assigned on the host: {why_host}"
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
    size = moe_cache_size(model, new_host, c.cache_mib, max_batch=cache_max_batch(req))
    if not size.active:
        return cplan, Decision("expert cache", "off", f"{c.cache_mib} MiB holds less than one token's experts "
                                                      f"per layer" + curve_note), best, None
    cand = best
    if set(new_host) != set(host):
        kv_ub = kv_layers(model, req, ctx.flavor, ub=best.ubatch, fa=ctx.fa)
        if len(gpus) > 1:
            cand = relayout(costs, kv_ub, best, new_host, req)
        else:
            cand = evaluate(replace(ctx, req=req.copy(expert_layers_on_cpu=new_host)), gpus, kv_ub, mode=mode,
                            ub=best.ubatch, load_mode=load_mode, cpu=cpu)
    pp = cand.pp
    if backend.has("moe_cache_prefill"):
        # big batches read the experts the slots hold from them: only the rest crosses PCIe
        pp = predict_pp(costs, cand.placement, cand.speed, cand.ubatch, cand.threshold,
                        cache=PromptCache(size.slots / costs.n_expert))
    staged = prompt_staging(ctx, gpus, load_mode, cand, c, new_host, inp, size, pp)
    stage_note = ""
    if staged is not None:
        c, size, pp, stage_note = staged
        cplan = replace(cplan, chosen=c)
    # what our patch allocates: every bank the same slot count (cache MiB, less the prompts' staging buffers, / one
    # expert of every host-resident expert tensor), each on the GPU that runs its layer; the buffers on the first
    banks = tuple(moe_cache_bank_bytes(model, [i for i in new_host if cand.placement.layer_gpu[i] == g],
                                       size.slots, size.batch_cap) + (size.stage_bytes if g == 0 else 0)
                  for g in range(len(gpus)))
    tg_bytes = dict(cand.tg_bytes)
    if len(gpus) > 1:
        cplan = replace(cplan, per_gpu=cache_shares(costs, cand.placement, new_host, size.slots, c, banks))
        for share in cplan.per_gpu:         # each GPU reads its own banks (hits and the misses copied in)
            tg_bytes[share.device] = int(tg_bytes.get(share.device, 0) + share.hit_bytes + share.pcie_bytes)
    else:
        gpu0 = next(iter(k for k in tg_bytes if D.is_gpu(k)), D.gpu(0))
        tg_bytes[gpu0] = int(tg_bytes.get(gpu0, 0) + c.cache_hit_bytes + c.pcie_bytes)
    tg_bytes["CPU"] = max(0, int(tg_bytes.get("CPU", 0) - c.host_layers * per_token))
    tg_bytes["PCIe"] = int(c.pcie_bytes)
    cand = replace(cand, tg=c.tokens_per_s, tg_bytes=tg_bytes, pp=pp, tg_streams=c.stream_tokens_per_s)
    return (cplan, Decision("expert cache", f"{c.cache_mib} MiB", cplan.reason + curve_note + stage_note), cand,
            banks)


def prompt_staging(ctx: PlanContext, gpus: list[Gpu], load_mode: str, cand: Candidate, c: X.CacheCandidate,
                   host: tuple[int, ...], inp: X.CacheInputs, size, pp: dict[int, float]):
    """Whether prompts through op offload copy their uncached experts ahead into staging buffers
    (``--moe-cache-prefill-ahead``): the buffers come out of the cache's MiB, so generation has fewer slots, and
    prompts hide part of their copies behind the layers before. Returns None where the plan keeps it off
    (with why in the note of a returned tuple where the topology asked for it or a reason is worth saying), else
    (the cache candidate with the fewer slots, its size, the prompt prediction, the note for the decision)."""
    req, backend, costs, model = ctx.req, ctx.backend, ctx.costs, ctx.model
    if req.expert_cache_staging == "off" or not backend.has("moe_cache_prefill_ahead") or \
            not backend.has("moe_cache_prefill"):
        return None
    why = None
    # where the model's routing was measured, micro-batches too small to use nearly every expert under it are left
    # unstaged (--moe-cache-prefill-ahead-min-batch); a server without the option stages by the uniform rule
    min_batch = (staging_min_batch(costs.n_expert, costs.n_expert_used, ctx.curve.distinct)
                 if backend.has("moe_cache_prefill_ahead_min_batch") else 0)
    if not backend.cuda:
        why = "the staging stream and its events are CUDA's"
    elif len(gpus) != 1:
        why = "planned for one GPU per worker"
    elif load_mode == "mmap":
        why = "memory-mapped weights are not pinned: their copies would not run beside the compute"
    elif cand.threshold is None or cand.threshold > cand.ubatch:
        why = f"a {cand.ubatch}-token micro-batch is not offloaded"
    elif not prefill_stageable(costs.n_expert, costs.n_expert_used, cand.ubatch, min_batch):
        why = (f"a {cand.ubatch}-token micro-batch uses too few of the {costs.n_expert} experts to copy them "
               f"before its picks are known" + (f" (the measured routing needs {min_batch} tokens)"
                                                 if cand.ubatch < min_batch else ""))
    buffers = R.PREFILL_STAGE_BUFFERS
    stage = moe_cache_stage_bytes(model, host, buffers)
    size_s = None
    if why is None:
        size_s = moe_cache_size(model, host, c.cache_mib, max_batch=cache_max_batch(req), stage_bytes=stage)
        if not size_s.stage_bytes or not size_s.active:
            why = f"{c.cache_mib} MiB would keep too few slots beside {buffers} staging buffers"
    if why is not None:
        return None if req.expert_cache_staging == "auto" else (c, size, pp, f"; prompts not staged: {why}")
    # generation as measured with the buffers: as if they took PREFILL_STAGE_SLOT_COST of their bytes from the
    # slots; the banks, the VRAM and the prompts' share read from the slots are those of the slots really left
    real = X._candidate(inp, c.gpu_layers, c.cache_bytes - size_s.stage_bytes, c.miss_mode)
    gen = X._candidate(inp, c.gpu_layers, c.cache_bytes - int(R.PREFILL_STAGE_SLOT_COST * size_s.stage_bytes),
                       c.miss_mode)
    staged = replace(gen, cache_bytes=c.cache_bytes, slots=real.slots, slots_per_layer=real.slots_per_layer,
                     fraction=real.fraction, slot_bytes=real.slot_bytes, stage_buffers=buffers,
                     stage_bytes=size_s.stage_bytes, stage_min_batch=min_batch)
    pp_s = predict_pp(costs, cand.placement, cand.speed, cand.ubatch, cand.threshold,
                      cache=PromptCache(size_s.slots / costs.n_expert, staged=True, stage_min_batch=min_batch))
    n = 512 if 512 in pp else max(pp)
    tg_ratio = staged.generation / c.generation if c.generation else 1.0
    pp_ratio = pp_s[n] / pp[n] if pp.get(n) else 1.0
    gain = (f"predicted pp{n} {pp_ratio:.2f}x, generation {tg_ratio:.2f}x of the same cache without them")
    take = {"generation": tg_ratio >= 1.0 - X.GENERATION_TOLERANCE and pp_ratio > 1.0 + X.MIN_GAIN,
            "prompt": pp_ratio > 1.0 + X.MIN_GAIN,
            "balanced": (tg_ratio * pp_ratio) ** 0.5 > 1.0 + X.MIN_GAIN}[req.objective]
    if req.expert_cache_staging == "on" or take:
        return (staged, size_s, pp_s, f"; prompts staged: {buffers} buffers of "
                f"{size_s.stage_bytes / buffers / MiB:.1f} MiB copy their uncached experts ahead ({gain})"
                + (f", micro-batches from {min_batch} tokens, where the measured routing uses all but "
                   f"{R.PREFILL_STAGE_UNUSED_MAX:.0%} of the experts" if min_batch else ""))
    return c, size, pp, f"; prompts not staged: {gain}, not worth the slots for objective {req.objective}"


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


def prefetch_mode(ctx: PlanContext) -> str:
    """Uploads ahead of need as the plan weighs them: "off" where the backend or the model's architecture has
    none (or the topology says off), else the topology's auto or on."""
    if ctx.req.expert_cache_prefetch == "off" or not ctx.backend.has("moe_cache_prefetch") or \
            ctx.costs.arch not in R.PREFETCH_ARCHS:
        return "off"
    return ctx.req.expert_cache_prefetch


def slots_on_device(ctx: PlanContext, gpus: list[Gpu], load_mode: str) -> str | None:
    """None where the worker's slots can be assigned on the GPU (``--moe-cache-slots device``), else why not. The
    device kernels read the misses from the weights' host memory, so it must be pinned (not memory-mapped); the
    CUDA backend exports them; one GPU per worker is what was measured (several keep the host's assignment)."""
    if ctx.req.expert_cache_slots == "host":
        return "set by the topology"
    if not ctx.backend.has("moe_cache_slots"):
        return "this llama-server has no --moe-cache-slots"
    if not ctx.backend.cuda:
        return "the device assignment is CUDA's"
    if len(gpus) != 1:
        return "planned for one GPU per worker"
    if load_mode == "mmap":
        return "memory-mapped weights are not pinned"
    return None


def cache_max_batch(req: PlanRequest) -> int:
    return max(MOE_CACHE_MAX_BATCH, req.parallel)


def layer_split_cache_splits(costs: ModelCosts, best: Candidate, moe: list[int], host: list[int],
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
