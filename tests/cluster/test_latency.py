"""The latency window and the quantiles read back from bucket counts (pure)."""

from __future__ import annotations

import random

import pytest

from orchestrator.cluster.latency import SECONDS_BUCKETS, RecentWindow, add_histograms, le_label, quantile


def test_quantile_interpolates_inside_the_bucket_like_prometheus():
    # 10 observations: 4 in (0, 0.1], 4 in (0.1, 0.2], 2 in (0.2, 0.5]
    cum = {"0.1": 4, "0.2": 8, "0.5": 10, "+Inf": 10}
    assert quantile(0.5, cum) == pytest.approx(0.1 + 0.1 * (5 - 4) / 4)
    assert quantile(0.95, cum) == pytest.approx(0.2 + 0.3 * (9.5 - 8) / 2)
    assert quantile(0.2, cum) == pytest.approx(0.1 * 2 / 4)
    assert quantile(0.5, {"0.1": 0, "+Inf": 0}) is None and quantile(0.5, {}) is None
    # above the last bound: the last bound (the histogram knows no more)
    assert quantile(0.95, {"0.1": 0, "1.0": 1, "+Inf": 10}) == 1.0


def test_window_quantiles_come_close_to_the_exact_ones():
    rng = random.Random(7)
    values = [rng.lognormvariate(-2.5, 0.8) for _ in range(5000)]      # median ~ 82 ms
    w = RecentWindow(SECONDS_BUCKETS)
    for i, v in enumerate(values):
        w.observe(v, 1000.0 + i * 0.01)
    cum = w.cumulative(1050.0)
    exact = sorted(values)
    for q in (0.5, 0.95):
        got, want = quantile(q, cum), exact[int(q * len(exact))]
        assert abs(got - want) / want < 0.15, (q, got, want)
    assert cum["+Inf"] == 5000 and list(cum)[0] == le_label(SECONDS_BUCKETS[0])


def test_the_window_forgets_what_is_older_than_its_length():
    w = RecentWindow((1.0, 2.0), window_s=60.0, slot_s=10.0)
    w.observe(0.5, 100.0)
    w.observe(1.5, 125.0)
    assert w.counts(130.0) == [1, 1, 0]
    assert w.counts(165.0) == [0, 1, 0]           # the slot of t=100 ended more than 60 s ago
    assert w.counts(500.0) == [0, 0, 0] and w.cumulative(500.0)["+Inf"] == 0
    w.observe(5.0, 501.0)
    assert w.counts(501.0) == [0, 0, 1]


def test_counts_of_several_processes_add_up():
    a = {"0.1": 1, "+Inf": 2}
    b = {"0.1": 3, "+Inf": 3}
    assert add_histograms([a, b]) == {"0.1": 4.0, "+Inf": 5.0}
