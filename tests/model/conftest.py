"""Tiny real-architecture GGUF models, written with the ``gguf`` package's own GGUFWriter.

The reader under test is ours; the files come from the reference writer, so a test that reads them back checks
our parser against an independent implementation of the format. The architectures' tensor names, shapes and
metadata come from :mod:`lab.calibmodels` (llama-server loads these files for real).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from lab.calibmodels import PRESETS, ArchSpec, build
from orchestrator.model.ggml_types import ggml_type

# small widths that keep every real structural feature (GQA, MLA latent, SWA, biases, shared expert, ...)
TINY: dict[str, ArchSpec] = {
    "qwen3moe": dataclasses.replace(PRESETS["qwen3-30b-a3b"], n_layers=3, n_embd=64, n_head=4, n_head_kv=2,
                                    head_dim=32, n_vocab=320, n_ff=128, n_expert=8, n_expert_used=2, n_ff_exp=32,
                                    n_ctx_train=4096, name="tiny-qwen3moe"),
    "deepseek2": dataclasses.replace(PRESETS["deepseek-v3"], n_layers=3, n_embd=64, n_head=4, n_vocab=320, n_ff=96,
                                     n_expert=8, n_expert_used=2, n_ff_exp=32, n_expert_shared=1, n_dense_lead=1,
                                     q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=32, qk_nope_head_dim=32,
                                     v_head_dim=32, n_ctx_train=4096, name="tiny-deepseek2"),
    "gpt-oss": dataclasses.replace(PRESETS["gpt-oss-120b"], n_layers=4, n_embd=64, n_head=4, n_head_kv=2,
                                   head_dim=32, n_vocab=320, n_expert=4, n_expert_used=2, n_ff_exp=64,
                                   sliding_window=128, n_ctx_train=4096, name="tiny-gpt-oss"),
    "llama": dataclasses.replace(PRESETS["llama-8b"], n_layers=2, n_embd=64, n_head=4, n_head_kv=2, head_dim=16,
                                 n_vocab=320, n_ff=128, n_ctx_train=4096, attn_type="Q8_0", name="tiny-llama"),
}


def _add_kv(w, key: str, value) -> None:
    import gguf

    VT = gguf.GGUFValueType
    if isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        w.add_uint32(key, value) if 0 <= value < 1 << 32 else w.add_int64(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    elif isinstance(value, str):
        w.add_string(key, value)
    elif isinstance(value, list):
        if value and isinstance(value[0], str):
            w.add_array(key, value)
        elif value and isinstance(value[0], float):
            w.add_key_value(key, value, VT.ARRAY, sub_type=VT.FLOAT32)
        elif value and isinstance(value[0], bool):
            w.add_key_value(key, value, VT.ARRAY, sub_type=VT.BOOL)
        else:
            w.add_key_value(key, value, VT.ARRAY, sub_type=VT.INT32)
    else:
        raise TypeError(key)


def write_with_gguf(path: Path, metadata: dict, tensors, *, split_max_tensors: int = 0) -> list[Path]:
    """Write with gguf.GGUFWriter (zero data). Returns the files written (several when split)."""
    import gguf

    arch = metadata["general.architecture"]
    w = gguf.GGUFWriter(str(path), arch, split_max_tensors=split_max_tensors)
    for k, v in metadata.items():
        if k in ("general.architecture", "general.alignment"):
            continue
        _add_kv(w, k, v)
    for t in tensors:
        gt = ggml_type(t.type)
        rows = 1
        for d in t.shape[1:]:
            rows *= d
        if gt.name == "F32":
            data = np.zeros(tuple(reversed(t.shape)), dtype=np.float32)
            w.add_tensor(t.name, data)
        elif gt.name == "F16":
            data = np.zeros(tuple(reversed(t.shape)), dtype=np.float16)
            w.add_tensor(t.name, data)
        else:
            byte_shape = tuple(reversed(t.shape[1:])) + (gt.row_bytes(t.shape[0]),)
            data = np.zeros(byte_shape, dtype=np.uint8)
            w.add_tensor(t.name, data, raw_dtype=gguf.GGMLQuantizationType(gt.id))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if split_max_tensors:
        return sorted(path.parent.glob(path.stem + "-*-of-*.gguf"))
    return [path]


@pytest.fixture(scope="session")
def tiny_specs() -> dict[str, ArchSpec]:
    return TINY


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """One tiny GGUF per architecture, written by gguf.GGUFWriter."""
    d = tmp_path_factory.mktemp("tiny-models")
    out = {}
    for name, spec in TINY.items():
        md, ts = build(spec)
        out[name] = write_with_gguf(d / f"{name}.gguf", md, ts)[0]
    return out


@pytest.fixture()
def write_model(tmp_path):
    """write_model(spec_or_(md, tensors), name, split_max_tensors=0) -> [paths]"""
    def _write(spec, name: str = "m.gguf", *, split_max_tensors: int = 0, metadata_edit=None):
        md, ts = build(spec) if isinstance(spec, ArchSpec) else spec
        if metadata_edit:
            md = dict(md)
            metadata_edit(md)
        return write_with_gguf(tmp_path / name, md, ts, split_max_tensors=split_max_tensors)
    return _write
