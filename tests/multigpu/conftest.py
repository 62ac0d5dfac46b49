"""What the multi-GPU tests share: ggml-rpc-server next to the llama-server under test, and the test model."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.model import synth
from orchestrator.model.reader import read_model


@pytest.fixture(scope="session")
def rpc_server(llama_server_path) -> str:
    path = Path(llama_server_path).with_name("ggml-rpc-server")
    assert path.is_file(), f"{path}: not built; orchestrator's build of llama.cpp includes ggml-rpc-server"
    return str(path)


@pytest.fixture(scope="session")
def model(tmp_path_factory):
    """A Qwen3-30B-A3B-shaped model at a quarter of its widths (12 layers, 128 experts, 294 MB, q4_0)."""
    path = synth.write_model(tmp_path_factory.mktemp("multigpu") / "m.gguf", "qwen3-30b-a3b", scale=0.25,
                             quant="q4_0", seed=21, fsync=False).path
    return read_model(path)
