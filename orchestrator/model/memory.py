"""Memory model: what llama.cpp allocates for a model beyond its weights -- KV cache, compute buffers, output
buffer -- and the CUDA context, as pure functions of the model and the server settings. Bytes everywhere.

Rules read in mainline llama.cpp (late 2026) and checked against its load logs (tests/fixtures/calibration):

KV cache (``src/llama-context.cpp``, ``src/llama-kv-cache*.cpp``, ``llama_model::create_memory``)
  - ``n_ctx`` is padded up to a multiple of 256. With ``--kv-unified`` one stream of ``n_ctx`` cells is shared by
    all sequences; otherwise each of the ``-np`` sequences gets its own stream of
    ``n_ctx_seq = pad256(n_ctx / np)`` cells (and ``n_ctx`` becomes ``np * n_ctx_seq``).
    llama-server without ``-np`` uses 4 slots and a unified cache.
  - per layer and stream: K is ``row_size(type_k, head_dim_k * n_head_kv(layer))`` per cell, V likewise; MLA
    models (deepseek2 with ``key_length_mla``) store K only: one ``kv_lora_rank + rope`` latent per cell.
    Without flash attention V is stored transposed and padded to the widest layer.
  - sliding-window layers get ``pad256(min(n_ctx_seq, n_swa * (np if unified else 1) + n_ubatch))`` cells
    (``--swa-full``: the full size).
  - NextN/MTP layers have no cache in the main context.
  - ik_llama.cpp: one unified stream, ``n_ctx`` padded to 256 with flash attention (32 without), no reduced
    SWA cache, MLA K-only with flash attention.

Compute buffers (the graph reservation in ``llama_context::sched_reserve``)
  ggml's graph allocator reuses memory between tensors that are not alive at the same time, so the buffer is
  the peak of one layer's activations, which is exactly linear in the micro-batch ``n_ubatch`` (T):
  ``T * 4 * A`` bytes where ``A`` (floats per token) depends on the architecture and its widths. ``A`` is the
  maximum over the phases of a layer; the phase formulas were measured with llama-server on models whose
  widths were varied one at a time (tests/fixtures/calibration/grid.jsonl) and are exact at the widths of the
  real models they name, within about 15 % elsewhere (the allocator's fragmentation is not linear):

  ========================  ==================================================================================
  MoE FFN (qwen3moe ...)    ``2*K*E + K*F + 3*E``        (K experts used, F expert width, E embedding width)
  MoE FFN (gpt-oss)         ``3*K*F + 3*E + Hq + 16``    (Hq = n_head * head_dim: the query width)
  MoE FFN (deepseek2)       ``2*K*E + 3*E``
  dense FFN                 ``3*n_ff + 4*E``
  MLA attention (deepseek2) ``H*(kv_lora+rope) + H*kv_lora + H*(nope+rope) + H*v_head + 4*E``
  MHA attention (no FA)     ``3*E + 2*Hq + 2*KVq`` plus the ``[n_kv, T, n_head]`` f32 score matrix
  ========================  ==================================================================================

  plus the attention masks, which are graph inputs alive for the whole graph: ``T * n_kv`` halves with flash
  attention (floats without), one per distinct cache size (full, SWA), where ``n_kv`` is the cells of one stream;
  and the output phase: ``n_outputs * (n_vocab + E)`` floats (llama-server reserves one output per sequence,
  llama-fit-params and ik_llama.cpp one per token of the micro-batch).

  On CUDA the same graph is allocated (alignment 128), plus: with a quantized KV cache the flash-attention
  kernels need f16 copies of one layer's K and V; and when weights stay in host memory (``-ot exps=CPU``,
  ``--cpu-moe``), every op whose batch reaches ``GGML_OP_OFFLOAD_MIN_BATCH`` (32) runs on the GPU with its
  weight copied into the compute buffer -- one such tensor at a time (each starts a new split).

CUDA context (:func:`cuda_overhead_bytes`): the driver context, cuBLAS handles and the kernels loaded lazily
at the first batch, plus ggml's CUDA memory pool, which the first full micro-batch fills (quantized copies of
activations for the MMQ kernels). None of it appears in llama.cpp's buffer logs; it is measured on the GPU
machine by ``python -m lab.calibrate gpu`` (nvidia-smi after one full batch minus the buffers).

Devices are named as llama.cpp names them (:mod:`orchestrator.backend.devices`): ``CUDA0``, ``RPC0``, ``CPU``. An
RPC device (a ``ggml-rpc-server``) is predicted as the CPU backend its server runs here: no row padding, CPU
alignment, no CUDA context.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from orchestrator.backend import devices as D
from orchestrator.backend.info import Flavor
from orchestrator.model.classes import TensorClass
from orchestrator.model.ggml_types import ggml_type
from orchestrator.model.info import ModelInfo, TensorInfo

MiB = 1024 * 1024

CPU_ALIGN = 32       # ggml CPU buffer alignment (TENSOR_ALIGNMENT)
CUDA_ALIGN = 128     # ggml_backend_cuda_buffer_type_get_alignment
CUDA_ROW_PADDING = 512  # MATRIX_ROW_PADDING: quantized rows are padded to this many elements on CUDA

# Measured on the H200 (driver 580, CUDA 13, lazy module loading) by `calibrate gpu`
# (tests/fixtures/calibration/gpu): nvidia-smi minus llama.cpp's logged buffers right after loading was 629 MiB
# (qwen3moe) and 690 MiB (deepseek2); the first full micro-batch then added ggml's CUDA pool: 100 MiB plus
# ~1.2 bytes per element of the routed experts' gathered input (micro-batch x experts used x n_embd: its q8_1
# copy for the MMQ kernels, 1.125 bytes per element, and scratch) in all four (architecture, -ub) pairs.
CUDA_CONTEXT_BYTES = 660 * MiB
CUDA_POOL_BASE_BYTES = 100 * MiB
CUDA_POOL_BYTES_PER_ELEMENT = 1.2


def pad(x: int, n: int) -> int:
    return (x + n - 1) // n * n


def _type_name(t: str) -> str:
    return ggml_type(t).name


def row_bytes(type_name: str, n: int) -> int:
    return ggml_type(type_name).row_bytes(n)


# ---- context layout -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ContextLayout:
    """How llama.cpp sizes a context: cells per stream for full and sliding-window layers."""

    n_ctx: int           # total cells llama.cpp reports as n_ctx (padded)
    n_ctx_seq: int       # cells of one stream (the context one sequence can use)
    n_stream: int        # KV streams: 1 when unified, else n_parallel
    cells_full: int      # cells per stream of a full-attention layer
    cells_swa: int       # cells per stream of a sliding-window layer (0: no SWA layers)
    n_parallel: int
    n_ubatch: int


def context_layout(model: ModelInfo, n_ctx: int, n_parallel: int = 1, *, n_ubatch: int = 512,
                   kv_unified: bool = False, swa_full: bool = False, flash_attn: bool = True,
                   n_batch: int = 2048, flavor: Flavor | str = Flavor.MAINLINE) -> ContextLayout:
    """Apply llama.cpp's padding and per-sequence rules. ``n_ctx == 0`` means the model's training context."""
    if n_parallel < 1:
        raise ValueError("n_parallel must be at least 1")
    n_ctx = n_ctx or model.n_ctx_train or 4096
    ub = min(n_ubatch, n_batch, n_ctx)
    if Flavor.of(flavor) is Flavor.IK:
        total = pad(n_ctx, 256 if flash_attn else 32)
        swa = total if model.swa_layers else 0
        return ContextLayout(total, total, 1, total, swa, n_parallel, ub)
    total = pad(n_ctx, 256)
    if kv_unified or n_parallel == 1:
        per_stream, n_stream = total, 1
    else:
        per_stream = pad(total // n_parallel, 256)
        n_stream = n_parallel
        total = per_stream * n_parallel
    cells_swa = 0
    if model.swa_layers and model.sliding_window:
        if swa_full:
            cells_swa = per_stream
        else:
            n_seq_factor = n_parallel if kv_unified else 1
            cells_swa = pad(min(per_stream, model.sliding_window * n_seq_factor + ub), 256)
    return ContextLayout(total, per_stream, n_stream, per_stream, cells_swa, n_parallel, ub)


# ---- KV cache -----------------------------------------------------------------------------------------------

def kv_layers(model: ModelInfo) -> tuple[int, ...]:
    """Layers with a KV cache in the main context: the trunk (NextN/MTP blocks excluded) with attention."""
    return tuple(i for i in range(model.n_trunk_layers) if model.kv_heads(i) > 0)


def kv_cache_bytes_by_layer(model: ModelInfo, n_ctx: int, n_parallel: int = 1, type_k: str = "f16",
                            type_v: str = "f16", layers: Iterable[int] | None = None, *, kv_unified: bool = False,
                            n_ubatch: int = 512, flash_attn: bool = True, swa_full: bool = False,
                            n_batch: int = 2048, flavor: Flavor | str = Flavor.MAINLINE) -> dict[int, int]:
    """KV bytes per layer. MLA models need ``type_k == type_v`` (llama.cpp refuses anything else)."""
    if model.mla is not None and _type_name(type_k) != _type_name(type_v):
        raise ValueError(f"{model.arch} with MLA stores V inside K: type_k and type_v must be the same "
                         f"(got {type_k}, {type_v})")
    lay = context_layout(model, n_ctx, n_parallel, n_ubatch=n_ubatch, kv_unified=kv_unified, swa_full=swa_full,
                         flash_attn=flash_attn, n_batch=n_batch, flavor=flavor)
    tk, tv = _type_name(type_k), _type_name(type_v)
    wanted = set(kv_layers(model)) if layers is None else set(layers) & set(kv_layers(model))
    mla = model.mla is not None and (Flavor.of(flavor) is Flavor.MAINLINE or flash_attn)
    v_trans = not flash_attn
    v_width_max = max((model.head_dim_v * model.kv_heads(i) for i in kv_layers(model)), default=0)
    out: dict[int, int] = {}
    for il in sorted(wanted):
        swa = model.is_swa(il) and lay.cells_swa > 0
        cells = lay.cells_swa if swa else lay.cells_full
        k_width = model.head_dim_k * model.kv_heads(il)
        size = row_bytes(tk, k_width) * cells * lay.n_stream
        if not mla:
            v_width = v_width_max if v_trans else model.head_dim_v * model.kv_heads(il)
            size += row_bytes(tv, v_width) * cells * lay.n_stream
        out[il] = size
    return out


def kv_cache_bytes(model: ModelInfo, n_ctx: int, n_parallel: int = 1, type_k: str = "f16", type_v: str = "f16",
                   layers: Iterable[int] | None = None, *, kv_unified: bool = False, n_ubatch: int = 512,
                   flash_attn: bool = True, swa_full: bool = False, n_batch: int = 2048,
                   flavor: Flavor | str = Flavor.MAINLINE) -> int:
    """Bytes of the KV cache (of ``layers`` only, when given: the cache of a layer lives with the layer).
    ``n_ubatch`` and ``n_batch`` matter for sliding-window layers (llama.cpp uses ``min(n_ubatch, n_batch)``)."""
    return sum(kv_cache_bytes_by_layer(model, n_ctx, n_parallel, type_k, type_v, layers, kv_unified=kv_unified,
                                       n_ubatch=n_ubatch, flash_attn=flash_attn, swa_full=swa_full,
                                       n_batch=n_batch, flavor=flavor).values())


def kv_bytes_per_token(model: ModelInfo, type_k: str = "f16", type_v: str = "f16", *,
                       flash_attn: bool = True) -> int:
    """KV bytes one token of context costs across all full-attention layers (SWA layers cost nothing per token
    beyond their window)."""
    tk, tv = _type_name(type_k), _type_name(type_v)
    total = 0
    for il in kv_layers(model):
        if model.is_swa(il):
            continue
        total += row_bytes(tk, model.head_dim_k * model.kv_heads(il))
        if model.mla is None:
            total += row_bytes(tv, model.head_dim_v * model.kv_heads(il))
    return total


# ---- compute buffers ----------------------------------------------------------------------------------------

def _ffn_dims(model: ModelInfo) -> tuple[int, int, int]:
    E = model.n_embd
    K = model.n_expert_used
    F = model.n_ff_exp or 0
    return E, K, F


def activation_phases(model: ModelInfo, *, flash_attn: bool = True) -> dict[str, int]:
    """Floats per token of the micro-batch live at the peak of each phase of a layer (see the module doc)."""
    E, K, F = _ffn_dims(model)
    H = model.n_head
    hq = H * model.head_dim_k if model.mla is None else H * model.mla.k_head_dim
    kvq = model.n_head_kv * model.head_dim_k
    phases: dict[str, int] = {}
    if model.moe_layers:
        if model.arch == "gpt-oss":
            phases["moe"] = 3 * K * F + 3 * E + hq + 16
        elif model.mla is not None:
            phases["moe"] = 2 * K * E + 3 * E
        else:
            phases["moe"] = 2 * K * E + K * F + 3 * E
    if model.n_ff and (model.dense_layers or not model.moe_layers):
        phases["dense"] = 3 * model.n_ff + 4 * E
    if model.mla is not None:
        m = model.mla
        phases["attention"] = (H * (m.kv_lora_rank + m.qk_rope_head_dim) + H * m.kv_lora_rank
                               + H * m.k_head_dim + H * m.v_head_dim + 4 * E)
    else:
        phases["attention"] = 3 * E + 2 * hq + 2 * kvq
    return phases


@dataclass(frozen=True)
class ComputeEstimate:
    """A compute buffer and where it comes from (bytes)."""

    total: int
    activations: int     # T * 4 * max(phase) (or the attention phase with its score matrix)
    masks: int
    scores: int          # non-flash-attention KQ matrix (part of the attention phase)
    outputs: int         # logits of the output phase, when that phase is the peak
    weight_copy: int     # CUDA: a host-resident weight copied for an offloaded op
    fa_f16_kv: int       # CUDA: f16 copies of one layer's quantized K/V for the flash-attention kernels
    phase: str           # which phase is the peak

    def to_json(self) -> dict:
        return dict(self.__dict__)


def _masks(model: ModelInfo, lay: ContextLayout, T: int, flash_attn: bool) -> int:
    el = 2 if flash_attn else 4
    t_stream = max(T // lay.n_stream, 1)
    total = 0
    has_full = any(not model.is_swa(i) for i in kv_layers(model))
    if has_full:
        total += lay.cells_full * t_stream * lay.n_stream * el
    if lay.cells_swa and model.swa_layers:
        total += lay.cells_swa * t_stream * lay.n_stream * el
    return total


def compute_buffer_estimate(model: ModelInfo, *, n_ubatch: int, n_ctx: int, device: str = D.CPU,
                            flash_attn: bool = True, n_parallel: int = 1, kv_unified: bool = False,
                            n_outputs: int | None = None, type_k: str = "f16", type_v: str = "f16",
                            has_layers: bool = True, has_output: bool = True, swa_full: bool = False,
                            n_batch: int = 2048, offloaded_weight_bytes: int = 0,
                            flavor: Flavor | str = Flavor.MAINLINE) -> ComputeEstimate:
    """Compute buffer of one device (``device``: its name or kind, ``"CUDA0"``, ``"CUDA"``, ``"RPC0"``, ``"CPU"``).

    ``has_layers``: the device computes at least one layer (its activations peak there); a host that only
    feeds GPUs (all layers offloaded) still holds the graph inputs (masks, token embeddings) and, when it keeps
    the output layer, the output phase. ``offloaded_weight_bytes`` (CUDA): the largest host-resident weight an
    offloaded op copies in (see :func:`offloaded_weight_bytes`). ``n_outputs``: outputs reserved per
    micro-batch (llama-server: ``n_parallel``; llama-fit-params and ik_llama.cpp: the micro-batch).
    """
    lay = context_layout(model, n_ctx, n_parallel, n_ubatch=n_ubatch, kv_unified=kv_unified, swa_full=swa_full,
                         flash_attn=flash_attn, n_batch=n_batch, flavor=flavor)
    T = lay.n_ubatch
    cuda = D.kind_of(device) == D.CUDA
    E = model.n_embd
    masks = _masks(model, lay, T, flash_attn)
    phases = activation_phases(model, flash_attn=flash_attn)
    if n_outputs is None:
        n_outputs = n_parallel if Flavor.of(flavor) is Flavor.MAINLINE else T
    n_out = min(T, max(n_outputs, 1))
    out_phase = n_out * (model.n_vocab + E) * 4 + T * E * 4 if has_output else 0

    scores = 0
    if has_layers:
        best_name = max(phases, key=lambda k: phases[k])
        act = T * 4 * phases[best_name]
        phase = best_name
        if not flash_attn:
            t_stream = max(T // lay.n_stream, 1)
            scores = lay.cells_full * t_stream * lay.n_stream * model.n_head * 4
            attn = scores + T * 4 * phases["attention"]
            if attn > act:
                act, phase = attn, "attention"
            else:
                scores = 0
    else:
        # a host that only feeds the GPUs: the token-embedding rows it looks up and the embeddings input
        act, phase = 2 * T * E * 4, "inputs"
    outputs = 0
    if out_phase > act:
        outputs = out_phase
        act, phase = out_phase, "output"
        scores = 0

    fa_f16 = 0
    if cuda and flash_attn and has_layers and (not _is_f16(type_k) or not _is_f16(type_v)):
        width_k = model.head_dim_k * model.n_head_kv
        width_v = 0 if model.mla is not None else model.head_dim_v * model.n_head_kv
        fa_f16 = lay.cells_full * lay.n_stream * (width_k * (not _is_f16(type_k))
                                                  + width_v * (not _is_f16(type_v))) * 2
    weight_copy = offloaded_weight_bytes if cuda and T >= 32 else 0
    align = CUDA_ALIGN if cuda else CPU_ALIGN
    total = pad(act + masks + fa_f16 + weight_copy, align)
    return ComputeEstimate(total, act - outputs - scores, masks, scores, outputs, weight_copy, fa_f16, phase)


def _is_f16(t: str) -> bool:
    return _type_name(t) == "F16"


def compute_buffer_bytes(model: ModelInfo, *, n_ubatch: int, n_ctx: int, device: str = D.CPU,
                         flash_attn: bool = True, **kw) -> int:
    """Bytes of one device's compute buffer (see :func:`compute_buffer_estimate` for the keywords)."""
    return compute_buffer_estimate(model, n_ubatch=n_ubatch, n_ctx=n_ctx, device=device, flash_attn=flash_attn,
                                   **kw).total


