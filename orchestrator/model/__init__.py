"""GGUF models: reading (metadata + tensor index), tensor classes, and the memory model (KV cache, compute
buffers, CUDA overhead). Pure standard library, so it also runs under a bare ``python3``."""

from orchestrator.model.classes import TensorClass, classify
from orchestrator.model.info import MLAParams, ModelInfo, TensorInfo
from orchestrator.model.reader import read_model

__all__ = ["TensorClass", "classify", "MLAParams", "ModelInfo", "TensorInfo", "read_model"]
