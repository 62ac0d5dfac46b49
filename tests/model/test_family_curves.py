"""The plan's default hit-rate curve per model family: each family's public points on the axis of experts held
per token picked, the nearest family's where none are public, and the source said with the curve."""

from __future__ import annotations

import pytest

from orchestrator.model import routing_profile as R
from orchestrator.model import shapes as S


@pytest.mark.parametrize("like", ["deepseek-v3", "kimi-k2", "gpt-oss-120b", "gpt-oss-20b", "glm-4.5-air", "glm-4.5"])
def test_every_family_has_its_curve_and_says_where_from(like):
    s = S.get(like)
    c = R.default_curve(s.n_expert, s.n_expert_used, s.arch)
    family = R.NEAREST_FAMILY.get(s.arch, s.arch)
    assert c.source.startswith(f"default {R.FAMILY_NAMES[s.arch]} curve") and R.FAMILY_SOURCES[family] in c.source
    assert ("nearest family" in c.source) == (family != s.arch)
    # the family's public point holds where it lies inside the curve: at the share that holds t tokens' picks
    for t, h in R.FAMILY_POINTS[family]:
        share = t * s.n_expert_used / s.n_expert
        if share < 1:
            assert R.hit_rate(c, share) == pytest.approx(max(h, share), abs=0.01), (like, t)
    # never above the Qwen3 curve or the other-family points, never below independent routing
    for i in range(1, 51):
        f = i / 50
        v = R.hit_rate(c, f)
        assert f - 1e-9 <= v <= R.hit_rate(R.DEFAULT_CURVE, f) + 0.005, (like, f)


def test_families_are_more_cautious_than_qwen3_at_small_caches():
    qwen = R.default_curve(128, 8, "qwen3moe")
    assert qwen is R.DEFAULT_CURVE
    glm = R.default_curve(128, 8, "glm4moe")             # the same expert count and top-k as Qwen3-30B-A3B
    assert glm is not R.DEFAULT_CURVE
    assert R.hit_rate(glm, 0.19) < R.hit_rate(qwen, 0.19) - 0.2
    # gpt-oss-120b's public point: 8.5% with 4.4 of 128 experts a layer (1.1 tokens' picks)
    assert R.hit_rate(R.default_curve(128, 4, "gpt-oss"), 4.4 / 128) == pytest.approx(0.085, abs=0.005)
    # an architecture without a family curve keeps the generic one
    assert R.default_curve(64, 8, "olmoe").source.startswith("default for 64 experts, top 8")
    with pytest.raises(ValueError):
        R.default_curve(8, 9, "gpt-oss")
