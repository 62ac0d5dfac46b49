"""Split the VRAM left for routed experts between whole expert layers and an expert cache (pure).

After the always-used weights, the KV cache and the buffers, ``vram_free`` bytes remain for routed experts.
Whole expert layers on the GPU serve every batch without copies (prompt processing); cache slots
(``--moe-cache-mib``) hold the experts that decode is using now, for the layers whose experts stay in host
memory: the cache is split evenly into one bank of slots per host-resident layer (an LRU per layer, the curve's
``lru-layer`` policy), and a bank smaller than one token's picks cannot serve decode (no such candidate). For each
candidate -- ``k`` whole layers on the GPU, the rest of ``vram_free`` as cache (less what each host-resident layer's
experts keep on the GPU: ``host_layer_vram``, gpt-oss's biases) -- the routed experts' time per generated token is
predicted from the routing profile's hit-rate curve:

    t = GPU-resident expert bytes / GPU bw                          (k layers, n_expert_used experts each)
      + cache hits / GPU bw                                         (host layers' picks found in the cache)
      + misses / PCIe bw + misses / GPU bw        (miss mode "upload": copied into a slot, then read)
        or CPU misses / host bw                   (miss mode "cpu": computed on the CPU where they lie)
           + re-used misses / PCIe bw + re-used misses / GPU bw     (uploaded: used again within the horizon)
      + host layers x cache_layer_overhead_s + cache_fixed_s        (the cache path's costs beyond the bytes;
                                                  device_layer_overhead_s in place of the first where the slots
                                                  are assigned on the device)
      + host layers x P(a token has a CPU miss in the layer) x cpu_miss_hop_s + cpu_miss_fixed_s
                                                  (miss mode "cpu": the hop GPU -> CPU -> GPU where it is needed,
                                                  and the CPU path's cost per token)

With uploads ahead of need (``prefetch``: the backend's ``--moe-cache-prefetch``, upload mode), the misses' link
time is multiplied by (1 - cut) + uploads x (1 - overlap): ``cut`` the share of the misses they turn into hits,
``uploads`` the uploads ahead per miss without them, ``overlap`` the share of their link time hidden behind compute,
each measured per stream count (``PREFETCH_*`` in :mod:`orchestrator.plan.rates`). ``auto`` turns them on where
that beats the same split without them by ``MIN_GAIN`` on the generation the objective weighs; ``on`` forces them.

Slots assigned on the device (``device_slots``: the backend's ``--moe-cache-slots device``, where the weights' host
memory is pinned) remove the host's round trip per host-resident layer (the expert ids read back, the slots
assigned there): a layer then costs ``device_layer_overhead_s``. The device needs the host's table neither for CPU
misses nor for uploads ahead of need, so it serves upload mode without them; where it is possible the split takes
it (it only removes work), and otherwise the host assigns.

In miss mode "cpu" the hit, upload and CPU shares come from the curve's ``cpu_misses`` (the patch's rule
replayed on the measured trace); a curve without them (the default curve) leaves the mode to a user who asks
for it, and then every miss is taken as computed on the CPU.

and, without a cache, t = GPU-resident bytes / GPU bw + every host layer's picks / host bw + host layers x
host_layer_overhead_s (the CPU computes them; the hop GPU -> CPU -> GPU). The bandwidths are the effective ones
the roofline of :mod:`orchestrator.plan.predict` uses, so the no-cache candidate at the plan's own placement
predicts what the plan predicts. The time of everything else a token reads (attention, norms, the output head)
is ``base_seconds``, the same for every candidate. The CPU and GPU parts are summed (no overlap counted).

Prompt processing is kept as a proxy: time per micro-batch for the expert weights = host-resident expert bytes /
PCIe bw (copied in for big batches) + GPU-resident expert bytes / GPU bw. A backend whose big batches read the
cached experts from the slots (``--moe-cache-prefill``) saves, of the copy of the cached share, ``prefill_read_saving``
less ``prefill_read_overhead_s`` per cached expert of a layer (measured: a read moved on the device costs time of its
own beyond its bytes).

Several streams (``streams`` = the worker's parallel slots, all busy) decode as one batch per step: each layer
reads the union of the streams' picks, U(N) = n_expert x (1 - (1 - k / n_expert)^N) distinct experts (independent
picks), and each distinct expert is looked up, uploaded or read once. The streams share every bank, so each sees
part of the slots: the hit rate at N streams is the curve at (cached fraction x (k / U(N)) ** e). With e = 1 each
stream would get an equal share of disjoint slots; streams of one model pick many experts alike (popular experts,
shared between streams), and e < 1 (``stream_share_exponent``, measured) says how much. A step then
takes the single-token arithmetic above with U(N) experts per layer in place of k, plus ``base_seconds``; the
aggregate is N tokens per step. Where a batch of N tokens needs more slots than a bank has (N x k > slots per
layer), the patch leaves it to the CPU path: the step is then computed as without a cache at the same placement.

Objectives: ``generation`` (default) takes the best predicted generation within 3% of the best, then the most
whole layers (prompt speed); ``prompt`` takes the fastest prompt (to 0.1 ms a micro-batch: the most whole layers
unless big batches read the slots, when every split copies about the same bytes), then the best generation;
``balanced`` maximises the geometric mean of generation and prompt speed, each relative to its best candidate.
Generation is one stream's, or with ``streams`` > 1 the aggregate of that many streams decoding together. A cache is
chosen only where it is predicted to beat the same VRAM as whole layers alone (slow link, little locality:
no cache).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from orchestrator.model.routing_profile import HitCurve, hit_rate

OBJECTIVES = ("generation", "balanced", "prompt")
MISS_MODES = ("upload", "cpu")
GENERATION_TOLERANCE = 0.03   # "within 3% of the best generation"
MIN_GAIN = 0.01               # a cache must win by more than this to be worth its complexity
MIB = 1 << 20


@dataclass(frozen=True)
class CacheInputs:
    curve: HitCurve
    layer_expert_bytes: int      # routed-expert bytes of one MoE layer (all its experts)
    n_expert: int
    n_expert_used: int
    n_moe_layers: int
    vram_free: int               # VRAM left after always-used weights, KV and buffers
    pcie_bw: float               # measured host->device bytes/s (pinned)
    host_bw: float               # host memory bytes/s that CPU expert compute reads at
    gpu_bw: float                # GPU memory bytes/s
    base_seconds: float = 0.0    # per-token time of everything but the routed experts
    cpu_misses: bool = True      # the backend can compute cache misses on the CPU (and they may be)
    upload_misses: bool = True   # misses may be uploaded (False: the CPU computes them wherever it can)
    host_layer_overhead_s: float = 0.0   # per host-resident layer whose experts the CPU computes
    cache_layer_overhead_s: float = 0.0  # per host-resident layer the cache serves (expert ids read back)
    cache_fixed_s: float = 0.0           # per token on the cache path, beyond the bytes
    cpu_miss_hop_s: float = 0.0          # miss mode "cpu": per host-resident layer whose token has a CPU miss
    cpu_miss_fixed_s: float = 0.0        # miss mode "cpu": per token, beyond the bytes and the hops
    min_gpu_layers: int = 0              # fewer whole layers on the GPU would not fit host memory
    prefill_reads_cache: bool = False    # big batches read cached experts from the slots (--moe-cache-prefill)
    prefill_read_saving: float = 1.0     # the share of a read expert's copy time that reading saves
    prefill_read_overhead_s: float = 0.0  # per cached expert of a layer read, beyond that
    streams: int = 1                     # busy parallel slots decoding together (aggregate generation)
    stream_share_exponent: float = 1.0   # each stream sees the cached fraction x (k / U(N)) ** this
    # uploads ahead of need (--moe-cache-prefetch): "off" (the backend or model has none), "auto" (where predicted
    # faster), "on" (forced); per stream count N measured, the share of the misses turned into hits, the uploads ahead
    # per miss, and the share of their link time hidden behind compute
    prefetch: str = "off"
    prefetch_miss_cut: tuple[tuple[int, float], ...] = ()
    prefetch_uploads: tuple[tuple[int, float], ...] = ()
    prefetch_overlap: tuple[tuple[int, float], ...] = ()
    # slots assigned on the device (--moe-cache-slots device): possible for this worker, and a host layer's cost then
    device_slots: bool = False
    device_layer_overhead_s: float = 0.0
    # VRAM a host-resident layer's routed-expert tensors still take: those the MUL_MAT_IDs do not read (gpt-oss's
    # biases) stay with the layer on the GPU, so their ops run there and not on the CPU between the cache's splits
    host_layer_vram: int = 0


@dataclass(frozen=True, kw_only=True)
class CacheCandidate:
    gpu_layers: int              # whole expert layers on the GPU
    host_layers: int
    cache_bytes: int             # 0: no cache
    slots: int                   # experts the cache holds (all layers' banks)
    slots_per_layer: int
    fraction: float              # slots / host-resident experts
    hit_rate: float
    miss_mode: str               # "upload", "cpu", or "none" without a cache
    gpu_resident_bytes: float    # per token: experts of GPU layers
    cache_hit_bytes: float       # per token: host layers' picks served from the cache
    host_read_bytes: float       # per token: read from host memory by CPU expert compute
    pcie_bytes: float            # per token: uploaded over PCIe
    expert_seconds: float        # routed experts' time per generated token
    tokens_per_s: float          # 1 / (base_seconds + expert_seconds)
    prompt_seconds: float        # expert weights' time per prompt micro-batch (proxy)
    slot_bytes: int = 0          # VRAM the slots take (slots x one expert's bytes): at most cache_bytes
    streams: int = 1             # the streams of ``stream_tokens_per_s``
    stream_tokens_per_s: float = 0.0   # aggregate generation of ``streams`` streams decoding together
    stream_hit_rate: float = 0.0       # the cache's hit rate per distinct expert looked up at ``streams``
    prefetch: bool = False             # uploads ahead of need (upload mode only)
    prefetch_gain: float = 1.0         # predicted generation with them / without them (1.0: not weighed)
    device_slots: bool = False         # the slots are assigned on the device (--moe-cache-slots device)
    stage_buffers: int = 0             # prompts' staging buffers (--moe-cache-prefill-ahead), out of cache_bytes
    stage_bytes: int = 0               # their VRAM
    stage_min_batch: int = 0           # micro-batches staged only from this many tokens (0: the patch's rule)

    @property
    def cache_mib(self) -> int:
        return self.cache_bytes // MIB

    @property
    def generation(self) -> float:
        """What the objectives weigh as generation speed: one stream's tokens/s, or with several parallel slots
        the aggregate of that many streams decoding together."""
        return self.stream_tokens_per_s if self.streams > 1 else self.tokens_per_s


@dataclass(frozen=True)
class GpuCacheShare:
    """One GPU's part of the chosen cache under ``-sm layer``: the banks of the host-resident layers it runs (the
    same slot count as every other bank) and what they serve per generated token."""

    device: str                  # CUDA0, CUDA1, ... (the worker's GPU list)
    whole_layers: int            # expert layers kept whole in its VRAM
    host_layers: int             # host-resident expert layers it runs: one bank each
    slots_per_layer: int
    cache_bytes: int             # VRAM of its banks and their id buffers
    hit_rate: float              # predicted: every bank holds the same fraction of its layer's experts
    hit_bytes: float             # per token: its host layers' picks served from its banks
    pcie_bytes: float            # per token: its misses, uploaded over PCIe

    @property
    def slots(self) -> int:
        return self.slots_per_layer * self.host_layers

    def to_json(self) -> dict:
        return {"device": self.device, "whole_layers": self.whole_layers, "host_layers": self.host_layers,
                "slots_per_layer": self.slots_per_layer, "slots": self.slots,
                "cache_mib": round(self.cache_bytes / MIB, 1), "hit_rate": round(self.hit_rate, 5),
                "bytes_per_token": {"cache_hits": round(self.hit_bytes), "pcie": round(self.pcie_bytes)}}


@dataclass(frozen=True)
class CachePlan:
    chosen: CacheCandidate
    no_cache: CacheCandidate     # the most whole layers that fit, no cache
    candidates: tuple[CacheCandidate, ...]
    objective: str
    curve_source: str
    reason: str
    per_gpu: tuple[GpuCacheShare, ...] = ()   # several GPUs: each one's banks (empty for one GPU)

    @property
    def use_cache(self) -> bool:
        return self.chosen.cache_bytes > 0

    def arithmetic(self) -> list[str]:
        """The prediction at the chosen point, for ``plan`` to print."""
        c, n = self.chosen, self.no_cache
        gb = 1e9
        lines = [f"expert cache: {self.reason}",
                 f"  hit-rate curve: {self.curve_source}"]
        if c.cache_bytes:
            lines.append(f"  {c.gpu_layers} expert layers on the GPU, {c.host_layers} in host memory; cache "
                         f"{c.cache_mib} MiB = {c.slots_per_layer} experts per layer = {c.fraction:.1%} of the "
                         f"host-resident ones "
                         f"-> predicted hit rate {c.hit_rate:.1%}; " + _misses_text(c))
        else:
            lines.append(f"  {c.gpu_layers} expert layers on the GPU, {c.host_layers} in host memory; no cache")
        lines.append(f"  per token: {c.gpu_resident_bytes / gb:.3f} GB GPU-resident experts + "
                     f"{c.cache_hit_bytes / gb:.3f} GB from the cache + {c.host_read_bytes / gb:.3f} GB from "
                     f"host memory + {c.pcie_bytes / gb:.3f} GB over PCIe"
                     + f" -> {c.expert_seconds * 1e3:.2f} ms -> {c.tokens_per_s:.1f} tok/s predicted")
        for g in self.per_gpu:
            lines.append(f"  {g.device}: {g.whole_layers} whole expert layers, {g.host_layers} host-resident x "
                         f"{g.slots_per_layer} slots = {g.slots} experts = {g.cache_bytes / MIB:.1f} MiB of cache; "
                         f"per token {g.hit_bytes / gb:.3f} GB from its cache ({g.hit_rate:.1%} hits) + "
                         f"{g.pcie_bytes / gb:.3f} GB over PCIe")
        if c.streams > 1:
            hits = f", {c.stream_hit_rate:.1%} hits per distinct expert" if c.cache_bytes and c.stream_hit_rate else ""
            lines.append(f"  {c.streams} streams decoding together: {c.stream_tokens_per_s:.1f} tok/s aggregate "
                         f"predicted ({n.stream_tokens_per_s:.1f} without a cache){hits}")
        if c is not n:
            lines.append(f"  without a cache ({n.gpu_layers} layers on the GPU): {n.expert_seconds * 1e3:.2f} ms "
                         f"-> {n.tokens_per_s:.1f} tok/s; prompt proxy {c.prompt_seconds * 1e3:.1f} ms vs "
                         f"{n.prompt_seconds * 1e3:.1f} ms per micro-batch")
        return lines

    def to_json(self) -> dict:
        def cand(c: CacheCandidate) -> dict:
            return {"gpu_layers": c.gpu_layers, "host_layers": c.host_layers, "cache_mib": c.cache_mib,
                    "slot_mib": round(c.slot_bytes / MIB, 1), "slots": c.slots, "slots_per_layer": c.slots_per_layer,
                    "fraction": round(c.fraction, 5),
                    "hit_rate": round(c.hit_rate, 5), "miss_mode": c.miss_mode,
                    "bytes_per_token": {"gpu_resident": round(c.gpu_resident_bytes), "cache_hits":
                                        round(c.cache_hit_bytes), "host_memory": round(c.host_read_bytes),
                                        "pcie": round(c.pcie_bytes)},
                    "expert_seconds_per_token": c.expert_seconds, "tokens_per_s": c.tokens_per_s,
                    "streams": c.streams, "stream_tokens_per_s": c.stream_tokens_per_s,
                    "stream_hit_rate": round(c.stream_hit_rate, 5),
                    "prompt_seconds_per_ubatch": c.prompt_seconds,
                    "prefetch": c.prefetch, "prefetch_gain": round(c.prefetch_gain, 4),
                    "device_slots": c.device_slots, "stage_buffers": c.stage_buffers,
                    "stage_mib": round(c.stage_bytes / MIB, 1), "stage_min_batch": c.stage_min_batch}
        return {"objective": self.objective, "use_cache": self.use_cache, "reason": self.reason,
                "curve_source": self.curve_source, "chosen": cand(self.chosen), "no_cache": cand(self.no_cache),
                "candidates": [cand(c) for c in self.candidates],
                **({"per_gpu": [g.to_json() for g in self.per_gpu]} if self.per_gpu else {})}


def _misses_text(c: CacheCandidate) -> str:
    if c.miss_mode != "cpu":
        text = "misses uploaded"
        if c.prefetch_gain != 1.0 or c.prefetch:
            text += (f"; uploads ahead of need {'on' if c.prefetch else 'off'} (predicted "
                     f"{c.prefetch_gain:.2f}x the generation without them)")
        if c.device_slots:
            text += "; slots assigned on the device (--moe-cache-slots device)"
        return text + _staging_text(c)
    picks = c.cache_hit_bytes + c.host_read_bytes + c.pcie_bytes
    if not picks:
        return "misses on the CPU"
    return (f"misses: {c.host_read_bytes / picks:.1%} of the picks on the CPU, {c.pcie_bytes / picks:.1%} uploaded "
            f"(used again within the cache's horizon; --moe-cache-cpu-misses)" + _staging_text(c))


def _staging_text(c: CacheCandidate) -> str:
    if not c.stage_buffers:
        return ""
    return (f"; prompts' uncached experts copied ahead into {c.stage_buffers} staging buffers of "
            f"{c.stage_bytes / c.stage_buffers / MIB:.1f} MiB (--moe-cache-prefill-ahead)"
            + (f", micro-batches from {c.stage_min_batch} tokens" if c.stage_min_batch else ""))


def union_experts(n_expert: int, k: int, streams: int) -> float:
    """Distinct experts a decode step of ``streams`` tokens picks in one layer (independent picks)."""
    if n_expert <= 0:
        return 0.0
    return n_expert * (1.0 - (1.0 - k / n_expert) ** max(1, streams))


def _uncached_step(inp: CacheInputs, k: int, used: float) -> float:
    """Routed experts' time of one decode step whose layers each use ``used`` distinct experts, ``k`` layers on
    the GPU and the rest computed on the CPU where they lie."""
    expert = inp.layer_expert_bytes / inp.n_expert
    h = inp.n_moe_layers - k
    return k * used * expert / inp.gpu_bw + h * used * expert / inp.host_bw + h * inp.host_layer_overhead_s


def prefetch_link_factor(inp: CacheInputs, streams: int) -> float:
    """The link time of a step's misses with uploads ahead of need, as a multiple of it without them: the misses
    left, plus the uploads ahead whose time is not hidden. The measured stream count nearest ``streams``."""
    at = _nearest(streams)
    return (1.0 - at(inp.prefetch_miss_cut)) + at(inp.prefetch_uploads) * (1.0 - at(inp.prefetch_overlap))


def prefetch_traffic_factor(inp: CacheInputs, streams: int) -> float:
    """The bytes a step sends over the link with uploads ahead of need, as a multiple of its misses' without."""
    at = _nearest(streams)
    return (1.0 - at(inp.prefetch_miss_cut)) + at(inp.prefetch_uploads)


