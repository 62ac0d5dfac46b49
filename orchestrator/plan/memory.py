"""The memory model as the planner calls it (thin names over orchestrator.model.memory)."""

from __future__ import annotations

from orchestrator.backend.info import Flavor
from orchestrator.model import memory as mm
from orchestrator.model.classes import TensorClass
from orchestrator.model.info import ModelInfo


def kv_by_layer(model: ModelInfo, *, n_ctx: int, n_parallel: int, type_k: str, type_v: str, n_ubatch: int,
                n_batch: int, flash_attn: bool, flavor: Flavor) -> list[int]:
    """KV cache bytes of every layer (0 for layers without a cache) for llama-server's ``-c n_ctx -np n``."""
    by = mm.kv_cache_bytes_by_layer(model, n_ctx, n_parallel, type_k, type_v, None, n_ubatch=n_ubatch,
                                    n_batch=n_batch, flash_attn=flash_attn, flavor=flavor)
    return [by.get(i, 0) for i in range(model.n_layers)]


def staging_bytes(model: ModelInfo, cpu_expert_layers) -> int:
    """Room a GPU's compute buffer needs to copy in a host-resident expert tensor for an offloaded batch."""
    layers = set(cpu_expert_layers)
    return mm.offloaded_weight_bytes(t for t in model.tensors
                                     if t.cls is TensorClass.ROUTED_EXPERT and t.layer in layers)


def gpu_compute_bytes(model: ModelInfo, *, n_ubatch: int, n_batch: int, n_ctx: int, n_parallel: int,
                      flash_attn: bool, type_k: str, type_v: str, has_output: bool, staging: int, flavor: Flavor) -> int:
    return mm.compute_buffer_bytes(model, n_ubatch=n_ubatch, n_ctx=n_ctx, device="cuda", flash_attn=flash_attn,
                                   n_parallel=n_parallel, n_batch=n_batch, type_k=type_k, type_v=type_v,
                                   has_layers=True, has_output=has_output, offloaded_weight_bytes=staging,
                                   flavor=flavor)


def cpu_compute_bytes(model: ModelInfo, *, n_ubatch: int, n_batch: int, n_ctx: int, n_parallel: int,
                      flash_attn: bool, type_k: str, type_v: str, has_layers: bool, has_output: bool,
                      flavor: Flavor) -> int:
    return mm.compute_buffer_bytes(model, n_ubatch=n_ubatch, n_ctx=n_ctx, device="cpu", flash_attn=flash_attn,
                                   n_parallel=n_parallel, n_batch=n_batch, type_k=type_k, type_v=type_v,
                                   has_layers=has_layers, has_output=has_output, flavor=flavor)


def cuda_overhead(model: ModelInfo, n_ubatch: int) -> int:
    """CUDA context, kernels loaded at the first batch and ggml's pool after a full micro-batch, per GPU."""
    return mm.cuda_overhead_bytes(model, n_ubatch=n_ubatch)


def output_bytes(model: ModelInfo, n_parallel: int) -> int:
    """The host-side logits buffer."""
    return mm.output_buffer_bytes(model, n_parallel)
