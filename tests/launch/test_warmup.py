"""The warm-up recipe with real numactl and real files."""

from __future__ import annotations

import os
import shutil

import pytest

from orchestrator.launch.warmup import drop_caches, numactl_prefix, warm


def test_numactl_prefix_is_taken_from_the_worker_argv():
    argv = ["/r/scripts/numa/disable-numa-balancing.sh", "numactl", "--physcpubind=0-3", "--membind=0", "--",
            "llama-server", "-m", "x.gguf"]
    assert numactl_prefix(argv) == ["numactl", "--physcpubind=0-3", "--membind=0"]
    assert numactl_prefix(["llama-server", "-m", "x"]) == []


def test_warm_reads_the_file_under_the_binding(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(os.urandom(1 << 20))
    assert shutil.which("numactl")
    assert warm([str(f)], ["numactl", "--physcpubind=0", "--membind=0", "--", "llama-server"]) >= 0.0
    assert warm([str(f)], ["llama-server"]) >= 0.0


def test_warm_failure_is_a_launch_error(tmp_path):
    from orchestrator.errors import LaunchError

    with pytest.raises(LaunchError, match="warm-up"):
        warm([str(tmp_path / "missing.gguf")], ["llama-server"])


def test_drop_caches_without_permission_is_a_note(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    msg = drop_caches(str(ro / "no-such-dir" / "drop_caches"))
    assert msg.startswith("cannot write") and "page cache kept" in msg
