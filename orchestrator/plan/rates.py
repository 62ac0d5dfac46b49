"""Hardware rates the prediction uses when nothing was measured: documented estimates, never silent.

Every function returns (value, source) so the plan can say whether a number was measured or assumed.
"""

from __future__ import annotations

import re

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
# Copies from pageable (mmap'd) memory are several times slower: 7.6 GB/s vs 50 GB/s pinned on an H200 (Gen5).
PAGEABLE_FRACTION = 7.6 / 50.0


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


# Calibrated on the H200 machine (2026-11-29; docs/benchmarks.md, "Prediction"): Qwen3-30B-A3B q4_0 with 0, 18-20,
# 22 and 48 layers of experts in host memory and a Qwen3-235B-A22B shape with 8 of 24, measured with
# `orchestrator bench` and llama-bench. Generation: per token, bytes read on the GPU at GPU_TG_EFFICIENCY of the
# data-sheet bandwidth plus GPU_LAYER_OVERHEAD_S per layer (334 t/s all on the GPU); a layer whose experts are in
# host memory adds its expert bytes at CPU_TG_EFFICIENCY of the measured host bandwidth (53% of 98.7 GB/s) and
# CROSS_DEVICE_LAYER_OVERHEAD_S for the hop GPU -> CPU -> GPU (two unknowns, fitted on two layer sizes).
GPU_TG_EFFICIENCY = 0.6
CPU_TG_EFFICIENCY = 0.53
GPU_LAYER_OVERHEAD_S = 49e-6
CROSS_DEVICE_LAYER_OVERHEAD_S = 96e-6
# Without GPUs (lab/cpu_speed.py; docs/benchmarks.md, "Without a GPU"): generation time per token = the bytes read
# at CPU_ONLY_TG_EFFICIENCY of the probe's host bandwidth + CPU_LAYER_OVERHEAD_S per layer + CPU_TOKEN_OVERHEAD_S
# (least squares on the relative error over llama-bench runs of small and large models: the overhead-bound and
# the bandwidth-bound regimes; the fit leaves nothing per token); prompts: the matrix products at
# CPU_ONLY_PP_FLOPS_FACTOR x cpu_flops_per_core per thread + CPU_PP_LAYER_TOKEN_S per layer and token (norms, RoPE,
# routing, the gathering of each token's experts: what dominates small models) + attention (below). Fitted on one
# thread of a 2-core VM, the reference machine (tests/fixtures/calibration/cpu/speed-*.json.xz: prompts of 32, 512
# and 4096 tokens); the thread exponent on the H200's 16-core CPU runs (docs/benchmarks/h200-2026-12-02-cpu-calib,
# 1, 4 and 16 threads; `python -m lab.cpu_speed fit` over both). Kept apart from CPU_TG_EFFICIENCY and from the
# per-core table as the GPU path uses them, which were fitted with the GPU's costs beside them.
CPU_ONLY_TG_EFFICIENCY = 0.736
CPU_LAYER_OVERHEAD_S = 56.2e-6
CPU_TOKEN_OVERHEAD_S = 0.0
CPU_ONLY_PP_FLOPS_FACTOR = 3.84
CPU_PP_LAYER_TOKEN_S = 20.5e-6
# Prompts grow slower with their length (predict.cpu_pp_batch_seconds): attention costs CPU_PP_ATTN_MAC_S per
# multiply-add of a query against a position of its micro-batch's context (heads x (key + value width) per pair and
# layer), and the per-token work runs threads ** CPU_PP_THREAD_EXPONENT times faster on several threads. Every
# compute term is divided by the machine's cpu_rate: its prompt speed against the machine these were fitted on
# (1.0 there), which `orchestrator probe` measures (llama-bench on a small synthetic model, one core).
CPU_PP_ATTN_MAC_S = 62.7e-12
# What the reference machine does on the probe's measurement (the probe model's 512-token prompt, one core, as
# predicted there at cpu_rate 1): a machine's cpu_rate is its probe's tokens/s over this.
CPU_PROBE_REFERENCE_PP = 2250.0
# The per-core figure of cpu_flops_per_core for the reference machine (an AVX2-class core): with a measured
# cpu_rate, a CPU-only prompt's matrix products run at it x the rate, whatever the table says of the CPU's name.
CPU_REFERENCE_CORE_FLOPS = 25e9
CPU_PP_THREAD_EXPONENT = 0.68
# Prompts on the GPU, fitted on the H200 (docs/benchmarks/h200-2026-12-03-workload: W1 at 8, 12, 16 GiB and W2 at 24
# GiB, the plan with its cache and llama.cpp's --fit placement without one, pp512 and pp4096 at micro-batches of 512
# to 2048; lab/bench/fit_prompt_costs.py): a micro-batch's matrix products run at GPU_PP_FLOPS_EFFICIENCY of the data
# sheet's dense rate (q4_0 weights dequantised in the kernels); every layer costs it PP_LAYER_BATCH_S x b / (b +
# PP_LAYER_BATCH_HALF) beyond them (attention, norms, routing, launches: rising with the batch b and levelling off;
# the half-point taken from the 32- and 128-token prompts of h200-2026-11-29-bench); op offload copies the
# host-resident experts a batch uses at PINNED_COPY_EFFICIENCY of the probe's pinned bandwidth and costs
# OFFLOAD_LAYER_BATCH_S per host-resident layer (its split's synchronisation and the expert ids read back). Four
# unknowns with the slot reads below, least squares on the relative error; 22 points, each within 8%. From mmap'd
# pages the copies run at PAGEABLE_FRACTION.
# Op offload is never set below llama.cpp's own GGML_OP_OFFLOAD_MIN_BATCH default: the model above was fitted on
# batches of 512 and more (and checked at 32 and 128), while below 32 tokens no run compared copying with the CPU.
OP_OFFLOAD_MIN_BATCH_FLOOR = 32
GPU_PP_FLOPS_EFFICIENCY = 0.122
PP_LAYER_BATCH_S = 846e-6
PP_LAYER_BATCH_HALF = 128
PINNED_COPY_EFFICIENCY = 1.0
OFFLOAD_LAYER_BATCH_S = 136e-6
# Expert cache (--moe-cache-mib), fitted on the H200 (docs/benchmarks/h200-2026-12-01-w1-cache: W1 = Qwen3-30B-A3B
# q4_0 at 8/12/16 GiB, routing locality 0/default/high, 24 cache configurations, hit rates from llama-server's
# counters, generation sampled with llama-server's own top_k; lab/bench/fit_cache_costs.py): a token's misses are
# uploaded at CACHE_UPLOAD_EFFICIENCY of the probe's pinned bandwidth (one expert's three tensors per copy,
# in-stream), every host-resident layer costs CACHE_LAYER_OVERHEAD_S (the router's expert ids read back to the host,
# then slot bookkeeping) and the cache path CACHE_FIXED_S per token beyond the bytes (graph splits at every cached
# layer). Three unknowns, least squares on the relative error; every configuration within 7.5% of its measured
# generation.
CACHE_UPLOAD_EFFICIENCY = 0.755
CACHE_LAYER_OVERHEAD_S = 71e-6
CACHE_FIXED_S = 0.37e-3
# CACHE_LAYER_OVERHEAD_S is that of a build without --moe-cache-slots. One that has it (the device-slots patch) no longer drains the device before each cached
# split, so a host-resident layer costs less; with the slots assigned on the device (--moe-cache-slots device) the
# host's round trip per layer is gone too. Fitted on the H200 (docs/benchmarks/h200-2026-12-02-device-slots: W1 at
# 8 and 12 GiB, default locality, the plans for four streams, tg128 at one and four streams; the host assignment
# from the plan and its A/A control, the device one from its own start), with the upload efficiency and the fixed
# cost above held: least squares on the relative error of the step time, 4 points each; every point within 8%.
CACHE_LAYER_OVERHEAD_HOST_S = 40e-6
CACHE_LAYER_OVERHEAD_DEVICE_S = 19e-6
# Misses computed on the CPU (--moe-cache-cpu-misses), fitted on the plan's cache with CPU misses at 8/12/16 GiB
# (W1, default locality; shares from the profile's replay) on top of the three upload constants above: beyond the
# bytes, CACHE_CPU_MISS_HOP_S for each host-resident layer whose token has a CPU miss (the hop GPU -> CPU -> GPU)
# and CACHE_CPU_MISS_FIXED_S per token (least squares, three runs; each within 6%). On the H200 (PCIe Gen5) the
# mode ran at 0.67-0.80x of uploading the same misses. Before the patch ran such a split always in two parts it
# switched shape from token to token and lost its CUDA graphs: 4.5 ms per token then, 0.26 ms now.
CACHE_CPU_MISS_FIXED_S = 0.26e-3
CACHE_CPU_MISS_HOP_S = 105e-6
# Several streams decoding together share each bank of slots. A stream's hit rate at N streams is the single-stream
# curve at (cached fraction x (k / U(N)) ** STREAM_SHARE_EXPONENT), U(N) the distinct experts of a step of N tokens
# (plan/expert_cache.py). Taken from one H200 measurement: W1 at 12 GiB (the plan's 38 slots of 128 per layer,
# default locality) serving four streams through `up` exported a hit ratio of 0.70 where one stream hits 0.886;
# the profile's curve gives 0.70 at 0.149 of the experts, half the cached 0.297, and k / U(4) = 8 / 29.1.
STREAM_SHARE_EXPONENT = 0.54
# Prompts that read the cached experts from the slots (--moe-cache-prefill read|refresh) instead of copying them over
# PCIe: each cached expert of a layer a batch uses is moved on the device by one kernel per tensor (the prompts patch's move call) and
# costs PREFILL_READ_OVERHEAD_S instead of its copy (PREFILL_READ_SAVING: all of it saved). Fitted with the prompt
# costs above; the slot reads' share from the cache's counters (29-47% of the experts read, each plan's cached
# fraction within a point). Before that call each read was a copy of its own and saved 59% less 36 us.
PREFILL_READ_SAVING = 1.0
PREFILL_READ_OVERHEAD_S = 12.3e-6
# Prompts staged (--moe-cache-prefill-ahead N, the prompts patch): a micro-batch through op offload that is expected to use
# all but PREFILL_STAGE_UNUSED_MAX of a host-resident tensor's experts (the patch's rule) gets the uncached ones
# copied ahead into N staging buffers on a second stream while the layers before compute; the split then waits only
# for what is left. PREFILL_STAGED_OVERLAP is the share of min(copy time, the rest of the micro-batch up to the last
# host-resident layer: what the copies can run beside) hidden. Fitted
# on the H200 (docs/benchmarks/h200-2026-12-03-staged and h200-2026-12-04-staged: W1 at 8, 12 and 16 GiB and W2 at
# 24 GiB, each plan with and without two buffers, interleaved in one run, and three buffers once at 12 GiB), least
# squares on the relative error of the 14 staged prompts through the prompt model above, each run's slot share from
# its counters (lab/bench/fit_staged_overlap.py): W1's within 10%, W2's pp4096 13% slow (unstaged 10%). Three buffers
# were no faster than two at 512 tokens and take another buffer's slots: PREFILL_STAGE_BUFFERS is what the plan asks.
# The buffers' slots cost generation less than the hit-rate curve says of so many slots fewer: over the same five
# pairs generation went 0.96-1.01x (W1 0.98-1.01x, W2 0.96x) where the curve at the fewer slots predicted 0.92-0.97x,
# and the hit rates fell 0.1-1.7 points where it said 1.0-6.0. PREFILL_STAGE_SLOT_COST is the share of the buffers'
# bytes the plan takes from the slots when it predicts staged generation (least squares on the five ratios).
# The patch's rule assumes uniform routing; where the routing was measured, the plan applies the same share to the
# profile's distinct experts per window and passes the smallest micro-batch that meets it
# (--moe-cache-prefill-ahead-min-batch, the prompts patch; predict.staging_min_batch): a 128-token window of W1's and W2's
# traces uses 91 and 84 of their 128 experts.
PREFILL_STAGE_UNUSED_MAX = 1.0 / 16.0
PREFILL_STAGED_OVERLAP = 0.79
PREFILL_STAGE_BUFFERS = 2
PREFILL_STAGE_SLOT_COST = 0.28
# Uploads ahead of need (--moe-cache-prefetch), measured on the H200 with W1 at default locality, 12 GiB, the plan for
# four streams (docs/benchmarks.md, "Uploads ahead of need"): of the misses without them, the share they turned into
# hits, and the uploads ahead per such miss, at one stream and at four (the next layer's router on this layer's
# hidden state predicted 76% / 79% of the picks; a wrong guess is an upload, and a slot taken).
PREFETCH_MISS_CUT = {1: 0.660, 4: 0.567}
PREFETCH_UPLOADS_PER_MISS = {1: 0.861, 4: 1.048}
# The share of the uploads ahead's link time hidden behind compute, fitted on the same runs (one start each of the
# plan, its A/A control and the plan with them): at one stream generation went from 136.5 (plan and control) to
# 130 tokens/s, every uploaded byte on the critical path (the fit gives -0.04, taken as 0): the GPU's work between
# one layer's expert ids and the next is tens of microseconds, the host's round trip per layer the rest. At four
# streams 195 -> 179 tokens/s: a third hidden (each layer computes the union of four tokens' experts).
PREFETCH_OVERLAP = {1: 0.0, 4: 0.32}
# Architectures whose graph in our patch predicts the next layer's experts (llama.cpp's arch names)
PREFETCH_ARCHS = frozenset({"qwen3moe"})
