"""The generator's routing locality, calibrated: recorded decode-order traces of the demo-sized model and the
recorded profile of W1 (through llama.cpp, tests/fixtures/routing/README.md says how) against the public
Qwen3-30B-A3B facts, as shares of a layer's 128 experts (routing_profile.DEFAULT_CURVE says where they come from).
tests/integration/test_routing.py measures the same thing live."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.model import routing_profile as R

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "routing"
# 24.3 / 48.7 / 81.3 of 128 experts per layer -> 74.1 / 89.4 / 96.2% (the default curve's points)
QWEN3_FACTS = {73 / 3 / 128: 0.741, 146 / 3 / 128: 0.894, 244 / 3 / 128: 0.962}


def _profile(name):
    path = FIX / f"demo-locality-{name}.trace"
    return R.profile(R.parse_trace(path.read_bytes(), str(path)))


def test_default_locality_of_w1_hits_like_qwen3_30b_a3b():
    """W1 (full-width Qwen3-30B-A3B shape, the H200 benchmarks' model) at the default locality: within 5 points of
    the public curve at each of its points."""
    import json
    import lzma

    d = json.loads(lzma.open(FIX / "w1-loc-default.profile.json.xz").read())
    p = R.RoutingProfile.from_json(d.get("profile", d))
    assert (p.n_expert, p.n_expert_used, p.n_tokens) == (128, 8, 1024)
    c = p.curve()
    for f, want in QWEN3_FACTS.items():
        assert R.hit_rate(c, f) == pytest.approx(want, abs=0.05), f
    # recorded: 76.9 / 90.6 / 94.8%
    assert [round(R.hit_rate(c, f), 3) for f in QWEN3_FACTS] == [0.769, 0.906, 0.948]


def test_default_locality_of_the_demo_model():
    """The demo-sized model (an eighth of the width) at the default locality is more local than Qwen3-30B-A3B
    where the cache is small: 84% against 74% at 19% of the experts, within 4 points from 38% on."""
    p = _profile("default")
    assert (p.n_expert, p.n_expert_used, p.n_tokens, len(p.layers)) == (128, 8, 1024, 6)
    (small, mid, large) = QWEN3_FACTS
    for policy in R.POLICIES:
        c = p.curve(policy)
        assert QWEN3_FACTS[small] < R.hit_rate(c, small) < QWEN3_FACTS[small] + 0.12, policy
        for f in (mid, large):
            assert R.hit_rate(c, f) == pytest.approx(QWEN3_FACTS[f], abs=0.04), (policy, f)
    # recorded at calibration: per-layer LRU 84.1 / 92.6 / 95.4%
    c = p.curve()
    assert [round(R.hit_rate(c, f), 3) for f in QWEN3_FACTS] == [0.841, 0.926, 0.954]
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