def offloaded_weight_bytes(tensors: Iterable[TensorInfo]) -> int:
    """Compute-buffer room a GPU needs to run ops whose weights stay in host memory (op offload): the largest
    such weight, with CUDA's row padding. Pass the host-resident tensors of the layers the GPU runs."""
    best = 0
    for t in tensors:
        if t.cls in (TensorClass.EMBEDDINGS,) or len(t.shape) < 2:
            continue
        best = max(best, cuda_tensor_bytes(t))
    return best


def cuda_tensor_bytes(t: TensorInfo) -> int:
    """Bytes a weight takes in a CUDA buffer: quantized rows padded to 512 elements, aligned to 128."""
    gt = ggml_type(t.type)
    size = t.bytes
    if gt.block > 1 and t.shape[0] % CUDA_ROW_PADDING:
        size += gt.row_bytes(CUDA_ROW_PADDING - t.shape[0] % CUDA_ROW_PADDING) - gt.row_meta
    return pad(size, CUDA_ALIGN)


def output_buffer_bytes(model: ModelInfo, n_parallel: int = 1) -> int:
    """The host output buffer (logits of one output per sequence)."""
    return model.n_vocab * max(n_parallel, 1) * 4


def cuda_overhead_bytes(model: ModelInfo | None = None, *, n_ubatch: int = 512, context_bytes: int = CUDA_CONTEXT_BYTES,
                        ) -> int:
    """Memory a GPU uses that llama.cpp's buffers do not show: the CUDA context with the kernels loaded at the
    first batch, and ggml's memory pool after one full micro-batch: a base plus ~1.2 bytes per element of the
    widest matmul input of the micro-batch (for a MoE model the routed experts' gathered input, experts used x
    n_embd per token). Fitted on the H200 runs of ``calibrate gpu`` (within 35 MiB of each)."""
    pool = 0
    if model is not None:
        E, K, F = _ffn_dims(model)
        hq = model.n_head * model.head_dim_k if model.mla is None else 0
        widest = max(E, K * E, model.n_ff or 0, hq)
        pool = CUDA_POOL_BASE_BYTES + pad(int(n_ubatch * widest * CUDA_POOL_BYTES_PER_ELEMENT), MiB)
    return context_bytes + pool


