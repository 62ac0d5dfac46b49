"""Where every tensor goes: always-used weights on GPUs first, routed experts fill what is left by whole layers,
the rest in host memory. Pure arithmetic on byte counts; the regexes llama.cpp reads are rendered here too.
"""

from __future__ import annotations


import numpy as np
from dataclasses import dataclass
from typing import Iterable, Sequence

from orchestrator.plan.costs import ModelCosts

EXPERT_TENSOR_RX = r"ffn_(up|down|gate|gate_up)_(ch|)exps"


@dataclass(frozen=True)
class GpuBudget:
    index: int            # machine GPU index
    name: str
    budget: int           # bytes the weights + KV may take (reserve, CUDA context and compute buffer already deducted)


@dataclass(frozen=True)
class Placement:
    split_mode: str                          # "none" | "layer" | "tensor" | "graph"
    n_gpu_layers: int                        # layers (of n_layers) whose always-used part is on a GPU
    layer_gpu: tuple[int | None, ...]        # per layer: position in the worker's GPU list, None = CPU
    experts_on_gpu: tuple[bool, ...]         # per layer: routed experts in VRAM?
    tensor_split: tuple[int, ...] = ()       # -ts values (layer counts for "layer"; proportions otherwise)
    gpu_weights: tuple[int, ...] = ()        # per worker GPU: weight bytes
    gpu_kv: tuple[int, ...] = ()             # per worker GPU: KV bytes
    cpu_weights: int = 0
    cpu_kv: int = 0

    @property
    def cpu_expert_layers(self) -> tuple[int, ...]:
        return tuple(i for i, on in enumerate(self.experts_on_gpu) if not on)


def _fits_experts(costs: ModelCosts, layers: list[int], room: int) -> set[int]:
    """The MoE layers (of ``layers``) whose experts go to VRAM given ``room`` bytes: the most bytes, whole layers.

    Every routed-expert layer is read at the same rate per token (n_used/n_expert of its bytes), so keeping the
    most expert bytes in VRAM is what minimises CPU-resident bytes read per token. Layers are taken from the
    last one down (llama.cpp's --n-cpu-moe keeps the first layers on the CPU: same shape, comparable runs),
    skipping a layer that doesn't fit so a smaller one may.
    """
    chosen: set[int] = set()
    for i in sorted(layers, reverse=True):
        e = costs.layer_experts[i]
        if e <= 0:
            continue
        if e <= room:
            chosen.add(i)
            room -= e
    return chosen


def place_cpu_only(costs: ModelCosts, kv_layer: list[int]) -> Placement:
    n = costs.n_layers
    return Placement(split_mode="none", n_gpu_layers=0, layer_gpu=(None,) * n, experts_on_gpu=(False,) * n,
                     cpu_weights=costs.total_bytes, cpu_kv=sum(kv_layer))


def place_single(costs: ModelCosts, kv_layer: list[int], gpu: GpuBudget,
                 forced_cpu_layers: tuple[int, ...] | None = None) -> Placement:
    """One GPU: -ngl all when the always-used part, output and KV fit, experts by whole layers in what is left;
    otherwise as many whole (last) layers as fit, with the experts of every layer on the CPU."""
    n = costs.n_layers
    layers = list(range(n))
    always = sum(costs.layer_always) + costs.output_bytes + sum(kv_layer)
    if always <= gpu.budget:
        if forced_cpu_layers is not None:
            on_gpu = set(layers) - set(forced_cpu_layers)
        else:
            on_gpu = _fits_experts(costs, layers, gpu.budget - always)
        exp_flags = tuple(i in on_gpu or costs.layer_experts[i] == 0 for i in layers)
        gpu_w = sum(costs.layer_always) + costs.output_bytes + sum(costs.layer_experts[i] for i in on_gpu)
        return Placement(
            split_mode="none", n_gpu_layers=n + 1, layer_gpu=(0,) * n, experts_on_gpu=exp_flags,
            gpu_weights=(gpu_w,), gpu_kv=(sum(kv_layer),),
            cpu_weights=costs.input_bytes + sum(costs.layer_experts[i] for i in layers if not exp_flags[i]),
            cpu_kv=0,
        )
    # partial offload: the last k layers (always-used part + KV) on the GPU, experts and the rest on the CPU
    if gpu.budget <= 0:
        raise _DoesNotFit(always, gpu.budget)
    room = gpu.budget
    k = 0
    for i in reversed(layers):
        need = costs.layer_always[i] + kv_layer[i]
        if need > room:
            break
        room -= need
        k += 1
    if k == 0:
        raise _DoesNotFit(always, gpu.budget)
    start = n - k
    gpu_layers = set(range(start, n))
    gpu_w = sum(costs.layer_always[i] for i in gpu_layers)
    return Placement(
        split_mode="none", n_gpu_layers=k, layer_gpu=tuple(0 if i in gpu_layers else None for i in layers),
        experts_on_gpu=tuple(costs.layer_experts[i] == 0 and i in gpu_layers for i in layers),
        gpu_weights=(gpu_w,), gpu_kv=(sum(kv_layer[i] for i in gpu_layers),),
        cpu_weights=costs.total_bytes - gpu_w, cpu_kv=sum(kv_layer[i] for i in layers if i not in gpu_layers),
    )


