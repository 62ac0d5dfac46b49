"""The suite runs with a private home, cache and state (tests/conftest.py), and still finds the llama.cpp build."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from orchestrator.paths import cache_dir, state_dir


def test_home_cache_and_state_are_private_to_the_run(private_root):
    root = private_root
    assert Path(os.environ["HOME"]).parent == root and Path(os.path.expanduser("~")).parent == root
    assert cache_dir().parent == root and state_dir().parent == root
    assert not any(v in os.environ for v in ("XDG_CACHE_HOME", "XDG_STATE_HOME"))
    # a child process sees the same
    out = subprocess.run([sys.executable, "-c", "from orchestrator.paths import state_dir; print(state_dir())"],
                         capture_output=True, text=True, check=True).stdout.strip()
    assert Path(out).parent == root


def test_the_llama_cpp_build_is_still_found(llama_server_path):
    assert Path(llama_server_path).is_file()


def test_the_final_check_sees_a_new_file_and_skips_the_shared_build(tmp_path, home_writes):
    since = time.time() - 1.0
    (tmp_path / "llama.cpp").mkdir()
    (tmp_path / "llama.cpp" / "built").write_text("x")
    assert home_writes(since, [tmp_path]) == []
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "mn1.log").write_text("x")
    assert sorted(home_writes(since, [tmp_path])) == [tmp_path / "logs", tmp_path / "logs" / "mn1.log"]
    assert home_writes(time.time() + 60, [tmp_path]) == []
