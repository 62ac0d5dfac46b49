"""Hardware rates the prediction uses when nothing was measured: documented estimates, never silent.

Every function returns (value, source) so the plan can say whether a number was measured or assumed. The constants
of the speed model fitted or measured on recorded runs are read from orchestrator/_data/rates.json, where each one
carries its unit, the runs it comes from and the lab script that fits it again; the comments here say what each
one means in the model.
"""

from __future__ import annotations

import re

from orchestrator.fitted_rates import by_streams as _fitted_by_streams
from orchestrator.fitted_rates import value as _fitted

GB = 1e9

# Peak memory bandwidth by GPU name (vendor data sheets). Matched by regex on the NVML name, first hit wins.
_GPU_MEM_BW = [
    (r"H200", 4.8e12), (r"H100.*(SXM|HBM3)", 3.35e12), (r"H100.*NVL", 3.9e12), (r"H100", 2.0e12),
    (r"GH200", 4.0e12), (r"B200", 8.0e12), (r"B100", 8.0e12),
    (r"A100.*80", 2.0e12), (r"A100", 1.555e12), (r"A800", 2.0e12), (r"A40\b", 0.696e12), (r"A30\b", 0.933e12),
    (r"L40S", 0.864e12), (r"L40\b", 0.864e12), (r"L4\b", 0.3e12), (r"A10\b", 0.6e12),
    (r"RTX PRO 6000", 1.79e12), (r"5090", 1.79e12), (r"5080", 0.96e12), (r"4090", 1.008e12), (r"4080", 0.717e12),
    (r"3090", 0.936e12), (r"3080", 0.76e12), (r"A6000", 0.768e12), (r"6000 Ada", 0.96e12), (r"V100", 0.9e12),
    (r"T4\b", 0.32e12), (r"MI300", 5.3e12), (r"MI250", 3.2e12),
]

# Dense fp16/bf16 tensor throughput (FLOP/s), used for prompt-processing compute time on the GPU.
_GPU_FLOPS = [
    (r"H200|H100|GH200", 700e12), (r"B200|B100", 1500e12), (r"A100|A800", 280e12), (r"L40S", 330e12),
    (r"5090|RTX PRO 6000", 380e12), (r"4090", 300e12), (r"3090", 130e12), (r"A6000", 140e12), (r"V100", 110e12),
]

# Pinned host->device copy bandwidth by PCIe generation for an x16 link (measured-typical, not the line rate).
_PCIE_PINNED_X16 = {3: 12.5 * GB, 4: 25 * GB, 5: 50 * GB, 6: 100 * GB}
# Copies from pageable (mmap'd) memory are several times slower than from pinned memory: this share of them.
PAGEABLE_FRACTION = _fitted("PAGEABLE_FRACTION")


def gpu_memory_bandwidth(name: str | None) -> tuple[float, str]:
    for rx, bw in _GPU_MEM_BW:
        if name and re.search(rx, name, re.I):
            return bw, f"data sheet ({name})"
    return 0.5e12, "assumed 500 GB/s (unknown GPU)"


def gpu_flops(name: str | None) -> tuple[float, str]:
    for rx, f in _GPU_FLOPS:
        if name and re.search(rx, name, re.I):
            return f, f"data sheet ({name})"
    return 100e12, "assumed 100 TFLOP/s (unknown GPU)"


def pcie_pinned_bandwidth(gen: int | None, width: int | None) -> tuple[float, str]:
    if gen in _PCIE_PINNED_X16:
        w = width or 16
        return _PCIE_PINNED_X16[gen] * min(w, 16) / 16, f"PCIe Gen{gen} x{w} typical"
    return 12.5 * GB, "assumed PCIe Gen3 x16 (link unknown)"


def host_memory_bandwidth_default(n_nodes: int) -> tuple[float, str]:
    """Per-node STREAM-like read bandwidth when not measured (a conservative server figure)."""
    return 60 * GB, "assumed 60 GB/s per NUMA node (run `orchestrator probe` to measure)"


