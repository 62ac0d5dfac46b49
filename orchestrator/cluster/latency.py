"""The latency users feel, as the gateway sees it: bucket bounds, a sliding window of recent observations, and
quantiles read back from bucket counts. Pure; the clock is passed in.

The gateway exports each observation twice: into a cumulative histogram (``ray.util.metrics``, for Prometheus and
Grafana, which compute rates and quantiles over any range) and into a :class:`RecentWindow` whose bucket counts
over the last :data:`WINDOW_S` seconds it exports as gauges. ``status`` reads those gauges from Ray's metrics
endpoint once, without a Prometheus, and turns them into p50/p95 with :func:`quantile`; several gateway processes
each export their own counts, which add up because they are counts, not quantiles.
"""

from __future__ import annotations

import bisect
import collections
import re
from typing import Iterable, Mapping, Sequence

# seconds: 10 ms to 60 s in steps of about 1.5x (a p95 read from these is within half a step)
SECONDS_BUCKETS: tuple[float, ...] = (0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5,
                                      2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0)
# tokens per second of one stream: a large model on a CPU to a tiny one (whose events come several to a read)
RATE_BUCKETS: tuple[float, ...] = (1.0, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 50.0, 75.0, 100.0, 150.0,
                                   200.0, 300.0, 500.0, 750.0, 1000.0, 1500.0, 2000.0, 3000.0, 5000.0, 7500.0,
                                   10000.0, 20000.0)
WINDOW_S = 300.0        # what `status` calls "recent"
SLOT_S = 10.0           # the window moves in steps of this


def le_label(bound: float) -> str:
    """A bucket's upper bound as Prometheus writes it (``+Inf`` for the last)."""
    return "+Inf" if bound == float("inf") else repr(float(bound))


class RecentWindow:
    """Bucket counts of the observations of the last ``window_s`` seconds, kept in slots of ``slot_s``: memory
    is one count per bucket and slot, whatever the request rate."""

    def __init__(self, bounds: Sequence[float], window_s: float = WINDOW_S, slot_s: float = SLOT_S) -> None:
        self.bounds = tuple(bounds)
        self.window_s, self.slot_s = window_s, slot_s
        self._slots: collections.deque[tuple[int, list[int]]] = collections.deque()

    def observe(self, value: float, now: float) -> None:
        slot = int(now // self.slot_s)
        if not self._slots or self._slots[-1][0] != slot:
            self._slots.append((slot, [0] * (len(self.bounds) + 1)))
        self._slots[-1][1][bisect.bisect_left(self.bounds, value)] += 1
        self._expire(now)

    def _expire(self, now: float) -> None:
        oldest = int((now - self.window_s) // self.slot_s)
        while self._slots and self._slots[0][0] <= oldest:
            self._slots.popleft()

    def counts(self, now: float) -> list[int]:
        """Observations per bucket (the last one above every bound), not cumulative."""
        self._expire(now)
        out = [0] * (len(self.bounds) + 1)
        for _, c in self._slots:
            for i, n in enumerate(c):
                out[i] += n
        return out

    def cumulative(self, now: float) -> dict[str, int]:
        """``le -> observations <= le``, the shape of a Prometheus histogram's buckets."""
        out, total = {}, 0
        for bound, n in zip(self.bounds + (float("inf"),), self.counts(now)):
            total += n
            out[le_label(bound)] = total
        return out


def quantile(q: float, cumulative: Mapping[str, float]) -> float | None:
    """The ``q`` quantile of a histogram given as ``le -> cumulative count``, interpolated linearly inside its
    bucket as Prometheus' ``histogram_quantile`` does; None without observations. Above the last finite bound the
    answer is that bound (the histogram says no more)."""
    pts = sorted((float(le), float(n)) for le, n in cumulative.items())
    if not pts or pts[-1][1] <= 0:
        return None
    total = pts[-1][1]
    rank = q * total
    prev_bound, prev_n = 0.0, 0.0
    for bound, n in pts:
        if n >= rank and n > prev_n:
            if bound == float("inf"):
                return prev_bound
            return prev_bound + (bound - prev_bound) * (rank - prev_n) / (n - prev_n)
        prev_bound, prev_n = (bound if bound != float("inf") else prev_bound), n
    return prev_bound


def add_histograms(parts: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """The sum of several processes' bucket counts (same bounds)."""
    out: dict[str, float] = {}
    for p in parts:
        for le, n in p.items():
            out[le] = out.get(le, 0.0) + float(n)
    return out


_SAMPLE = re.compile(r'^([A-Za-z_:][A-Za-z0-9_:]*)\{(.*)\}\s+(\S+)')
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')
TTFT_WINDOW = "orchestrator_gateway_recent_time_to_first_token"
RATE_WINDOW = "orchestrator_gateway_recent_stream_tokens_per_second"


def recent_from_page(text: str, prefix: str = "ray_") -> dict[str, dict[str, float | None]]:
    """Per replica, from a Prometheus text page (Ray's metrics endpoint, whose names carry ``prefix``): streams of
    the last minutes, p50/p95 time to first token (s) and p50 tokens/s per stream, every gateway process's counts
    added together (Ray labels each process's series with its WorkerId)."""
    parts: dict[tuple[str, str], dict[str, float]] = {}
    names = {prefix + TTFT_WINDOW: "ttft", prefix + RATE_WINDOW: "rate"}
    for line in text.splitlines():
        if not line.startswith(prefix + "orchestrator_gateway_recent_"):
            continue
        m = _SAMPLE.match(line)
        if not m or m.group(1) not in names:
            continue
        labels = dict(_LABEL.findall(m.group(2)))
        if "replica" not in labels or "le" not in labels:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        h = parts.setdefault((names[m.group(1)], labels["replica"]), {})
        h[labels["le"]] = h.get(labels["le"], 0.0) + value
    out: dict[str, dict[str, float | None]] = {}
    for (kind, replica), h in parts.items():
        row = out.setdefault(replica, {})
        if kind == "ttft":
            row["streams"] = h.get("+Inf", 0.0)
            row["ttft_p50_s"], row["ttft_p95_s"] = quantile(0.5, h), quantile(0.95, h)
        else:
            row["tokens_per_s_p50"] = quantile(0.5, h)
    return out


WORKER_RATES = {"orchestrator_worker_prompt_tokens_per_second": "prompt_tps",
                "orchestrator_worker_generation_tokens_per_second": "generation_tps"}


def worker_rates_from_page(text: str, prefix: str = "ray_") -> dict[str, dict[str, float]]:
    """Per worker, the tokens/s gauges as Ray's metrics endpoint exports them (``prompt_tps``,
    ``generation_tps``): what Prometheus and Grafana read, so ``status`` shows the same numbers. A worker whose
    actor was re-created may have a series of the old process too; the larger value is taken."""
    names = {prefix + k: v for k, v in WORKER_RATES.items()}
    out: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        if not line.startswith(prefix + "orchestrator_worker_"):
            continue
        m = _SAMPLE.match(line)
        if not m or m.group(1) not in names:
            continue
        worker = dict(_LABEL.findall(m.group(2))).get("worker")
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        if worker is not None:
            row = out.setdefault(worker, {})
            key = names[m.group(1)]
            row[key] = max(row.get(key, value), value)
    return out