# ---- whole-model prediction ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class DeviceBuffers:
    """The buffers llama.cpp allocates on one device for a model (what its load log reports), predicted."""

    device: str
    weights: int = 0
    kv: int = 0
    compute: int = 0
    output: int = 0
    overhead: int = 0    # CUDA context and pool (not in llama.cpp's logs)

    @property
    def total(self) -> int:
        """What llama.cpp reports for the device (weights + KV + compute + output buffers)."""
        return self.weights + self.kv + self.compute + self.output

    @property
    def total_with_overhead(self) -> int:
        return self.total + self.overhead

    def to_json(self) -> dict:
        return {"device": self.device, "weights": self.weights, "kv": self.kv, "compute": self.compute,
                "output": self.output, "overhead": self.overhead, "total": self.total}


@dataclass(frozen=True)
class LayerOffload:
    """Where weights live, in llama.cpp's terms. ``gpu_layers``: the layers on ``gpu`` (``-ngl N`` offloads the
    last N-1 layers and the output layer). ``cpu_moe_layers``: GPU layers whose routed experts stay in host
    memory (``--cpu-moe`` / ``-ot exps=CPU``: all of them; ``--n-cpu-moe N``: layers 0..N-1). The token
    embeddings always stay on the host; the output layer goes with the last layer unless ``output_on_gpu``
    says otherwise."""

    gpu_layers: tuple[int, ...] = ()
    gpu: str = "CUDA0"
    cpu_moe_layers: tuple[int, ...] = ()
    output_on_gpu: bool | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "_gpu_set", frozenset(self.gpu_layers))
        object.__setattr__(self, "_cpu_moe_set", frozenset(self.cpu_moe_layers))

    def device_of(self, model: ModelInfo, t: TensorInfo) -> str:
        gpu_set: frozenset[int] = self._gpu_set  # type: ignore[attr-defined]
        if not gpu_set:
            return D.CPU
        if t.layer is None:
            if t.cls is TensorClass.EMBEDDINGS:
                return D.CPU          # llama.cpp keeps the input layer on the host
            out = self.output_on_gpu
            if out is None:
                out = (model.n_layers - 1) in gpu_set or (model.n_trunk_layers - 1) in gpu_set
            return self.gpu if out else D.CPU
        if t.layer not in gpu_set:
            return D.CPU
        if t.cls is TensorClass.ROUTED_EXPERT and t.layer in self._cpu_moe_set:  # type: ignore[attr-defined]
            return D.CPU
        return self.gpu

    def on_gpu(self, layer: int) -> bool:
        return layer in self._gpu_set  # type: ignore[attr-defined]


