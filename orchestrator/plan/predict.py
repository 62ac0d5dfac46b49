"""Roofline speed prediction and the op-offload threshold.

Generation is memory-bound: time per token = bytes each device reads per token / its bandwidth (times an
efficiency llama.cpp reaches), plus a fixed cost per layer. Prompt processing is done in micro-batches: the
GPU part is compute-bound; CPU-resident experts are either computed on the CPU (memory- or compute-bound) or,
for batches of at least ``GGML_OP_OFFLOAD_MIN_BATCH`` tokens, copied to the GPU over PCIe (only the experts the
batch uses are copied). The threshold is the smallest batch from which copying wins.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from orchestrator.backend import devices as D
from orchestrator.plan import rates as R
from orchestrator.plan.costs import ModelCosts
from orchestrator.plan.placement import Placement

PP_LENGTHS = (8, 32, 64, 128, 512, 4096)


@dataclass(frozen=True)
class SpeedInputs:
    """Rates for one worker (bytes/s, FLOP/s)."""

    gpu_mem_bw: tuple[float, ...]       # per worker GPU
    gpu_flops: tuple[float, ...]
    h2d: float                          # host->device for CPU-resident weights as loaded (pinned or pageable)
    host_bw: float                      # host memory read bandwidth available to the worker's threads
    cpu_flops: float                    # whole worker (threads x per-core)
    h2d_pinned: float = 0.0             # host->device from pinned buffers, as measured (0: unknown)
    threads: int = 1                    # the worker's threads (prompts: -tb)
    cpu_rate: float = 0.0               # this machine's CPU prompt speed against the reference (probe; rates.py);
                                        # 0: not measured (the per-core table's guess stands)


def experts_used(n_expert: int, k: int, batch: int) -> float:
    """Expected distinct experts a batch of ``batch`` tokens touches (uniform routing)."""
    if n_expert <= 0:
        return 0.0
    return n_expert * (1.0 - (1.0 - k / n_expert) ** batch)


def _expert_sums(costs: ModelCosts, layers) -> tuple[float, float]:
    """(bytes of one expert summed over ``layers``, parameters of one expert summed over ``layers``)."""
    return (sum(costs.bytes_per_expert(i) for i in layers),
            float(sum(costs.layer_expert_params[i] for i in layers)))


def cpu_expert_time(costs: ModelCosts, layers, batch: int, sp: SpeedInputs, sums=None) -> float:
    """Time to run the routed experts of ``layers`` on the CPU for a batch."""
    if not layers:
        return 0.0
    bpe, ppe = sums or _expert_sums(costs, layers)
    used = experts_used(costs.n_expert, costs.n_expert_used, batch)
    # reading and computing overlap only partly in llama.cpp's CPU MUL_MAT_ID: the larger term plus half the
    # smaller matched the H200 runs at 8, 32 and 512-token prompts (the max alone was 25% fast, the sum 15% slow)
    mem = bpe * used / (sp.host_bw * R.CPU_TG_EFFICIENCY)
    comp = 2.0 * batch * costs.n_expert_used * ppe / sp.cpu_flops
    return max(mem, comp) + 0.5 * min(mem, comp)


def offload_copy_seconds(costs: ModelCosts, layers, batch: int, sp: SpeedInputs, sums=None,
                         cached_fraction: float = 0.0) -> float:
    """The PCIe part of :func:`offload_expert_time`: copying the used experts of ``layers`` that the cache's slots
    do not give (``cached_fraction``: the share of each layer's experts the expert cache holds, which such a batch
    reads from the slots on the GPU instead of copying, ``--moe-cache-prefill``; the router's picks taken as
    independent of what is cached): each such read saves part of its copy (``rates.PREFILL_READ_SAVING``, less
    ``PREFILL_READ_OVERHEAD_S``, never below nothing)."""
    if not layers:
        return 0.0
    bpe, _ppe = sums or _expert_sums(costs, layers)
    used = experts_used(costs.n_expert, costs.n_expert_used, batch)
    copy = bpe * used / sp.h2d
    f = min(1.0, max(0.0, cached_fraction))
    if f:
        reads = f * used * len(layers)
        copy -= max(0.0, f * copy * R.PREFILL_READ_SAVING - reads * R.PREFILL_READ_OVERHEAD_S)
    return copy


def offload_expert_time(costs: ModelCosts, layers, batch: int, sp: SpeedInputs, sums=None,
                        cached_fraction: float = 0.0) -> float:
    """Time to copy the used experts of ``layers`` to the GPU (:func:`offload_copy_seconds`) and run them there."""
    if not layers:
        return 0.0
    _bpe, ppe = sums or _expert_sums(costs, layers)
    gpu_eff = max(sp.gpu_flops) * R.GPU_PP_FLOPS_EFFICIENCY if sp.gpu_flops else 1e12
    copy = offload_copy_seconds(costs, layers, batch, sp, sums, cached_fraction)
    return copy + len(layers) * R.OFFLOAD_LAYER_BATCH_S + 2.0 * batch * costs.n_expert_used * ppe / gpu_eff


def prefill_stageable(n_expert: int, k: int, batch: int, min_batch: int = 0) -> bool:
    """Whether our patch stages a micro-batch of ``batch`` tokens (``--moe-cache-prefill-ahead``): it copies every
    uncached expert before the batch's ids are known, so only where the batch is expected to use all but
    ``rates.PREFILL_STAGE_UNUSED_MAX`` of them (uniform routing), and only from ``min_batch`` tokens
    (``--moe-cache-prefill-ahead-min-batch``, :func:`staging_min_batch`)."""
    return (n_expert > 0 and batch >= min_batch
            and n_expert - experts_used(n_expert, k, batch) <= n_expert * R.PREFILL_STAGE_UNUSED_MAX)


STAGE_NEVER = 1 << 30    # a min batch no micro-batch reaches


def staging_min_batch(n_expert: int, k: int, distinct) -> int:
    """The smallest micro-batch that, under the measured routing, is expected to use all but
    ``rates.PREFILL_STAGE_UNUSED_MAX`` of a layer's experts, where that is larger than what the uniform rule of
    :func:`prefill_stageable` gives; 0 where it is not (or nothing was measured): the patch's own rule then stands.

    ``distinct``: (window tokens, mean distinct experts per layer in such a window) of a routing trace (the
    profile's). Routers that repeat their picks across neighbouring tokens use fewer experts per window than
    uniform routing, and a staged micro-batch copies every uncached expert, used or not. The unused share is taken
    as decaying exponentially with the window between measured windows (as it does for independent picks) and
    past the largest at the last two windows' rate; ``STAGE_NEVER`` where it does not decay."""
    if n_expert <= 0 or not distinct:
        return 0
    target = R.PREFILL_STAGE_UNUSED_MAX
    pts = sorted((int(w), min(1.0, max(1e-9, 1.0 - float(d) / n_expert))) for w, d in distinct if int(w) > 0)
    if not pts or pts[0][1] <= target:       # the smallest window measured already uses enough of them
        return 0
    crossing = None
    for (w0, u0), (w1, u1) in zip(pts, pts[1:]):
        if u0 > target >= u1:
            crossing = w0 + (math.log(u0) - math.log(target)) / (math.log(u0) - math.log(u1)) * (w1 - w0)
            break
    if crossing is None:
        if len(pts) < 2 or pts[-1][1] >= pts[-2][1]:
            return STAGE_NEVER
        (w0, u0), (w1, u1) = pts[-2], pts[-1]
        crossing = w1 + (math.log(u1) - math.log(target)) / ((math.log(u0) - math.log(u1)) / (w1 - w0))
    uniform = next((b for b in range(1, 1 << 16) if prefill_stageable(n_expert, k, b)), STAGE_NEVER)
    need = min(STAGE_NEVER, math.ceil(crossing - 1e-9))
    return need if need > uniform else 0


def op_offload_threshold(costs: ModelCosts, placement: Placement, sp: SpeedInputs, max_batch: int,
                         min_batch: int = 2) -> tuple[int, str]:
    """Smallest batch from which offloading CPU-resident experts beats computing them on the CPU, for every
    larger batch too, and never below ``min_batch`` (generation batches: one token per busy slot must stay on
    the CPU). Returns (threshold, the arithmetic at the threshold as one line)."""
    layers = placement.cpu_expert_layers
    layers = [i for i in layers if costs.layer_experts[i] > 0]
    if not layers or not sp.gpu_mem_bw:
        return max_batch + 1, "no CPU-resident experts: nothing to offload"
    limit = max(max_batch, 2)
    sums = _expert_sums(costs, layers)
    wins = [offload_expert_time(costs, layers, b, sp, sums) < cpu_expert_time(costs, layers, b, sp, sums)
            for b in range(1, limit + 1)]
    threshold = limit + 1
    for b in range(limit, 0, -1):
        if not wins[b - 1]:
            break
        threshold = b
    threshold = max(threshold, min_batch, 2)
    b = min(threshold, limit)
    off = offload_expert_time(costs, layers, b, sp, sums)
    cpu = cpu_expert_time(costs, layers, b, sp, sums)
    used = experts_used(costs.n_expert, costs.n_expert_used, b)
    copied = sum(costs.bytes_per_expert(i) * used for i in layers)
    if threshold > limit:
        why = (f"never within a {limit}-token micro-batch: at {limit} tokens copying {copied / 2**30:.2f} GiB at "
               f"{sp.h2d / 1e9:.1f} GB/s + GPU = {off * 1e3:.1f} ms >= CPU {cpu * 1e3:.1f} ms")
    else:
        why = (f"at {b} tokens: copy {used:.0f}/{costs.n_expert} experts x {len(layers)} layers = "
               f"{copied / 2**30:.2f} GiB at {sp.h2d / 1e9:.1f} GB/s + GPU = {off * 1e3:.1f} ms < CPU "
               f"{cpu * 1e3:.1f} ms ({sp.host_bw / 1e9:.0f} GB/s, {sp.cpu_flops / 1e12:.2f} TFLOP/s)")
    return threshold, why


def _gpu_layer_bytes(costs: ModelCosts, placement: Placement, frac: float) -> list[float]:
    """Bytes read per decode step on each worker GPU (always-used + the share ``frac`` of each GPU layer's routed
    experts + output)."""
    n_gpus = len(placement.gpu_weights)
    out = [0.0] * n_gpus
    if not n_gpus:
        return out
    graph = placement.split_mode in ("tensor", "graph")
    for i in range(costs.n_compute_layers):
        g = placement.layer_gpu[i]
        if g is None:
            continue
        per_tok = costs.layer_always[i] + (costs.layer_experts[i] * frac if placement.experts_on_gpu[i] else 0.0)
        if graph:
            total = sum(placement.gpu_weights) or 1
            for k in range(n_gpus):
                out[k] += per_tok * placement.gpu_weights[k] / total
        else:
            out[g] += per_tok
    if placement.n_gpu_layers > costs.n_layers:  # output layer on the GPU
        out[-1 if not graph else 0] += costs.output_bytes
    return out


def cpu_token_seconds(cpu_bytes: float, n_layers: int, host_bw: float, threads: int = 1) -> float:
    """Time per generated token of a worker without GPUs: the bytes it reads at the share of the measured host
    bandwidth llama.cpp's CPU backend reaches (the bandwidth-bound regime: big models), plus a cost per layer and
    per token that do not shrink with the model (the overhead-bound regime: small models, where thread
    synchronisation, many small operations and the graph's set-up dominate); the per-layer cost grows with the
    threads that synchronise."""
    t = cpu_bytes / (host_bw * R.CPU_ONLY_TG_EFFICIENCY) if cpu_bytes else 0.0
    layer = R.CPU_LAYER_OVERHEAD_S * max(1, threads) ** R.CPU_LAYER_THREAD_EXPONENT
    return t + n_layers * layer + R.CPU_TOKEN_OVERHEAD_S


def _decode_step(costs: ModelCosts, placement: Placement, sp: SpeedInputs, frac: float,
                 kv_bytes: float) -> tuple[float, list[float], float]:
    """(seconds, bytes per GPU, bytes on the CPU) of one decode step that reads the share ``frac`` of every MoE
    layer's routed experts and ``kv_bytes`` of KV cache."""
    gpu_bytes = _gpu_layer_bytes(costs, placement, frac)
    if gpu_bytes:
        gpu_bytes[0] += kv_bytes
    cpu_bytes = 0.0
    n_cross = 0
    for i in range(costs.n_compute_layers):
        on_gpu = placement.layer_gpu[i] is not None
        if not on_gpu:
            cpu_bytes += costs.layer_always[i]
        if not placement.experts_on_gpu[i] and costs.layer_experts[i]:
            cpu_bytes += costs.layer_experts[i] * frac
            if on_gpu:
                n_cross += 1
    if placement.n_gpu_layers <= costs.n_layers:
        cpu_bytes += costs.output_bytes
    if not gpu_bytes:
        cpu_bytes += kv_bytes
        t = cpu_token_seconds(cpu_bytes, costs.n_compute_layers, sp.host_bw, sp.threads)
    else:
        t = cpu_bytes / (sp.host_bw * R.CPU_TG_EFFICIENCY) if cpu_bytes else 0.0
        times = [b / (bw * R.GPU_TG_EFFICIENCY) for b, bw in zip(gpu_bytes, sp.gpu_mem_bw)]
        t += max(times) if placement.split_mode in ("tensor", "graph") else sum(times)
        t += costs.n_compute_layers * R.GPU_LAYER_OVERHEAD_S + n_cross * R.CROSS_DEVICE_LAYER_OVERHEAD_S
    return t, gpu_bytes, cpu_bytes


def predict_tg(costs: ModelCosts, placement: Placement, sp: SpeedInputs, kv_read_per_token: float = 0.0) -> tuple[float, dict]:
    """Tokens/s for generation at short depth, and the bytes read per token per device."""
    frac = costs.n_expert_used / costs.n_expert if costs.n_expert else 0.0
    t, gpu_bytes, cpu_bytes = _decode_step(costs, placement, sp, frac, kv_read_per_token)
    per_dev = {D.gpu(k): int(b) for k, b in enumerate(gpu_bytes)}
    per_dev["CPU"] = int(cpu_bytes)
    return (1.0 / t if t > 0 else 0.0), per_dev


def pp_layer_seconds(batch: int) -> float:
    """What a layer costs a micro-batch on the GPU beyond its matrix products (attention, norms, routing, the
    kernels' launches): rising with the batch and levelling off (rates.PP_LAYER_BATCH_S)."""
    return R.PP_LAYER_BATCH_S * batch / (batch + R.PP_LAYER_BATCH_HALF)


def cpu_parallel(threads: int) -> float:
    """How many times faster than one thread ``threads`` threads run a prompt on the CPU (synchronisation
    between operations and the shared caches keep it below linear: rates.CPU_PP_THREAD_EXPONENT)."""
    return max(1, threads) ** R.CPU_PP_THREAD_EXPONENT


def _prompt_always_params(costs: ModelCosts, layer: int) -> int:
    """The always-used parameters of ``layer`` a prompt's micro-batch multiplies: all of them, less the last
    layer's feed-forward where the graph runs it for the output token only (costs.prompt_skip_ffn_layer)."""
    p = costs.layer_always_params[layer]
    return p - costs.prompt_skip_ffn_params if layer == costs.prompt_skip_ffn_layer else p


def _prompt_expert_layers(costs: ModelCosts, placement: Placement) -> list[int]:
    """The host-resident expert layers whose experts a prompt's micro-batch runs: all of them but the last layer
    where the graph runs its feed-forward for the output token only (costs.prompt_skip_ffn_layer)."""
    return [i for i in placement.cpu_expert_layers
            if costs.layer_experts[i] > 0 and i != costs.prompt_skip_ffn_layer]


def cpu_pp_batch_seconds(costs: ModelCosts, placement: Placement, sp: SpeedInputs, batch: int, start: int) -> float:
    """One micro-batch of ``batch`` prompt tokens after ``start`` tokens of context, on the CPU only: the matrix
    products (dense weights; the routed experts as :func:`cpu_expert_time`), what each token costs in each layer
    beyond them (norms, RoPE, routing, gathering its experts), and attention, whose work grows with the context:
    llama.cpp's CPU attention computes each query of the micro-batch against every position up to the end of the
    micro-batch (masked or not), so ``batch x (start + batch)`` pairs per layer. Compute scales with the
    machine's measured ``cpu_rate``; the memory-bound share of the experts with its bandwidth."""
    cpu_layers = _prompt_expert_layers(costs, placement)
    # measured: the reference machine's core at the measured rate; else the per-core table's guess for this CPU
    per_core = R.CPU_REFERENCE_CORE_FLOPS if sp.cpu_rate > 0 else sp.cpu_flops / max(1, sp.threads)
    par = cpu_parallel(sp.threads) * (sp.cpu_rate if sp.cpu_rate > 0 else 1.0)
    flops = per_core * R.CPU_ONLY_PP_FLOPS_FACTOR * par
    dense = sum(_prompt_always_params(costs, i) for i in range(costs.n_compute_layers)
                if placement.layer_gpu[i] is None)
    t = 2.0 * dense * batch / flops
    if cpu_layers:
        t += cpu_expert_time(costs, cpu_layers, batch, replace(sp, cpu_flops=flops))
    t += batch * costs.n_compute_layers * R.CPU_PP_LAYER_TOKEN_S / par
    t += costs.attn_pair_macs * batch * (start + batch) * R.CPU_PP_ATTN_MAC_S / par
    return t


@dataclass(frozen=True)
class PromptCache:
    """What the expert cache does for a prompt's micro-batches through op offload: ``cached_fraction`` as in
    :func:`offload_expert_time`; ``staged``: the uncached experts of a micro-batch that :func:`prefill_stageable`
    allows (from ``stage_min_batch`` tokens) are copied ahead on a second stream while the layers before compute."""

    cached_fraction: float = 0.0
    staged: bool = False
    stage_min_batch: int = 0


NO_PROMPT_CACHE = PromptCache()


def predict_pp(costs: ModelCosts, placement: Placement, sp: SpeedInputs, n_ubatch: int, threshold: int | None,
               lengths=PP_LENGTHS, cache: PromptCache = NO_PROMPT_CACHE) -> dict[int, float]:
    """Prompt tokens/s for prompts of each length, processed in micro-batches of ``n_ubatch``, with what the
    expert cache does for them (``cache``). A staged copy hides ``rates.PREFILL_STAGED_OVERLAP`` of the copy time
    or of the rest of the micro-batch up to the last host-resident layer, whichever is less (a copy can hide only
    behind the layers before its own)."""
    cached_fraction, staged, stage_min_batch = cache.cached_fraction, cache.staged, cache.stage_min_batch
    # the last layer's experts run for the prompt's output token only (costs.prompt_skip_ffn_layer): neither copied
    # nor computed for the micro-batch
    skip = costs.prompt_skip_ffn_layer
    cpu_layers = _prompt_expert_layers(costs, placement)
    gpu_flops_eff = max(sp.gpu_flops) * R.GPU_PP_FLOPS_EFFICIENCY if sp.gpu_flops else 0.0
    if not gpu_flops_eff:   # CPU only: its own model, fitted on CPU-only runs (rates.py)
        out = {}
        for length in lengths:
            t = sum(cpu_pp_batch_seconds(costs, placement, sp, min(n_ubatch, length - s), s)
                    for s in range(0, length, max(1, n_ubatch)))
            out[length] = length / t if t > 0 else 0.0
        return out
    gpu_params = 0.0
    cpu_params = 0.0
    for i in range(costs.n_compute_layers):
        p_always = _prompt_always_params(costs, i)
        p_exp_active = 0 if i == skip else costs.n_expert_used * costs.layer_expert_params[i]
        if placement.layer_gpu[i] is not None:
            gpu_params += p_always
            if placement.experts_on_gpu[i]:
                gpu_params += p_exp_active
        else:
            cpu_params += p_always
    gpu_weight_bytes = sum(placement.gpu_weights)
    sums = _expert_sums(costs, cpu_layers)
    # staged copies run while the layers before theirs compute: the share of the micro-batch up to the last
    # host-resident layer
    span = min(1.0, (max(cpu_layers) + 1) / costs.n_compute_layers) if cpu_layers and costs.n_compute_layers else 0.0
    out = {}
    for length in lengths:
        remaining = length
        t = 0.0
        while remaining > 0:
            b = min(n_ubatch, remaining)
            remaining -= b
            t_before = t
            if gpu_flops_eff:
                gpu_bw = max(sp.gpu_mem_bw)
                t += max(2.0 * gpu_params * b / gpu_flops_eff, gpu_weight_bytes / gpu_bw)
                t += costs.n_compute_layers * pp_layer_seconds(b)
            if cpu_params:
                t += max(2.0 * cpu_params * b / sp.cpu_flops, 0.0)
            if cpu_layers:
                if threshold is not None and b >= threshold and sp.gpu_mem_bw:
                    off = offload_expert_time(costs, cpu_layers, b, sp, sums, cached_fraction)
                    if staged and prefill_stageable(costs.n_expert, costs.n_expert_used, b, stage_min_batch):
                        copy = offload_copy_seconds(costs, cpu_layers, b, sp, sums, cached_fraction)
                        rest = (t - t_before + off - copy) * span
                        off -= R.PREFILL_STAGED_OVERLAP * min(copy, rest)
                    t += off
                else:
                    t += cpu_expert_time(costs, cpu_layers, b, sp, sums)
        out[length] = length / t if t > 0 else 0.0
    return out


def predict_tg_streams(costs: ModelCosts, placement: Placement, sp: SpeedInputs, streams: int,
                       kv_read_per_token: float = 0.0) -> float:
    """Aggregate tokens/s of ``streams`` streams decoding together at short depth, without an expert cache: one
    step reads every always-used weight once and, in each MoE layer, the union of the streams' picks (independent
    picks); each stream reads its own KV cache. :func:`predict_tg`'s step, which this equals at one stream."""
    n = max(1, int(streams))
    share = (experts_used(costs.n_expert, costs.n_expert_used, n) / costs.n_expert) if costs.n_expert else 0.0
    t, _gpu, _cpu = _decode_step(costs, placement, sp, share, kv_read_per_token * n)
    return n / t if t > 0 else 0.0
