"""The router trace's ring (tools/server/server-router-trace.h of the series), compiled from the pinned source with
the series applied: what it keeps, drops and skips, and the trace it returns (read by the project's parser).
Skipped with the reason while the series has no router-trace patch."""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest

from orchestrator.backend import build as b
from orchestrator.backend import patches, sources
from orchestrator.model.routing_profile import parse_trace

HERE = Path(__file__).resolve().parent


def _picks(d: int, r: int) -> list[list[int]]:
    return [[(10 * d + 2 * r + j + layer) % 64 for j in range(2)] for layer in (1, 3)]


def test_the_ring_keeps_the_last_tokens_per_slot_in_decode_order(tmp_path):
    if not any(p.name.endswith("-router-trace.patch") for p in patches.series("mainline")):
        pytest.skip("no router-trace patch in the series")
    archive = sources.fetch(sources.SOURCES["mainline"], b.cache_dir(), progress=lambda s: None)
    root = sources.extract(archive, tmp_path / "src", sources.SOURCES["mainline"].subdir)
    patches.apply(root, patches.series("mainline"), lambda s: None, strict=True)
    exe = tmp_path / "router_trace_ring_test"
    argv = ["c++", "-O1", "-std=c++17", str(HERE / "router_trace_ring_test.cpp"), f"-I{root / 'tools' / 'server'}",
            f"-I{root / 'ggml' / 'include'}", "-o", str(exe)]
    res = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    run = subprocess.run([str(exe)], capture_output=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stderr.decode().strip() == "recorded 6 skipped 5"     # the skipped: 2 with a layer missing, 3 told

    tr = parse_trace(run.stdout, "ring")
    assert (tr.n_expert, tr.n_expert_used, tr.layers) == (64, 2, (1, 3))
    # six tokens in decode order: (decode, row, slot); the ring of 5 dropped the first, then each slot's in order
    slot0 = [(2, 0), (3, 0)]                # (decode, row) of slot 0's tokens it kept
    slot1 = [(0, 1), (1, 1), (2, 1)]
    want = np.array([_picks(d, r) for d, r in slot0 + slot1])
    assert tr.ids.tolist() == want.tolist()