@dataclass(frozen=True)
class ServerSettings:
    n_ctx: int
    n_parallel: int = 1
    n_ubatch: int = 512
    n_batch: int = 2048
    flash_attn: bool = True
    type_k: str = "f16"
    type_v: str = "f16"
    kv_unified: bool = False
    swa_full: bool = False
    n_outputs: int | None = None
    mtp: bool = False
    flavor: Flavor | str = Flavor.MAINLINE


def predict_memory(model: ModelInfo, settings: ServerSettings, placement: LayerOffload = LayerOffload()
                   ) -> dict[str, DeviceBuffers]:
    """Per-device memory llama.cpp will report after loading ``model`` with ``settings`` and ``placement``."""
    s = settings
    weights: dict[str, int] = {}
    host_weights: list[TensorInfo] = []
    for t in model.tensors:
        if not s.mtp and model.n_nextn_layers and t.layer is not None and t.layer >= model.n_trunk_layers:
            continue
        dev = placement.device_of(model, t)
        size = cuda_tensor_bytes(t) if D.kind_of(dev) == D.CUDA else pad(t.bytes, CPU_ALIGN)
        weights[dev] = weights.get(dev, 0) + size
        if dev == D.CPU and t.layer is not None and placement.on_gpu(t.layer):
            host_weights.append(t)
    kv_kw = dict(kv_unified=s.kv_unified, n_ubatch=s.n_ubatch, flash_attn=s.flash_attn, swa_full=s.swa_full,
                 n_batch=s.n_batch, flavor=s.flavor)
    gpu_layers = [i for i in placement.gpu_layers if i < model.n_trunk_layers]
    cpu_layers = [i for i in range(model.n_trunk_layers) if not placement.on_gpu(i)]
    out: dict[str, DeviceBuffers] = {}
    common = dict(n_ubatch=s.n_ubatch, n_ctx=s.n_ctx, flash_attn=s.flash_attn, n_parallel=s.n_parallel,
                  kv_unified=s.kv_unified, n_outputs=s.n_outputs, type_k=s.type_k, type_v=s.type_v,
                  swa_full=s.swa_full, n_batch=s.n_batch, flavor=s.flavor)
    out_dev = D.CPU
    if placement.gpu_layers:
        probe = next((t for t in model.tensors if t.cls is TensorClass.OUTPUT), None)
        if probe is not None:
            out_dev = placement.device_of(model, probe)
    if gpu_layers:
        g = placement.gpu
        kv = kv_cache_bytes(model, s.n_ctx, s.n_parallel, s.type_k, s.type_v, gpu_layers, **kv_kw)
        comp = compute_buffer_bytes(model, device=g, has_layers=True, has_output=out_dev == g,
                                    offloaded_weight_bytes=offloaded_weight_bytes(host_weights), **common)
        out[g] = DeviceBuffers(g, weights.get(g, 0), kv, comp, 0,
                               cuda_overhead_bytes(model, n_ubatch=s.n_ubatch) if D.kind_of(g) == D.CUDA else 0)
    kv_cpu = kv_cache_bytes(model, s.n_ctx, s.n_parallel, s.type_k, s.type_v, cpu_layers, **kv_kw)
    comp_cpu = compute_buffer_bytes(model, device=D.CPU, has_layers=bool(cpu_layers), has_output=out_dev == D.CPU,
                                    **common)
    out[D.CPU] = DeviceBuffers(D.CPU, weights.get(D.CPU, 0), kv_cpu, comp_cpu,
                               output_buffer_bytes(model, s.n_parallel))
    return out


