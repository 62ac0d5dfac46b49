"""Fixtures for the cluster unit tests: a tiny GGUF, a private state dir."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cluster_support import write_tiny_llama  # noqa: E402


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("models") / "tiny.gguf")


@pytest.fixture()
def state_home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("ORCHESTRATOR_STATE", str(tmp_path / "state"))
    return tmp_path / "state"