def place_layer_split(costs: ModelCosts, kv_layer: list[int], gpus: list[GpuBudget]) -> Placement:
    """Several GPUs, ``-sm layer``: contiguous layer ranges per GPU (rendered as integer ``-ts`` counts, which
    llama.cpp turns into exactly these ranges), each GPU keeping the experts of as many of its own layers as fit.

    The ranges maximise the expert bytes kept in VRAM, then balance the fullest GPU (dynamic programming over
    range boundaries; prefix sums keep it O(G * L^2 * log L)).
    """
    n = costs.n_layers
    g_count = len(gpus)
    base = [costs.layer_always[i] + kv_layer[i] for i in range(n)]
    pre_base = [0]
    for b in base:
        pre_base.append(pre_base[-1] + b)

    pre_exp = [0]
    for e in costs.layer_experts:
        pre_exp.append(pre_exp[-1] + e)

    # dp over GPUs and range ends, vectorised over range starts: value = (expert bytes kept in VRAM, -fullest
    # GPU's fill); back-pointers rebuild the ranges
    pb = np.asarray(pre_base, dtype=np.float64)
    pe = np.asarray(pre_exp, dtype=np.float64)
    NEG_INF = -1.0
    val = np.full((g_count + 1, n + 1), NEG_INF)
    fill = np.zeros((g_count + 1, n + 1))
    back = np.zeros((g_count + 1, n + 1), dtype=np.int64)
    val[0, 0] = 0.0
    I = np.arange(n + 1)[:, None]          # range start i (rows)
    J = np.arange(n + 1)[None, :]          # range end j (columns)
    for g in range(1, g_count + 1):
        budget = float(gpus[g - 1].budget - (costs.output_bytes if g == g_count else 0))
        need = pb[None, :] - pb[:, None]                       # need[i, j]: always-used bytes of layers [i, j)
        ok = (I <= J) & (need <= budget) & (val[g - 1][:, None] >= 0)
        if g == g_count:
            ok &= J == n
        room = budget - need
        s_idx = np.searchsorted(pe, pe[None, :] - room, side="left")
        s_idx = np.minimum(np.maximum(s_idx, I), J)
        kept = np.where(I == J, 0.0, pe[None, :] - pe[s_idx])
        util = np.where(I == J, 0.0, (need + kept) / budget if budget > 0 else 1.0)
        tot = np.where(ok, val[g - 1][:, None] + kept, NEG_INF)
        worst = np.where(ok, np.maximum(fill[g - 1][:, None], util), np.inf)
        best = tot.max(axis=0)                                   # per j
        tie = tot >= (best[None, :] - 0.5)                       # equal expert bytes: least-full worst GPU
        k = np.argmin(np.where(tie & ok, worst, np.inf), axis=0)
        cols = np.arange(n + 1)
        have = best >= 0
        val[g] = np.where(have, tot[k, cols], NEG_INF)
        fill[g] = np.where(have, worst[k, cols], 0.0)
        back[g] = k
    if val[g_count, n] < 0:
        return _layer_split_fallback(costs, kv_layer, gpus)
    ends = [n]
    for g in range(g_count, 0, -1):
        ends.append(int(back[g, ends[-1]]))
    bounds = tuple(reversed(ends))
    gpu_experts: set[int] = set()
    for g in range(g_count):
        i, j = bounds[g], bounds[g + 1]
        budget = gpus[g].budget - (costs.output_bytes if g == g_count - 1 else 0)
        room = budget - (pre_base[j] - pre_base[i])
        gpu_experts |= _fits_experts(costs, list(range(i, j)), room)
    cpu_layers = tuple(k for k in range(n) if costs.layer_experts[k] and k not in gpu_experts)
    return layer_split_placement(costs, kv_layer, [bounds[g + 1] - bounds[g] for g in range(g_count)], cpu_layers)