# ---- expert cache -------------------------------------------------------------------------------------------

EXPERT_CACHE_MAX_BATCH = 8   # llama-server's --moe-cache-max-batch default


@dataclass(frozen=True)
class ExpertCacheSize:
    """What ``--moe-cache-mib`` allocates for a set of host-resident expert layers (our patch's rules)."""

    slots: int           # slots per host-resident expert tensor (0: the cache is off)
    batch_cap: int       # largest batch the slots serve
    bytes: int           # device memory of the banks and their id buffers
    stage_bytes: int = 0  # prompts' staging buffers taken out of the MiB (0: none asked, or dropped)

    @property
    def active(self) -> bool:
        return self.batch_cap >= 1


def expert_cache_size(model: ModelInfo, host_expert_layers: Iterable[int], cache_mib: int,
                   max_batch: int = EXPERT_CACHE_MAX_BATCH, stage_bytes: int = 0) -> ExpertCacheSize:
    """Every routed-expert tensor of ``host_expert_layers`` gets a bank of the same slot count on its layer's GPU:
    slots = cache MiB / (one expert of every such tensor), at most the experts a tensor has; the cache serves
    batches up to min(max_batch, slots / experts used per token) and is off when that is below 1. Each bank is a
    CUDA tensor of ``slots`` experts (rows padded as weights are) plus an I32 id buffer for the batch cap.
    ``stage_bytes``: prompts' staging buffers (:func:`expert_cache_stage_bytes`), taken out of the MiB first; the
    patch drops them (``stage_bytes`` 0) where what is left would not hold one token's experts per tensor."""
    layers = set(host_expert_layers)
    tensors = [t for t in model.tensors if t.cls is TensorClass.ROUTED_EXPERT and t.layer in layers
               and len(t.shape) >= 3 and t.shape[2] > 0]
    used = model.n_expert_used or 0
    if cache_mib <= 0 or not tensors or used <= 0:
        return ExpertCacheSize(0, 0, 0)
    per_slot = sum(t.bytes // t.shape[2] for t in tensors)
    budget = cache_mib * MiB
    if stage_bytes and stage_bytes + per_slot * used <= budget:
        budget -= stage_bytes
    else:
        stage_bytes = 0
    slots = min(budget // per_slot, min(t.shape[2] for t in tensors))
    cap = min(max_batch, slots // used)
    if cap < 1:
        return ExpertCacheSize(int(slots), 0, 0)
    return ExpertCacheSize(int(slots), int(cap), expert_cache_bank_bytes(model, layers, int(slots), int(cap)),
                        int(stage_bytes))


def expert_cache_bank_bytes(model: ModelInfo, layers: Iterable[int], slots: int, batch_cap: int) -> int:
    """Device memory of the banks of the routed-expert tensors of ``layers`` at ``slots`` slots each: a CUDA
    tensor of ``slots`` experts (rows padded as weights are) plus an I32 id buffer for the batch cap. With
    several GPUs each holds the banks of its own layers."""
    layers = set(layers)
    used = model.n_expert_used or 0
    total = 0
    for t in model.tensors:
        if t.cls is not TensorClass.ROUTED_EXPERT or t.layer not in layers or len(t.shape) < 3 or not t.shape[2]:
            continue
        gt = ggml_type(t.type)
        size = t.bytes // t.shape[2] * slots
        if gt.block > 1 and t.shape[0] % CUDA_ROW_PADDING:
            size += gt.row_bytes(CUDA_ROW_PADDING - t.shape[0] % CUDA_ROW_PADDING) - gt.row_meta
        total += pad(size, CUDA_ALIGN) + pad(4 * batch_cap * used, CUDA_ALIGN)
    return total


def expert_cache_stage_bytes(model: ModelInfo, layers: Iterable[int], buffers: int) -> int:
    """Device memory of ``buffers`` staging buffers for prompts through op offload (``--moe-cache-prefill-ahead``),
    which our patch takes out of the cache's MiB: each as large as the largest CUDA copy of one routed-expert
    tensor of ``layers``."""
    layers = set(layers)
    largest = max((cuda_tensor_bytes(t) for t in model.tensors if t.cls is TensorClass.ROUTED_EXPERT
                   and t.layer in layers and len(t.shape) >= 3 and t.shape[2]), default=0)
    return max(0, int(buffers)) * largest