def _nearest(streams: int):
    def at(table: tuple[tuple[int, float], ...]) -> float:
        return min(table, key=lambda kv: (abs(kv[0] - streams), kv[0]))[1] if table else 0.0
    return at


def _layer_overhead(inp: CacheInputs, device: bool) -> float:
    return inp.device_layer_overhead_s if device else inp.cache_layer_overhead_s


def _aggregate(inp: CacheInputs, k: int, per_layer: int, fraction: float,
               prefetch: bool = False, device: bool = False) -> tuple[float, float]:
    """(aggregate tokens/s, hit rate) of ``inp.streams`` streams decoding together, upload mode (see the module
    docstring); ``per_layer`` slots in each host layer's bank (0: no cache); ``prefetch``: with uploads ahead of
    need (their link time by :func:`prefetch_link_factor`); ``device``: slots assigned on the device."""
    n = max(1, inp.streams)
    used = union_experts(inp.n_expert, inp.n_expert_used, n)
    h = inp.n_moe_layers - k
    if per_layer <= 0 or h == 0 or n * inp.n_expert_used > per_layer:
        return n / (inp.base_seconds + _uncached_step(inp, k, used)), 0.0
    expert = inp.layer_expert_bytes / inp.n_expert
    hit = hit_rate(inp.curve, fraction * (inp.n_expert_used / used) ** inp.stream_share_exponent) if used else 0.0
    picks = h * used * expert
    misses = (1.0 - hit) * picks
    link = prefetch_link_factor(inp, n) if prefetch else 1.0
    t = (k * used * expert + picks) / inp.gpu_bw + misses * link / inp.pcie_bw + h * _layer_overhead(inp, device) \
        + inp.cache_fixed_s
    return n / (inp.base_seconds + t), hit


