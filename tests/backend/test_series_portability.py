"""The patch series applies three-way, without conflicts, to the llama.cpp of an older and the pinned release.

The llama.cpp vendored in llama-cpp-python 0.3.33 and in the pinned release are downloaded and cached as
``orchestrator build`` does (``orchestrator/backend/sources.py``: ``~/.cache/orchestrator/sources``, sha256
checked), laid out as a git repository beside the pinned tree (whose blobs the patches name), and every patch of the
product series is applied in order with ``git apply --3way``: the patches' full upstream blob ids let git merge a hunk
whose context moved. A conflict marker in any file, or a patch git refuses, fails the test. Skipped, with the reason,
where the sources cannot be downloaded.

All of the series on both: llama-server's batch bookkeeping and its /metrics code were rewritten between 0.3.33 and
0.3.36, and the server's patches (the router trace, the cache's /metrics) merge into both because their hooks are
single calls on lines both releases share, the code behind them in the series' own files.
"""

from __future__ import annotations

import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from lab import llama_series as ls
from orchestrator.backend import patches, sources
from orchestrator.errors import BackendError
from orchestrator.paths import cache_dir

PIN = sources.SOURCES["mainline"]
# an older release, pinned as the build pins its source (the package index's sdist and its sha256)
OLDER = replace(PIN, version="0.3.33",
                url="https://files.pythonhosted.org/packages/ad/5c/ca0eb0a3cd91918620dbcbefe46ef90335f75c62be8198a9e93fd2b9bb0f/"
                    "llama_cpp_python-0.3.33.tar.gz",
                sha256="369ba03d02caaef42c1ed07bbdc454f7436e47c7675b8b9757fa13fbac6acd92",
                subdir="llama_cpp_python-0.3.33/vendor/llama.cpp")


@pytest.mark.integration
@pytest.mark.parametrize("pin", [OLDER, PIN], ids=lambda p: p.version)
def test_the_series_applies_three_way_without_conflicts(tmp_path, pin):
    try:
        sources.fetch(pin, cache_dir(), progress=lambda s: None)
    except BackendError as err:
        pytest.skip(f"llama-cpp-python {pin.version}'s source cannot be downloaded here: {err}")
    # the pinned tree first, whose blobs the patches name, then the release's own tree on top: as a maintainer's
    # repository holds llama.cpp's history
    repo = ls.lay_out(tmp_path / "llama.cpp", PIN, say=lambda s: None)
    if pin != PIN:
        ls.move_to(repo, pin, say=lambda s: None)
    series = patches.series("mainline")
    assert len(series) >= 2
    for p in series:
        res = subprocess.run(["git", "apply", "--3way", "--whitespace=nowarn", str(p)], cwd=repo,
                             capture_output=True, text=True)
        assert res.returncode == 0, f"{p.name} on {pin.version}: {res.stderr.strip()}"
        unmerged = subprocess.run(["git", "diff", "--name-only", "--diff-filter=U"], cwd=repo,
                                  capture_output=True, text=True).stdout.split()
        assert not unmerged, f"{p.name} on {pin.version}: conflicts in {unmerged}"
    markers = subprocess.run(["git", "grep", "-l", "-E", "^(<<<<<<<|>>>>>>>) "], cwd=repo, capture_output=True,
                             text=True).stdout.split()
    assert not markers, markers
    # what the series adds is there: the cache's own files and its hooks in the scheduler, and the server's hooks
    assert (repo / "ggml/src/ggml-moe-cache-sched.cpp").is_file()
    assert "ggml_moe_sched_copy_input" in Path(repo / "ggml/src/ggml-backend.cpp").read_text()
    server = Path(repo / "tools/server/server-context.cpp").read_text()
    for hook in ("server_router_trace_init(", "server_router_trace_begin(", "server_router_trace_end(",
                 "server_moe_cache_metrics_read(", "server_moe_cache_metrics_wrap("):
        assert hook in server, f"{hook} not in tools/server/server-context.cpp on {pin.version}"
    assert "server_router_trace_get(" in Path(repo / "tools/server/server.cpp").read_text()
