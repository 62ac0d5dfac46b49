"""The memory model as the planner calls it (thin names over orchestrator.model.memory)."""

from __future__ import annotations

from orchestrator.model import ModelInfo
from orchestrator.model import memory as mm


def kv_bytes(model: ModelInfo, n_ctx: int, n_parallel: int, type_k: str, type_v: str, layer: int) -> int:
    """KV cache bytes of one layer for a context of ``n_ctx`` tokens in total over ``n_parallel`` sequences."""
    return mm.kv_cache_bytes(model, n_ctx, n_parallel, type_k=type_k, type_v=type_v, layers=[layer])


def compute_bytes(model: ModelInfo, *, n_ubatch: int, n_ctx: int, device: str, flash_attn: bool,
                  cpu_layers: int | None = None) -> int:
    """Compute buffer of one device for micro-batches of ``n_ubatch`` tokens."""
    return mm.compute_buffer_bytes(model, n_ubatch=n_ubatch, n_ctx=n_ctx, device=device, flash_attn=flash_attn)


def cuda_overhead(model: ModelInfo) -> int:
    """CUDA context, cuBLAS workspace and kernels loaded at the first batch, per GPU."""
    return mm.cuda_overhead_bytes()