def layer_split_placement(costs: ModelCosts, kv_layer: list[int], layers_per_gpu: Sequence[int],
                          cpu_expert_layers: Iterable[int]) -> Placement:
    """The ``-sm layer`` placement with ``layers_per_gpu[g]`` consecutive layers on GPU g (the output layer on the
    last) and the routed experts of ``cpu_expert_layers`` in host memory: what a recorded ``-ts``/``-ot`` ran."""
    n = costs.n_layers
    if sum(layers_per_gpu) != n or any(c < 0 for c in layers_per_gpu):
        raise ValueError(f"layers per GPU {list(layers_per_gpu)} do not add up to the model's {n} layers")
    on_cpu = set(cpu_expert_layers)
    layer_gpu: list[int | None] = [None] * n
    exp_on = [costs.layer_experts[i] == 0 or i not in on_cpu for i in range(n)]
    gpu_w, gpu_kv = [], []
    start = 0
    last = len(layers_per_gpu) - 1
    for g, count in enumerate(layers_per_gpu):
        rng = range(start, start + count)
        for k in rng:
            layer_gpu[k] = g
        gpu_w.append(sum(costs.layer_always[k] + (costs.layer_experts[k] if exp_on[k] else 0) for k in rng)
                     + (costs.output_bytes if g == last else 0))
        gpu_kv.append(sum(kv_layer[k] for k in rng))
        start += count
    counts = list(layers_per_gpu)
    counts[-1] += 1  # the output layer (index n_layers) goes to the last GPU
    cpu_w = costs.input_bytes + sum(costs.layer_experts[k] for k in range(n) if not exp_on[k])
    return Placement(split_mode="layer", n_gpu_layers=n + 1, layer_gpu=tuple(layer_gpu), experts_on_gpu=tuple(exp_on),
                     tensor_split=tuple(counts), gpu_weights=tuple(gpu_w), gpu_kv=tuple(gpu_kv), cpu_weights=cpu_w)


def _layer_split_fallback(costs: ModelCosts, kv_layer: list[int], gpus: list[GpuBudget]) -> Placement:
    """Not even the always-used part fits across the GPUs: raise through the planner with the numbers."""
    raise _DoesNotFit(sum(costs.layer_always) + costs.output_bytes + sum(kv_layer), sum(g.budget for g in gpus))


class _DoesNotFit(Exception):
    def __init__(self, need: int, have: int):
        super().__init__(need, have)
        self.need, self.have = need, have


def place_graph_split(costs: ModelCosts, kv_layer: list[int], gpus: list[GpuBudget], mode: str,
                      forced_cpu_layers: tuple[int, ...] | None = None) -> Placement:
    """Several GPUs working on every layer at once (ik_llama.cpp ``-sm graph``, mainline ``-sm tensor``): weights
    and KV split in proportion to ``-ts``, which is set to each GPU's budget; experts overflow by whole layers."""
    n = costs.n_layers
    total_budget = sum(g.budget for g in gpus)
    always = sum(costs.layer_always) + costs.output_bytes + sum(kv_layer)
    if always > total_budget:
        raise _DoesNotFit(always, total_budget)
    if forced_cpu_layers is not None:
        on_gpu = set(range(n)) - set(forced_cpu_layers)
    else:
        on_gpu = _fits_experts(costs, list(range(n)), total_budget - always)
    exp_on = tuple(i in on_gpu or costs.layer_experts[i] == 0 for i in range(n))
    weights = sum(costs.layer_always) + costs.output_bytes + sum(costs.layer_experts[i] for i in on_gpu)
    shares = [g.budget / total_budget for g in gpus]
    gib = 1 << 30
    ts = tuple(max(1, round(g.budget / gib)) for g in gpus)
    return Placement(split_mode=mode, n_gpu_layers=n + 1, layer_gpu=tuple(0 for _ in range(n)), experts_on_gpu=exp_on,
                     tensor_split=ts, gpu_weights=tuple(int(weights * s) for s in shares),
                     gpu_kv=tuple(int(sum(kv_layer) * s) for s in shares),
                     cpu_weights=costs.input_bytes + sum(costs.layer_experts[i] for i in range(n) if not exp_on[i]))


# --- rendering -------------------------------------------------------------------------------------------------

def layer_alternation(layers) -> str:
    """``(0|1|2|10)`` — alternation of layer numbers, safe under std::regex (ECMAScript)."""
    return "(" + "|".join(str(i) for i in sorted(layers)) + ")"


def cpu_expert_override(layers, weights_only: bool = False) -> tuple[tuple[str, str], ...]:
    """The tensor override (pattern, buffer type) sending the routed experts of ``layers`` to host memory; none
    when there are none. ``weights_only``: only the tensors the experts' MUL_MAT_IDs read (``.weight``); their
    other tensors (gpt-oss's biases) stay with the layer on its GPU.

    ``blk\\.(0|1)\\.ffn_...`` cannot match ``blk.10.``: the layer number is followed by a literal dot.
    """
    layers = sorted(layers)
    if not layers:
        return ()
    return ((f"blk\\.{layer_alternation(layers)}\\.{EXPERT_TENSOR_RX}" + ("\\.weight" if weights_only else ""),
             "CPU"),)


def matches(pattern: str, name: str) -> bool:
    """How llama.cpp applies one -ot pattern (std::regex_search); Python's re agrees for the patterns we emit."""
    import re

    return re.search(pattern, name) is not None
