"""Fixtures for tests/launch: tiny real GGUF models (tests/tiny_llama.py), a corrupt one, free ports."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # tests/: the shared tiny model writer
from tiny_llama import write_tiny_llama  # noqa: E402


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
