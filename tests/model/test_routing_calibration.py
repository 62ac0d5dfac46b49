"""The generator's routing locality, calibrated: recorded decode-order traces of the demo-sized model (through
llama.cpp, tests/fixtures/routing/README.md says how) against the public Qwen3-30B-A3B facts.
tests/integration/test_routing.py measures the same thing live."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.model import routing_profile as R

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "routing"
QWEN3_FACTS = {0.15: 0.74, 0.30: 0.89, 0.50: 0.96}


def _profile(name):
    path = FIX / f"demo-locality-{name}.trace"
    return R.profile(R.parse_trace(path.read_bytes(), str(path)))


def test_default_locality_hits_like_qwen3_30b_a3b():
    p = _profile("default")
    assert (p.n_expert, p.n_expert_used, p.n_tokens, len(p.layers)) == (128, 8, 1024, 6)
    for policy in R.POLICIES:
        c = p.curve(policy)
        for f, want in QWEN3_FACTS.items():
            assert R.hit_rate(c, f) == pytest.approx(want, abs=0.05), (policy, f)
    # recorded at calibration: per-layer LRU 78.1 / 90.9 / 94.1%
    c = p.curve()
    assert [round(R.hit_rate(c, f), 3) for f in QWEN3_FACTS] == [0.781, 0.909, 0.941]
    # yet most experts are in use: no layer lives on a small hot set
    for ls in p.layers:
        assert dict(ls.distinct)[512] >= 0.9 * 128
        assert 0.4 * 128 < ls.experts_for_90 < 0.8 * 128
        assert ls.consecutive_overlap > 0.3


def test_locality_off_routes_every_token_independently():
    c = _profile("off").curve()
    for f in (0.05, 0.15, 0.30, 0.50):
        assert R.hit_rate(c, f) == pytest.approx(f, abs=0.03)
    for ls in _profile("off").layers:
        assert ls.consecutive_overlap < 0.12      # 8/128 = 6% by chance


def test_high_locality_hits_more_than_the_default():
    hi, de = _profile("high").curve(), _profile("default").curve()
    for f in (0.05, 0.15, 0.30):
        assert R.hit_rate(hi, f) > R.hit_rate(de, f) + 0.02
