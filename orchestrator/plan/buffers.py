"""Buffer and KV sizes as the planner asks for them (thin names over orchestrator.model.memory, the memory model)."""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.backend import devices as D
from orchestrator.backend.info import Flavor
from orchestrator.model import memory as mm
from orchestrator.model.classes import TensorClass
from orchestrator.model.info import ModelInfo


@dataclass(frozen=True)
class BufferShape:
    """What sizes llama-server's KV cache and compute buffers: ``-c``, ``-np``, ``-ub``, ``-b``, the KV cache types,
    flash attention and the flavor."""

    n_ctx: int
    n_parallel: int
    n_ubatch: int
    n_batch: int
    type_k: str
    type_v: str
    flash_attn: bool
    flavor: Flavor = Flavor.MAINLINE


def kv_by_layer(model: ModelInfo, shape: BufferShape) -> list[int]:
    """KV cache bytes of every layer (0 for layers without a cache) for llama-server's ``-c n_ctx -np n``."""
    by = mm.kv_cache_bytes_by_layer(model, shape.n_ctx, shape.n_parallel, shape.type_k, shape.type_v, None,
                                    n_ubatch=shape.n_ubatch, n_batch=shape.n_batch, flash_attn=shape.flash_attn,
                                    flavor=shape.flavor)
    return [by.get(i, 0) for i in range(model.n_layers)]


def offload_copy_bytes(model: ModelInfo, cpu_expert_layers) -> int:
    """Room a GPU's compute buffer needs to copy in a host-resident expert tensor for an offloaded batch."""
    layers = set(cpu_expert_layers)
    return mm.offloaded_weight_bytes(t for t in model.tensors
                                     if t.cls is TensorClass.ROUTED_EXPERT and t.layer in layers)


def gpu_compute_bytes(model: ModelInfo, shape: BufferShape, *, has_output: bool, offload_copy: int) -> int:
    return mm.compute_buffer_bytes(model, n_ubatch=shape.n_ubatch, n_ctx=shape.n_ctx, device=D.CUDA,
                                   flash_attn=shape.flash_attn, n_parallel=shape.n_parallel, n_batch=shape.n_batch,
                                   type_k=shape.type_k, type_v=shape.type_v, has_layers=True, has_output=has_output,
                                   offloaded_weight_bytes=offload_copy, flavor=shape.flavor)


def cpu_compute_bytes(model: ModelInfo, shape: BufferShape, *, has_layers: bool, has_output: bool) -> int:
    return mm.compute_buffer_bytes(model, n_ubatch=shape.n_ubatch, n_ctx=shape.n_ctx, device=D.CPU,
                                   flash_attn=shape.flash_attn, n_parallel=shape.n_parallel, n_batch=shape.n_batch,
                                   type_k=shape.type_k, type_v=shape.type_v, has_layers=has_layers,
                                   has_output=has_output, flavor=shape.flavor)


def cuda_overhead(model: ModelInfo, n_ubatch: int) -> int:
    """CUDA context, kernels loaded at the first batch and ggml's pool after a full micro-batch, per GPU."""
    return mm.cuda_overhead_bytes(model, n_ubatch=n_ubatch)


def output_bytes(model: ModelInfo, n_parallel: int) -> int:
    """The host-side logits buffer."""
    return mm.output_buffer_bytes(model, n_parallel)
