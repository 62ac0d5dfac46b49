"""Shared test fixtures.

Real parts are used wherever they exist here: the llama-server built by `orchestrator build` (scripts/setup.sh
builds it before the suite runs), numactl, Ray. A test that needs a GPU is marked `gpu` and skipped without one.
"""

from __future__ import annotations

import shutil
import signal
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "fixtures"

# A test run started in the background (`bash .ci/run &`) inherits SIGINT ignored, and so would every process the
# tests start: the tests that press Ctrl-C (up in the foreground, synth-model mid-write, the NUMA wrapper) would
# see nothing happen. With a handler here, children start with the default disposition again (exec resets it).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _has_nvidia_gpu() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return pynvml.nvmlDeviceGetCount() > 0
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return False


HAS_GPU = _has_nvidia_gpu()


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU; the device counterpart is recorded in docs/benchmarks.md")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def llama_server_path() -> str:
    """The real llama-server (from $LLAMA_SERVER, PATH or orchestrator's build cache). Fails, never skips:
    scripts/setup.sh builds it before the suite runs."""
    from orchestrator.backend.detect import find_llama_server

    path, _origin = find_llama_server(None)
    return path


@pytest.fixture(scope="session")
def numactl_path() -> str:
    exe = shutil.which("numactl")
    assert exe, "numactl must be installed (scripts/setup.sh installs it)"
    return exe


@pytest.fixture()
def isolated_cache(tmp_path, monkeypatch):
    """A private ORCHESTRATOR_CACHE for tests that write to the cache."""
    monkeypatch.setenv("ORCHESTRATOR_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"
