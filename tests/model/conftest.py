"""Tiny real-architecture GGUF models, written with the project's one writer (:mod:`orchestrator.model.writer`).

The architectures' tensor names, shapes and metadata come from :mod:`lab.calibmodels` (llama-server loads these
files for real); the reader under test is checked against the ``gguf`` package's own reader (test_reader.py),
an independent implementation of the format, which so checks the writer too.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from lab.calibmodels import PRESETS, build
from orchestrator.model.shapes import ModelShape
from orchestrator.model.writer import write_gguf, write_gguf_split

# small widths that keep every real structural feature (GQA, MLA latent, SWA, biases, shared expert, ...)
TINY: dict[str, ModelShape] = {
    "qwen3moe": dataclasses.replace(PRESETS["qwen3-30b-a3b"], n_layer=3, n_embd=64, n_head=4, n_head_kv=2,
                                    head_dim=32, n_vocab=320, n_ff=128, n_expert=8, n_expert_used=2, n_ff_exp=32,
                                    n_ctx_train=4096, like="tiny-qwen3moe"),
    "deepseek2": dataclasses.replace(PRESETS["deepseek-v3"], n_layer=3, n_embd=64, n_head=4, n_vocab=320, n_ff=96,
                                     n_expert=8, n_expert_used=2, n_ff_exp=32, n_expert_shared=1, n_dense_lead=1,
                                     q_lora_rank=32, kv_lora_rank=32, qk_rope_dim=32, qk_nope_dim=32,
                                     v_head_dim=32, n_ctx_train=4096, like="tiny-deepseek2"),
    "gpt-oss": dataclasses.replace(PRESETS["gpt-oss-120b"], n_layer=4, n_embd=64, n_head=4, n_head_kv=2,
                                   head_dim=32, n_vocab=320, n_expert=4, n_expert_used=2, n_ff_exp=64,
                                   sliding_window=128, n_ctx_train=4096, like="tiny-gpt-oss"),
    "llama": dataclasses.replace(PRESETS["llama-8b"], n_layer=2, n_embd=64, n_head=4, n_head_kv=2, head_dim=16,
                                 n_vocab=320, n_ff=128, n_ctx_train=4096, like="tiny-llama"),
}


def write_tiny(path: Path, metadata: dict, tensors, *, split_max_tensors: int = 0) -> list[Path]:
    """Write a sparse model (every weight zero); split into shards of at most ``split_max_tensors`` tensors,
    named as gguf-split names them. Returns the files written."""
    tensors = list(tensors)
    if split_max_tensors and len(tensors) > split_max_tensors:
        n_shards = -(-len(tensors) // split_max_tensors)
        return write_gguf_split(path.with_suffix(""), metadata, tensors, n_shards)
    write_gguf(path, metadata, tensors)
    return [path]


@pytest.fixture(scope="session")
def tiny_specs() -> dict[str, ModelShape]:
    return TINY


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """One tiny GGUF per architecture."""
    d = tmp_path_factory.mktemp("tiny-models")
    out = {}
    for name, spec in TINY.items():
        md, ts = build(spec)
        out[name] = write_tiny(d / f"{name}.gguf", md, ts)[0]
    return out


@pytest.fixture()
def write_model(tmp_path):
    """write_model(spec_or_(md, tensors), name, split_max_tensors=0) -> [paths]"""
    def _write(spec, name: str = "m.gguf", *, split_max_tensors: int = 0, metadata_edit=None):
        md, ts = build(spec) if isinstance(spec, ModelShape) else spec
        if metadata_edit:
            md = dict(md)
            metadata_edit(md)
        return write_tiny(tmp_path / name, md, ts, split_max_tensors=split_max_tensors)
    return _write
