"""lab/bench/routing_by_position.py: the LRU hit rate by position window of a routing trace."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from orchestrator.model.routing_profile import Trace, lru_distances

SCRIPT = Path(__file__).resolve().parents[2] / "lab" / "bench" / "routing_by_position.py"
spec = importlib.util.spec_from_file_location("routing_by_position", SCRIPT)
rbp = importlib.util.module_from_spec(spec)
spec.loader.exec_module(rbp)


def _trace(n_tokens: int, local_until: int, seed: int = 3) -> Trace:
    """Two layers of 64 experts, top 4: the first ``local_until`` tokens pick among 6 experts, the rest at random."""
    rng = np.random.default_rng(seed)
    ids = np.empty((n_tokens, 2, 4), np.int32)
    for t in range(n_tokens):
        for layer in range(2):
            pool = 6 if t < local_until else 64
            ids[t, layer] = rng.choice(pool, 4, replace=False)
    return Trace(64, 4, (0, 1), ids)


def test_windows_see_the_local_start_that_the_whole_trace_averages_away():
    tr = _trace(600, local_until=129)
    r = rbp.by_position(tr, 8)
    (a0, b0, early, early_warm, early_shared), (a1, b1, second, _w, late_shared), (a2, b2, third, _w2, _s) = r["windows"]
    assert (a0, b0, a1, b1, a2, b2) == (1, 129, 129, 257, 257, 513)
    assert len(r["windows"]) == 3                              # 513-768 is past the trace's end
    assert early_warm == 1.0                                  # 6 experts fit 8 slots: only first uses miss
    assert early > 0.98 and third < 0.2 and r["all"] < early
    assert early_shared > 0.4 > late_shared
    # the windows are the whole trace's replay cut, not a replay of their own
    hit = lru_distances(tr) < 8
    assert r["all"] == pytest.approx(hit.mean())
    assert third == pytest.approx(hit[257:513].mean())