def cpu_flops_per_core(cpu_model: str | None) -> tuple[float, str]:
    """Effective quantized-matmul FLOP/s per core for prompt processing on the CPU (llama.cpp, q4/q8)."""
    m = cpu_model or ""
    if re.search(r"Xeon.*(Platinum|Gold|Silver|Max).*(8[4-9]\d\d|6[4-9]\d\d|4[4-9]\d\d)|Sapphire|Emerald|Granite",
                 m, re.I):
        return 60e9, f"AVX-512/AMX-class core ({m})"
    if re.search(r"EPYC.*9\d\d\d|Zen ?[45]|Threadripper.*(7\d\d\d|9\d\d\d)", m, re.I):
        return 50e9, f"AVX-512-class core ({m})"
    return 25e9, f"assumed AVX2-class core ({m or 'unknown CPU'})"


# Generation on a GPU worker: per token, bytes read on the GPU at GPU_TG_EFFICIENCY of the data-sheet bandwidth plus
# GPU_LAYER_OVERHEAD_S per layer; a layer whose experts are in host memory adds its expert bytes at CPU_TG_EFFICIENCY
# of the measured host bandwidth and CROSS_DEVICE_LAYER_OVERHEAD_S for the hop GPU -> CPU -> GPU.
GPU_TG_EFFICIENCY = _fitted("GPU_TG_EFFICIENCY")
CPU_TG_EFFICIENCY = _fitted("CPU_TG_EFFICIENCY")
GPU_LAYER_OVERHEAD_S = _fitted("GPU_LAYER_OVERHEAD_S")
CROSS_DEVICE_LAYER_OVERHEAD_S = _fitted("CROSS_DEVICE_LAYER_OVERHEAD_S")
# Without GPUs (lab/cpu_speed.py): generation time per token = the bytes read at CPU_ONLY_TG_EFFICIENCY of the
# probe's host bandwidth + CPU_LAYER_OVERHEAD_S per layer + CPU_TOKEN_OVERHEAD_S (least squares on the relative error
# over llama-bench runs of small and large models: the overhead-bound and the bandwidth-bound regimes); prompts: the
# matrix products at CPU_ONLY_PP_FLOPS_FACTOR x cpu_flops_per_core per thread + CPU_PP_LAYER_TOKEN_S per layer and
# token (norms, RoPE, routing, the gathering of each token's experts: what dominates small models) + attention
# (below). Fitted on one thread of the reference machine (a 2-core VM) and, for the thread exponent, on a 16-core
# server. Kept apart from CPU_TG_EFFICIENCY and from the per-core table as the GPU path uses them, which were fitted
# with the GPU's costs beside them.
CPU_ONLY_TG_EFFICIENCY = _fitted("CPU_ONLY_TG_EFFICIENCY")
CPU_LAYER_OVERHEAD_S = _fitted("CPU_LAYER_OVERHEAD_S")
CPU_TOKEN_OVERHEAD_S = _fitted("CPU_TOKEN_OVERHEAD_S")
# The per-layer cost of generation grows with the worker's threads (ggml's threads meet at a barrier after every op
# of the graph, and more of them take longer to meet): CPU_LAYER_OVERHEAD_S x threads ** CPU_LAYER_THREAD_EXPONENT,
# fitted on runs where the threads are the node's every core (there the probe's all-core bandwidth is what they read;
# fewer threads read less, which the model does not have: docs/benchmarks.md, "Without a GPU").
CPU_LAYER_THREAD_EXPONENT = _fitted("CPU_LAYER_THREAD_EXPONENT")
CPU_ONLY_PP_FLOPS_FACTOR = _fitted("CPU_ONLY_PP_FLOPS_FACTOR")
CPU_PP_LAYER_TOKEN_S = _fitted("CPU_PP_LAYER_TOKEN_S")
# Prompts grow slower with their length (predict.cpu_pp_batch_seconds): attention costs CPU_PP_ATTN_MAC_S per
# multiply-add of a query against a position of its micro-batch's context (heads x (key + value width) per pair and
# layer), and the per-token work runs threads ** CPU_PP_THREAD_EXPONENT times faster on several threads (fitted on
# prompts of 512 tokens and more: shorter ones are bound by reading the experts at the threads' bandwidth). Every
# compute term is divided by the machine's cpu_rate: its prompt speed against the machine these were fitted on
# (1.0 there), which `orchestrator probe` measures (llama-bench on a small synthetic model, one core).
CPU_PP_ATTN_MAC_S = _fitted("CPU_PP_ATTN_MAC_S")
# What the reference machine does on the probe's measurement (the probe model's 512-token prompt, one core, as
# predicted there at cpu_rate 1): a machine's cpu_rate is its probe's tokens/s over this.
CPU_PROBE_REFERENCE_PP = _fitted("CPU_PROBE_REFERENCE_PP")
# The per-core figure of cpu_flops_per_core for the reference machine (an AVX2-class core): with a measured
# cpu_rate, a CPU-only prompt's matrix products run at it x the rate, whatever the table says of the CPU's name.
CPU_REFERENCE_CORE_FLOPS = 25e9
CPU_PP_THREAD_EXPONENT = _fitted("CPU_PP_THREAD_EXPONENT")
# Every prompt term leaves out the last layer's feed-forward where llama.cpp's graph runs it for the output token
# only (costs.prompt_skip_ffn_layer: its experts are neither multiplied nor copied for the micro-batch); the fits
# below count it so too, or the six-layer cuts they were fitted on would price every matrix product low.
# Prompts on the GPU (lab/bench/fit_prompt_costs.py): a micro-batch's matrix products run at GPU_PP_FLOPS_EFFICIENCY
# of the data sheet's dense rate (q4_0 weights dequantised in the kernels); every layer costs it PP_LAYER_BATCH_S x
# b / (b + PP_LAYER_BATCH_HALF) beyond them (attention, norms, routing, launches: rising with the batch b and
# levelling off); op offload copies the host-resident experts a batch uses at PINNED_COPY_EFFICIENCY of the probe's
# pinned bandwidth and costs OFFLOAD_LAYER_BATCH_S per host-resident layer (its split's synchronisation and the
# expert ids read back). Four unknowns with the slot reads below, least squares on the relative error. From mmap'd
# pages the copies run at PAGEABLE_FRACTION.
# Op offload is never set below llama.cpp's own GGML_OP_OFFLOAD_MIN_BATCH default: the model above was fitted on
# batches of 512 and more (and checked at 32 and 128), while below 32 tokens no run compared copying with the CPU.
OP_OFFLOAD_MIN_BATCH_FLOOR = 32
GPU_PP_FLOPS_EFFICIENCY = _fitted("GPU_PP_FLOPS_EFFICIENCY")
PP_LAYER_BATCH_S = _fitted("PP_LAYER_BATCH_S")
PP_LAYER_BATCH_HALF = int(_fitted("PP_LAYER_BATCH_HALF"))
# held at the probe's pinned bandwidth in the fit (not fitted)
PINNED_COPY_EFFICIENCY = 1.0
OFFLOAD_LAYER_BATCH_S = _fitted("OFFLOAD_LAYER_BATCH_S")
# Expert cache (--moe-cache-mib; lab/bench/fit_cache_costs.py): a token's misses are uploaded at
# CACHE_UPLOAD_EFFICIENCY of the probe's pinned bandwidth (one expert's three tensors per copy, in-stream), every
# host-resident layer costs CACHE_LAYER_OVERHEAD_S (the router's expert ids read back to the host, then slot
# bookkeeping) and the cache path CACHE_FIXED_S per token beyond the bytes (graph splits at every cached layer).
# Three unknowns, least squares on the relative error of the generation of each cache configuration.
CACHE_UPLOAD_EFFICIENCY = _fitted("CACHE_UPLOAD_EFFICIENCY")
CACHE_LAYER_OVERHEAD_S = _fitted("CACHE_LAYER_OVERHEAD_S")
CACHE_FIXED_S = _fitted("CACHE_FIXED_S")
# CACHE_LAYER_OVERHEAD_S is that of a build without --moe-cache-slots. One that has it (the device-slots patch) no
# longer drains the device before each cached split, so a host-resident layer costs less; with the slots assigned on
# the device (--moe-cache-slots device) the host's round trip per layer is gone too. Fitted with the upload
# efficiency and the fixed cost above held.
CACHE_LAYER_OVERHEAD_HOST_S = _fitted("CACHE_LAYER_OVERHEAD_HOST_S")
CACHE_LAYER_OVERHEAD_DEVICE_S = _fitted("CACHE_LAYER_OVERHEAD_DEVICE_S")
# Misses computed on the CPU (--moe-cache-cpu-misses), fitted on top of the three upload constants above with the
# shares the routing profile replays: beyond the bytes, CACHE_CPU_MISS_HOP_S for each host-resident layer whose token
# has a CPU miss (the hop GPU -> CPU -> GPU) and CACHE_CPU_MISS_FIXED_S per token. The patch runs such a split always
# in two parts; before, it switched shape from token to token and lost its CUDA graphs, which cost far more per token.
CACHE_CPU_MISS_FIXED_S = _fitted("CACHE_CPU_MISS_FIXED_S")
CACHE_CPU_MISS_HOP_S = _fitted("CACHE_CPU_MISS_HOP_S")
# Several streams decoding together share each bank of slots. A stream's hit rate at N streams is the single-stream
# curve at (cached fraction x (k / U(N)) ** STREAM_SHARE_EXPONENT), U(N) the distinct experts of a step of N tokens
# (plan/expert_cache.py).
STREAM_SHARE_EXPONENT = _fitted("STREAM_SHARE_EXPONENT")
# Prompts that read the cached experts from the slots (--moe-cache-prefill read|refresh) instead of copying them over
# PCIe: each cached expert of a layer a batch uses is moved on the device by one kernel per tensor (the prompts
# patch's move call) and costs PREFILL_READ_OVERHEAD_S instead of its copy (PREFILL_READ_SAVING: all of it saved).
# Fitted with the prompt costs above; the slot reads' share from the cache's counters.
PREFILL_READ_SAVING = 1.0
PREFILL_READ_OVERHEAD_S = _fitted("PREFILL_READ_OVERHEAD_S")
# Prompts staged (--moe-cache-prefill-ahead N, the prompts patch): a micro-batch through op offload that is expected
# to use all but PREFILL_STAGE_UNUSED_MAX of a host-resident tensor's experts (the patch's rule) gets the uncached ones
# copied ahead into N staging buffers on a second stream while the layers before compute; the split then waits only
# for what is left. PREFILL_STAGED_OVERLAP is the share of min(copy time, the rest of the micro-batch up to the last
# host-resident layer: what the copies can run beside) hidden (lab/bench/fit_staged_overlap.py: least squares on the
# relative error of the staged prompts through the prompt model above, each run's slot share from its counters).
# Three buffers were no faster than two at 512 tokens and take another buffer's slots: PREFILL_STAGE_BUFFERS is what
# the plan asks. The buffers' slots cost generation less than the hit-rate curve says of so many slots fewer:
# PREFILL_STAGE_SLOT_COST is the share of the buffers' bytes the plan takes from the slots when it predicts staged
# generation (least squares on the measured staged ÷ unstaged generation).
# The patch's rule assumes uniform routing; where the routing was measured, the plan applies the same share to the
# profile's distinct experts per window and passes the smallest micro-batch that meets it
# (--moe-cache-prefill-ahead-min-batch, the prompts patch; predict.staging_min_batch).
PREFILL_STAGE_UNUSED_MAX = 1.0 / 16.0
PREFILL_STAGED_OVERLAP = _fitted("PREFILL_STAGED_OVERLAP")
PREFILL_STAGE_BUFFERS = 2
PREFILL_STAGE_SLOT_COST = _fitted("PREFILL_STAGE_SLOT_COST")
# Uploads ahead of need (--moe-cache-prefetch), by the number of streams decoding together: of the misses without
# them, the share they turned into hits, and the uploads ahead per such miss (the next layer's router on this layer's
# hidden state predicts most but not all picks; a wrong guess is an upload, and a slot taken).
PREFETCH_MISS_CUT = _fitted_by_streams("PREFETCH_MISS_CUT")
PREFETCH_UPLOADS_PER_MISS = _fitted_by_streams("PREFETCH_UPLOADS_PER_MISS")
# The share of the uploads ahead's link time hidden behind compute: at one stream every uploaded byte stayed on the
# critical path where measured (the GPU's work between one layer's expert ids and the next is tens of microseconds,
# the host's round trip per layer the rest); at four streams each layer computes the union of four tokens' experts.
PREFETCH_OVERLAP = _fitted_by_streams("PREFETCH_OVERLAP")
# Architectures whose graph in our patch predicts the next layer's experts (llama.cpp's arch names)
PREFETCH_ARCHS = frozenset({"qwen3moe"})
