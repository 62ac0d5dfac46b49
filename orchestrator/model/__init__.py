"""GGUF models: reading (metadata + tensor index), tensor classes, and the memory model (KV cache, compute
buffers, CUDA overhead). Pure standard library, so it also runs under a bare ``python3``."""

from orchestrator.model.classes import TensorClass, classify
from orchestrator.model.info import MLAParams, ModelInfo, TensorInfo
from orchestrator.model.memory import (ContextLayout, DeviceBuffers, LayerOffload, ServerSettings,
                                       compute_buffer_bytes, compute_buffer_estimate, context_layout, cuda_overhead_bytes,
                                       kv_bytes_per_token, kv_cache_bytes, kv_cache_bytes_by_layer,
                                       offloaded_weight_bytes, output_buffer_bytes, predict_memory)
from orchestrator.model.reader import read_model

__all__ = [
    "TensorClass", "classify", "MLAParams", "ModelInfo", "TensorInfo", "read_model",
    "ContextLayout", "DeviceBuffers", "LayerOffload", "ServerSettings", "compute_buffer_bytes",
    "compute_buffer_estimate", "context_layout", "cuda_overhead_bytes", "kv_bytes_per_token", "kv_cache_bytes",
    "kv_cache_bytes_by_layer", "offloaded_weight_bytes", "output_buffer_bytes", "predict_memory",
]
