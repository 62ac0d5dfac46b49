"""Fixtures for tests/launch: tiny real GGUF models (written with gguf's GGUFWriter), a corrupt one, free ports."""

from __future__ import annotations

import socket
from pathlib import Path

import numpy as np
import pytest


def write_tiny_llama(path: Path, *, n_embd: int = 64, n_layer: int = 2, n_head: int = 4, n_ff: int = 128) -> Path:
    """A complete, loadable llama-architecture GGUF of about 0.5 MB (f32, random weights, byte-fallback SPM vocab)."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("orchestrator-test-tiny-llama")
    w.add_context_length(256)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head)
    w.add_rope_dimension_count(n_embd // n_head)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)] + ["\u2581a", "\u2581b", "\u2581hello"]
    types = [2, 3, 3] + [6] * 256 + [1, 1, 1]          # unknown, control, control, bytes, normal
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * len(tokens))
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    rng = np.random.default_rng(0)
    vocab = len(tokens)

    def rand(name: str, *shape: int) -> None:
        w.add_tensor(name, (rng.standard_normal(shape) * 0.02).astype(np.float32))

    rand("token_embd.weight", vocab, n_embd)
    w.add_tensor("output_norm.weight", np.ones(n_embd, np.float32))
    rand("output.weight", vocab, n_embd)
    for i in range(n_layer):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(n_embd, np.float32))
        for part in ("q", "k", "v", "output"):
            rand(f"blk.{i}.attn_{part}.weight", n_embd, n_embd)
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(n_embd, np.float32))
        rand(f"blk.{i}.ffn_gate.weight", n_ff, n_embd)
        rand(f"blk.{i}.ffn_up.weight", n_ff, n_embd)
        rand(f"blk.{i}.ffn_down.weight", n_embd, n_ff)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama.gguf")


@pytest.fixture(scope="session")
def truncated_gguf(tiny_gguf, tmp_path_factory) -> Path:
    """The tiny model cut short: the header is fine, tensor data runs past the end of the file."""
    path = tmp_path_factory.mktemp("bad-models") / "truncated.gguf"
    data = tiny_gguf.read_bytes()
    path.write_bytes(data[: len(data) * 2 // 5])
    return path


@pytest.fixture
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(autouse=True)
def _stop_every_started_worker(monkeypatch):
    """Whatever a test starts is stopped after it, even when the test fails half-way."""
    from orchestrator.launch import process

    started: list = []
    original = process.WorkerProcess.__init__

    def recording_init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        started.append(self)

    monkeypatch.setattr(process.WorkerProcess, "__init__", recording_init)
    yield started
    for proc in started:
        proc.stop(grace=2)