def _candidate(inp: CacheInputs, k: int, cache_bytes: int, mode: str) -> CacheCandidate:
    expert = inp.layer_expert_bytes / inp.n_expert
    per_layer_token = inp.n_expert_used * expert
    h = inp.n_moe_layers - k
    gpu_resident = k * per_layer_token
    host_picks = h * per_layer_token
    prompt = h * inp.layer_expert_bytes / inp.pcie_bw + k * inp.layer_expert_bytes / inp.gpu_bw
    if cache_bytes <= 0 or h == 0:
        t = gpu_resident / inp.gpu_bw + host_picks / inp.host_bw + h * inp.host_layer_overhead_s
        agg, _ = _aggregate(inp, k, 0, 0.0)
        return CacheCandidate(gpu_layers=k, host_layers=h, cache_bytes=0, slots=0, slots_per_layer=0, fraction=0.0,
                              hit_rate=0.0, miss_mode="none", gpu_resident_bytes=gpu_resident, cache_hit_bytes=0.0,
                              host_read_bytes=host_picks, pcie_bytes=0.0, expert_seconds=t,
                              tokens_per_s=1.0 / (inp.base_seconds + t), prompt_seconds=prompt,
                              streams=max(1, inp.streams), stream_tokens_per_s=agg)
    per_layer = min(int(cache_bytes // (h * expert)), inp.n_expert)
    slots = per_layer * h
    fraction = per_layer / inp.n_expert
    if inp.prefill_reads_cache:
        copy = h * inp.layer_expert_bytes / inp.pcie_bw
        reads = fraction * inp.n_expert * h
        prompt -= max(0.0, fraction * copy * inp.prefill_read_saving - reads * inp.prefill_read_overhead_s)
    hit = hit_rate(inp.curve, fraction)
    agg, agg_hit = _aggregate(inp, k, per_layer, fraction)
    hits, misses = hit * host_picks, (1.0 - hit) * host_picks
    fixed = h * inp.cache_layer_overhead_s + inp.cache_fixed_s
    prefetch, gain, device = False, 1.0, False
    if mode == "upload":
        t = (gpu_resident + hits + misses) / inp.gpu_bw + misses / inp.pcie_bw + fixed
        host_read, pcie = 0.0, misses
        t_host = t
        if inp.prefetch != "off":
            # weighed on what the objectives weigh: one stream's generation, or the streams' aggregate
            t_pf = t + misses * (prefetch_link_factor(inp, 1) - 1.0) / inp.pcie_bw
            agg_pf, _ = _aggregate(inp, k, per_layer, fraction, prefetch=True)
            gain = agg_pf / agg if inp.streams > 1 else (inp.base_seconds + t) / (inp.base_seconds + t_pf)
            if inp.prefetch == "on" or gain > 1.0 + MIN_GAIN:
                prefetch = True
                t, agg, pcie = t_pf, agg_pf, misses * prefetch_traffic_factor(inp, 1)
        if inp.device_slots and inp.prefetch != "on":
            # the device keeps the table: no round trip per host layer; uploads ahead need the host's table, so the
            # device is taken where it beats them (or they are off)
            t_dev = t_host + h * (inp.device_layer_overhead_s - inp.cache_layer_overhead_s)
            agg_dev, hit_dev = _aggregate(inp, k, per_layer, fraction, device=True)
            better = agg_dev >= agg if inp.streams > 1 else t_dev <= t
            if not prefetch or better:
                device, prefetch = True, False
                t, agg, agg_hit, pcie = t_dev, agg_dev, hit_dev, misses
    else:
        up = 0.0                                   # without the replayed shares: every miss on the CPU
        if inp.curve.cpu_misses is not None:
            hit, up = inp.curve.cpu_misses.at(fraction)
        hits, uploads = hit * host_picks, up * host_picks
        on_cpu = max(0.0, host_picks - hits - uploads)
        # a layer needs the CPU (and its hop) only for a token with a CPU miss among its picks
        p_cpu = 1.0 - (1.0 - on_cpu / host_picks) ** inp.n_expert_used if host_picks else 0.0
        t = ((gpu_resident + hits + uploads) / inp.gpu_bw + uploads / inp.pcie_bw + on_cpu / inp.host_bw + fixed
             + h * p_cpu * inp.cpu_miss_hop_s + inp.cpu_miss_fixed_s)
        host_read, pcie = on_cpu, uploads
    return CacheCandidate(gpu_layers=k, host_layers=h, cache_bytes=int(cache_bytes), slots=slots,
                          slots_per_layer=per_layer, fraction=fraction, hit_rate=hit, miss_mode=mode,
                          gpu_resident_bytes=gpu_resident, cache_hit_bytes=hits, host_read_bytes=host_read,
                          pcie_bytes=pcie, expert_seconds=t, tokens_per_s=1.0 / (inp.base_seconds + t),
                          prompt_seconds=prompt, slot_bytes=int(math.ceil(slots * expert)),
                          streams=max(1, inp.streams), stream_tokens_per_s=agg, stream_hit_rate=agg_hit,
                          prefetch=prefetch, prefetch_gain=gain, device_slots=device)


def candidates(inp: CacheInputs, cache_bytes: int | None = None,
               splits: tuple[tuple[int, int], ...] | None = None) -> tuple[CacheCandidate, ...]:
    """One candidate per number of whole layers (0 .. as many as fit), the rest of the VRAM as cache, with the
    faster miss mode; plus the no-cache split (most whole layers). ``cache_bytes``: a cache of this size only
    (the most whole layers that fit beside it). ``splits``: the (whole layers, cache bytes) pairs to weigh
    instead, where the caller knows what fits (several GPUs, each with its own room); the no-cache split is
    then the most whole layers of ``vram_free``."""
    free = max(0, int(inp.vram_free))
    k_max = min(inp.n_moe_layers, free // inp.layer_expert_bytes) if inp.layer_expert_bytes > 0 else 0
    # the CPU mode is weighed where its shares are known (a measured curve), or where the user asked for it
    cpu = inp.cpu_misses and (inp.curve.cpu_misses is not None or not inp.upload_misses)
    modes = tuple(m for m, ok in (("upload", inp.upload_misses or not cpu), ("cpu", cpu)) if ok)
    out = []
    expert = inp.layer_expert_bytes / inp.n_expert if inp.n_expert else 0
    if splits is not None:
        for k, size in splits:
            h = inp.n_moe_layers - k
            if h <= 0 or size < h * inp.n_expert_used * expert:
                continue
            out.append(min((_candidate(inp, k, size, m) for m in modes), key=lambda c: c.expert_seconds))
        out.append(_candidate(inp, k_max, 0, "none"))
        return tuple(out)
    for k in range(min(inp.min_gpu_layers, k_max), k_max + 1):
        rest = free - k * inp.layer_expert_bytes - (inp.n_moe_layers - k) * inp.host_layer_vram
        rest = rest // MIB * MIB
        if cache_bytes is not None:
            more = free - (k + 1) * inp.layer_expert_bytes - (inp.n_moe_layers - k - 1) * inp.host_layer_vram
            if rest < cache_bytes or (k < k_max and more >= cache_bytes):
                continue
            rest = cache_bytes // MIB * MIB
        h = inp.n_moe_layers - k
        # the cache splits evenly into one bank of slots per host-resident layer; a bank must hold at least one
        # token's picks, or the cache cannot serve decode at all
        if h == 0 or rest < h * inp.n_expert_used * expert:
            continue
        out.append(min((_candidate(inp, k, rest, m) for m in modes), key=lambda c: c.expert_seconds))
    out.append(_candidate(inp, k_max, 0, "none"))
    return tuple(out)


def plan_expert_cache(inp: CacheInputs, objective: str = "generation", cache_bytes: int | None = None,
                      splits: tuple[tuple[int, int], ...] | None = None) -> CachePlan:
    """Pick the split of ``inp.vram_free`` between whole expert layers and the cache by ``objective``;
    ``cache_bytes``: the cache has this size (set by the user), whole layers fill the rest; ``splits``: weigh
    only these (whole layers, cache bytes) pairs (see :func:`candidates`)."""
    if objective not in OBJECTIVES:
        raise ValueError(f"objective {objective!r}: expected one of {OBJECTIVES}")
    for name in ("pcie_bw", "host_bw", "gpu_bw"):
        if not getattr(inp, name) > 0:
            raise ValueError(f"{name} must be positive")
    cands = candidates(inp, cache_bytes, splits)
    no_cache = cands[-1]
    if inp.n_moe_layers == 0 or no_cache.host_layers == 0:
        return CachePlan(no_cache, no_cache, cands, objective, inp.curve.source,
                         "every expert layer fits on the GPU: no cache needed")
    if cache_bytes is not None:
        sized = [c for c in cands if c.cache_bytes]
        if not sized:
            return CachePlan(no_cache, no_cache, cands, objective, inp.curve.source,
                             f"no cache: {cache_bytes // MIB} MiB (set by the topology) does not fit beside the "
                             f"always-used weights, or holds less than one token's experts per layer")
        pick = sized[0]
        return CachePlan(pick, no_cache, cands, objective, inp.curve.source,
                         f"{pick.cache_mib} MiB cache (set by the topology), {pick.gpu_layers} whole layers in "
                         f"the rest; predicted {pick.generation / no_cache.generation:.2f}x the generation "
                         f"of {no_cache.gpu_layers} whole layers without a cache")
    best_tg = max(c.generation for c in cands)
    best_pp = min(c.prompt_seconds for c in cands)
    what = f"{cands[0].streams} streams' aggregate generation" if cands[0].streams > 1 else "generation"
    if objective == "generation":
        near = [c for c in cands if c.generation >= (1 - GENERATION_TOLERANCE) * best_tg]
        pick = max(near, key=lambda c: (c.gpu_layers, c.generation))
        why = f"best {what} within {GENERATION_TOLERANCE:.0%} of the best, then the most whole layers"
    elif objective == "prompt":
        # without reads from the slots the fastest prompt is the most whole layers; with them every split copies
        # about the same bytes, and generation decides
        pick = max(cands, key=lambda c: (-round(c.prompt_seconds, 4), c.generation))
        why = f"the fastest prompts, then the best {what}"
    else:
        pick = max(cands, key=lambda c: math.sqrt(c.generation / best_tg * best_pp / c.prompt_seconds))
        why = f"best geometric mean of {what} and prompt speed"
    if pick.cache_bytes and pick.generation <= no_cache.generation * (1 + MIN_GAIN):
        return CachePlan(no_cache, no_cache, cands, objective, inp.curve.source,
                         f"no cache: predicted not to beat {no_cache.gpu_layers} whole layers "
                         f"({pick.generation:.1f} vs {no_cache.generation:.1f} tok/s)")
    if not pick.cache_bytes:
        return CachePlan(pick, no_cache, cands, objective, inp.curve.source, f"no cache ({why})")
    gain = pick.generation / no_cache.generation
    return CachePlan(pick, no_cache, cands, objective, inp.curve.source,
                     f"{pick.cache_mib} MiB cache, {pick.gpu_layers} whole layers: {why}; predicted "
                     f"{gain:.2f}x the generation of {no_cache.gpu_layers} whole layers without a cache")
