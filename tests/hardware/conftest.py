"""Fixtures for hardware tests: the recorded machines in tests/fixtures/sysfs, extracted once per session."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SYSFS = REPO / "tests" / "fixtures" / "sysfs"
MACHINES = REPO / "tests" / "fixtures" / "machines"
EXPECTED = json.loads((SYSFS / "expected.json").read_text())
DUMPS = sorted(EXPECTED)


@pytest.fixture(scope="session")
def extracted(tmp_path_factory):
    """name -> root directory (holding sys/) of each extracted dump; extracted lazily, once per session."""
    base = tmp_path_factory.mktemp("dumps")
    cache: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in cache:
            d = base / name
            d.mkdir()
            with tarfile.open(SYSFS / name) as tf:
                if hasattr(tarfile, "data_filter"):
                    tf.extractall(d, filter="data")
                else:  # Python < 3.10.12 / 3.11.4: our own fixtures, trusted
                    tf.extractall(d)
            cache[name] = d / EXPECTED[name]["root"]
        return cache[name]

    return get


_CLI_CACHE = tempfile.mkdtemp(prefix="orch-hw-cli-cache-")
atexit.register(shutil.rmtree, _CLI_CACHE, True)


def run_cli(*args: str, env: dict | None = None, user: int | None = None, timeout: float = 300):
    """Run ``python -m orchestrator ARGS`` from this worktree (with a private cache unless ``env`` names one);
    returns CompletedProcess (text)."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "ORCHESTRATOR_CACHE": _CLI_CACHE, **(env or {})}
    return subprocess.run([sys.executable, "-m", "orchestrator", *args], capture_output=True, text=True,
                          env=full_env, cwd=str(REPO), timeout=timeout, user=user)


def assert_one_line_error(res, *needles: str) -> None:
    """Exit 2, no traceback, one line on stderr that mentions each needle."""
    out = res.stdout + res.stderr
    assert "Traceback" not in out, out
    assert res.returncode == 2, (res.returncode, out)
    lines = [l for l in res.stderr.splitlines() if l.strip()]
    assert len(lines) == 1, res.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])
