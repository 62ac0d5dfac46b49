"""Routing profile: how well an expert cache would hit, computed from a decode-order routing trace.

A trace (written by ``native/expert_usage.cpp --trace``; format below) lists, for every token of a stream
evaluated one token per ``llama_decode`` as generation runs, the experts its router picked in every MoE layer.
:func:`profile` turns it into hit-rate curves -- the hit rate of an LRU expert cache against its size -- and
coverage statistics. Everything here is pure (no processes, no files): the plan reads curves as values.

Two LRU policies, both with the size given as a fraction of the host-resident experts:

* ``lru-layer``: one LRU per MoE layer, each holding ``fraction * n_expert`` experts of its own layer.
* ``lru-global``: one LRU over the experts of all layers with a shared budget of ``fraction * n_layers *
  n_expert`` slots (a cache whose slots any layer may take).

A lookup happens when a token reaches a layer; the token's picks in that layer are looked up together, then
become the most recently used, in the router's order. An expert is a hit when it is among the ``slots`` most
recently used experts (of its layer, or of all layers) at that moment. The cache starts empty (first uses are
misses), as a server's cache does.

Trace format (little-endian): ``b"EXPTRACE"``, u32 version (1), u32 n_expert, u32 n_expert_used (k), u32 n_layers,
u32 n_tokens, u32 reserved, i32[n_layers] model layer indices, then u16[n_tokens][n_layers][k] expert ids
(token-major in decode order, then layer, then the router's top-k order).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from orchestrator.errors import ModelError

TRACE_MAGIC = b"EXPTRACE"
TRACE_VERSION = 1
_HEAD = struct.Struct("<8sIIIIII")

POLICIES = ("lru-layer", "lru-global")


@dataclass(frozen=True)
class Trace:
    """Expert ids picked per token (decode order), per traced MoE layer, in router order: ``ids[t, l, r]``."""

    n_expert: int
    n_expert_used: int
    layers: tuple[int, ...]
    ids: np.ndarray   # (n_tokens, n_layers, k), integer

    @property
    def n_tokens(self) -> int:
        return int(self.ids.shape[0])


def parse_trace(data: bytes, name: str = "trace") -> Trace:
    """Read a trace; a malformed one raises :class:`ModelError` naming ``name`` and what is wrong."""
    if len(data) < _HEAD.size:
        raise ModelError(f"{name}: too short for a routing trace ({len(data)} bytes)")
    magic, version, n_expert, k, n_layers, n_tokens, _ = _HEAD.unpack_from(data)
    if magic != TRACE_MAGIC:
        raise ModelError(f"{name}: not a routing trace (magic {magic!r})")
    if version != TRACE_VERSION:
        raise ModelError(f"{name}: routing trace version {version}, expected {TRACE_VERSION}")
    if not (n_expert and k and n_layers and n_tokens) or k > n_expert:
        raise ModelError(f"{name}: routing trace header has n_expert {n_expert}, k {k}, layers {n_layers}, "
                         f"tokens {n_tokens}")
    off = _HEAD.size
    want = off + 4 * n_layers + 2 * n_tokens * n_layers * k
    if len(data) != want:
        raise ModelError(f"{name}: routing trace is {len(data)} bytes, its header says {want}")
    layers = tuple(int(x) for x in np.frombuffer(data, "<i4", n_layers, off))
    ids = np.frombuffer(data, "<u2", n_tokens * n_layers * k, off + 4 * n_layers).reshape(n_tokens, n_layers, k)
    if int(ids.max()) >= n_expert:
        raise ModelError(f"{name}: expert id {int(ids.max())} out of range (n_expert {n_expert})")
    return Trace(n_expert, k, layers, ids.astype(np.int32))


def trace_bytes(trace: Trace) -> bytes:
    """The trace in the file format (the inverse of :func:`parse_trace`)."""
    t, nl, k = trace.ids.shape
    head = _HEAD.pack(TRACE_MAGIC, TRACE_VERSION, trace.n_expert, k, nl, t, 0)
    return head + np.asarray(trace.layers, "<i4").tobytes() + np.asarray(trace.ids, "<u2").tobytes()


# --------------------------------------------------------------------------------------------------------------
# curves


@dataclass(frozen=True)
class CpuMissRates:
    """What the cache does with CPU-computed misses (``--moe-cache-cpu-misses``), per expert pick, against its
    size as a fraction of the experts: the share found in a slot (``hits``) and the share uploaded because it was
    used again within the cache's horizon (``uploads``); the rest is computed on the CPU. Simulated on a trace with
    the patch's own rule (:func:`cpu_miss_rates`)."""

    fractions: tuple[float, ...]
    hits: tuple[float, ...]
    uploads: tuple[float, ...]

    def at(self, fraction: float) -> tuple[float, float]:
        """(hits, uploads) at ``fraction``, linear between the simulated sizes, constant beyond the ends."""
        f = float(fraction)
        return (float(np.interp(f, self.fractions, self.hits)), float(np.interp(f, self.fractions, self.uploads)))

    def to_json(self) -> dict:
        return {"fractions": list(self.fractions), "hits": [round(h, 5) for h in self.hits],
                "uploads": [round(u, 5) for u in self.uploads]}

    @classmethod
    def from_json(cls, d: dict) -> "CpuMissRates":
        return cls(tuple(float(x) for x in d["fractions"]), tuple(float(x) for x in d["hits"]),
                   tuple(float(x) for x in d["uploads"]))


@dataclass(frozen=True)
class HitCurve:
    """Hit rate (0..1) of an expert cache against its size as a fraction of the host-resident experts.

    ``fractions`` ascend from 0; ``hits`` do not descend. ``source`` says where the numbers come from.
    ``cpu_misses``: the same cache with CPU-computed misses, when the curve comes from a measured trace.
    ``distinct``: (window tokens, distinct experts one layer uses in such a window, the mean over windows and
    layers) from the same trace; empty for a curve not measured.
    """

    fractions: tuple[float, ...]
    hits: tuple[float, ...]
    source: str
    policy: str = "lru-layer"
    cpu_misses: CpuMissRates | None = None
    distinct: tuple[tuple[int, float], ...] = ()

    def __post_init__(self):
        if len(self.fractions) != len(self.hits) or len(self.fractions) < 2:
            raise ValueError("a hit curve needs at least two (fraction, hit) points")
        if any(b <= a for a, b in zip(self.fractions, self.fractions[1:])):
            raise ValueError("hit curve fractions must ascend")
        if any(b < a - 1e-12 for a, b in zip(self.hits, self.hits[1:])):
            raise ValueError("hit curve hits must not descend")

    def to_json(self) -> dict:
        return {"policy": self.policy, "source": self.source, "fractions": list(self.fractions),
                "hits": list(self.hits),
                **({"cpu_misses": self.cpu_misses.to_json()} if self.cpu_misses is not None else {}),
                **({"distinct": [[w, v] for w, v in self.distinct]} if self.distinct else {})}

    @classmethod
    def from_json(cls, d: dict) -> "HitCurve":
        cpu = d.get("cpu_misses")
        return cls(tuple(float(x) for x in d["fractions"]), tuple(float(x) for x in d["hits"]),
                   str(d.get("source", "")), str(d.get("policy", "lru-layer")),
                   CpuMissRates.from_json(cpu) if cpu else None,
                   tuple((int(w), float(v)) for w, v in d.get("distinct", ())))


# The default curve: Qwen3-30B-A3B (128 experts, top 8), an LRU per layer, cold, 256 decode tokens, all experts
# host-resident (kekzl/imp PR #1374, Qwen3-30B-A3B-Q4_K_M). That PR sizes the cache as a share of free VRAM (5 / 15
# / 30 / 50%) and reports 24 / 73 / 146 / 244 slots per layer; a slot there holds one matrix (gate, up or down) of
# one expert: its 24-slot row is "3 * top_k", the cache that "barely holds a single token" (PR #1374, after PR
# #1365), and the pool is indexed [layer][projection][expert] (PR #1369). So the experts held per layer are
# slots / 3, and as a share of the layer's 128 experts:
#   24 slots =  8 experts =  6.25%  -> 36.6% hits
#   73 slots = 24.3       = 19.0%   -> 74.1%
#  146 slots = 48.7       = 38.0%   -> 89.4%
#  244 slots = 81.3       = 63.5%   -> 96.2%
# Read as shares of the experts, the VRAM percentages (5 / 15 / 30 / 50%) would overstate the hit rate by 1-8
# points between 15% and 50%, and put 37% at a cache smaller than one token's 8 picks. Two other public runs of
# the same model agree: 73.0% with 24 of 128 experts per layer after a 400-token warm-up (JustVugg/colibri PR
# #697) and 90.0-95.3% steady state at 40% of the experts (kekzl/imp PR #1359).
MEASURED_SHAPE = (128, 8)   # (n_expert, n_expert_used) of the model the default curve was measured on
DEFAULT_CURVE = HitCurve(
    (0.0, 8 / 128, 73 / 3 / 128, 146 / 3 / 128, 244 / 3 / 128, 1.0), (0.0, 0.366, 0.741, 0.894, 0.962, 1.0),
    source="default (public Qwen3-30B-A3B decode measurements, 128 experts, top 8: an LRU per layer holding "
           "6.25 / 19 / 38 / 63.5% of a layer's experts hit 37 / 74 / 89 / 96%)")

# Models of other families, measured in public, hit less at the same number of experts held per token picked
# (t = experts a layer's cache holds / top-k: how many tokens' picks it holds):
#   t =  1.0 -> 22.8%  OLMoE-1B-7B (64 experts, top 8), 8 experts per layer (JustVugg/colibri, issues/1441)
#   t =  3.1 -> 43.5%  Qwen3.8-Flash-Next (512 experts, top 10), 300 tokens of generated text, LRU per layer at
#   t =  6.2 -> 62.0%  93 / 186 / 279 / 372 / 512 slots per layer, a slot being one expert matrix as above
#   t =  9.3 -> 72.0%  (kekzl/imp PR #2061; the same model's per-layer LRU over a 54k-record mixed workload:
#   t = 12.4 -> 78.9%  67% at 64 experts, t = 6.4, and 81% at 128, t = 12.8: ggml-org/llama.cpp PR #27861)
#   t = 17.1 -> 85.0%
# Qwen3-30B-A3B holds 3 tokens' picks at 19% of its experts and hits 74% there; these models hit 44%. As a share of
# the experts the 512-expert model sits level with Qwen3-30B-A3B (it picks 2% of its experts per token, Qwen3 6.25%),
# so neither axis alone carries the locality across families. The default for an unmeasured family takes the lower
# of the two readings: these points at t = share * n_expert / top-k, and the measured curve at the same share; and
# never less than the share itself (what independent routing hits).
OTHER_FAMILY_POINTS = ((1.0, 0.228), (3.1, 0.435), (6.2, 0.620), (9.3, 0.720), (12.4, 0.789), (17.1, 0.850))


# Per family, where public decode traces of the real models exist, their points on the same axis (t = experts a
# layer's cache holds / top-k). Both lie far below the other-family points at the same t, so below them the family
# curve is a line from 0 to its own point; beyond its last point it joins OTHER_FAMILY_POINTS:
#   deepseek2  t = 1.9 -> 13%   DeepSeek-V4-Flash (61 MoE layers x 256 experts, top 6), --moe-cache-size 700
#              (= 11.5 experts per layer, 4.5% of them), decode over a 12-minute serving window of long-form text:
#              LRU miss rate 82-92%, hits 8-18% (github.com/FlashML-org/FreeToken/issues/174; the nearest published relative
#              of DeepSeek-V3 and Kimi-K2: 256 routed experts, sigmoid routing, a shared expert). That cache admits
#              only the misses it fetched over PCIe, so a plain LRU would hit at least this much.
#   gpt-oss    t = 1.1 -> 8.5%  gpt-oss-120b (36 layers x 128 experts, top 4), one LRU over (layer, expert) of
#              2000 MiB: 8-9% hits at "3% residency" (github.com/Helldez/BigMoeOnEdge/issues/33); an MXFP4 expert of
#              3 x 2880 x 2880 weights is 13.2 MB, so 2000 MiB hold 159 experts, 4.4 a layer (3.4%), 1.1 tokens'
#              picks. gpt-oss-20b: no public trace; gpt-oss-120b's points, the same family.
#   glm4moe    no public trace of GLM-4.5 or GLM-4.5-Air was found: deepseek2's points, the closest family (sigmoid
#              routing with a correction bias, one shared expert, dense leading layers).
FAMILY_POINTS = {
    "deepseek2": ((1.9, 0.13),),
    "gpt-oss": ((1.1, 0.085),),
}
FAMILY_SOURCES = {
    "deepseek2": "public DeepSeek-V4-Flash decode trace: an LRU of 4.5% of the experts (1.9 tokens' picks) "
                 "hit 8-18%, FlashML-org/FreeToken#174",
    "gpt-oss": "public gpt-oss-120b decode trace: an LRU of 3.4% of the experts (1.1 tokens' picks) hit 8-9%, "
               "Helldez/BigMoeOnEdge#33",
}
FAMILY_NAMES = {"deepseek2": "DeepSeek-V3 / Kimi-K2", "gpt-oss": "gpt-oss", "glm4moe": "GLM-4.5"}
# families without a public trace, and the family whose points they take
NEAREST_FAMILY = {"glm4moe": "deepseek2"}


def default_curve(n_expert: int, n_expert_used: int, arch: str = "") -> HitCurve:
    """The stated default hit-rate curve for a model of ``n_expert`` experts, ``n_expert_used`` per token and
    architecture ``arch``, when no routing profile was measured: the family's curve where public traces of that
    family exist (:data:`FAMILY_POINTS`, or the nearest family's, :data:`NEAREST_FAMILY`); else
    :data:`DEFAULT_CURVE` for the measured shape (128 experts, top 8), or the more cautious curve of
    :data:`OTHER_FAMILY_POINTS` (see above). Its ``source`` starts with "default" and names the curve's source."""
    e, k = int(n_expert), int(n_expert_used)
    family = NEAREST_FAMILY.get(arch, arch)
    if family in FAMILY_POINTS and e > 0 and k > 0:
        if k > e:
            raise ValueError(f"top-k {k} > {e} experts")
        own = FAMILY_POINTS[family]
        points = own + tuple(p for p in OTHER_FAMILY_POINTS if p[0] > own[-1][0])
        borrowed = f", the nearest family's (no public trace of {arch})" if family != arch else ""
        return _cautious_curve(e, k, points,
                               f"default {FAMILY_NAMES.get(arch, arch)} curve for {e} experts, top {k} "
                               f"({FAMILY_SOURCES[family]}{borrowed}; beyond that, public curves of less local "
                               f"models, read at the same experts held per token picked)")
    if (e, k) == MEASURED_SHAPE or e <= 0 or k <= 0:
        return DEFAULT_CURVE
    if k > e:
        raise ValueError(f"top-k {k} > {e} experts")
    return _cautious_curve(e, k, OTHER_FAMILY_POINTS,
                           f"default for {e} experts, top {k} (no profile of this family: public curves of "
                           f"less local models, read at the same experts held per token picked)")


def _cautious_curve(e: int, k: int, points: tuple[tuple[float, float], ...], source: str) -> HitCurve:
    """The lower of two readings: ``points`` (t = experts held per layer / top-k -> hit rate) at
    t = share * e / k, and :data:`DEFAULT_CURVE` at the same share; never less than the share itself (what
    independent routing hits)."""
    per_token = k / e
    inside = [(t * per_token, h) for t, h in points if t * per_token < 1.0]
    other = HitCurve((0.0, *(f for f, _ in inside), 1.0), (0.0, *(h for _, h in inside), 1.0), "")
    # the lower of two curves, written at both curves' points and every 2% between (so that interpolating the
    # result does not rise above either)
    grid = sorted({*DEFAULT_CURVE.fractions, *other.fractions, *(i / 50 for i in range(51))})
    hits: list[float] = []
    for f in grid:
        h = max(f, min(hit_rate(DEFAULT_CURVE, f), hit_rate(other, f)))
        hits.append(max(h, hits[-1]) if hits else h)
    return HitCurve(tuple(grid), tuple(hits), source=source)


def _pchip_slopes(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Fritsch-Carlson slopes: the cubic through the points stays monotone where the points are."""
    h = np.diff(x)
    delta = np.diff(y) / h
    m = np.zeros_like(y)
    m[0], m[-1] = delta[0], delta[-1]
    for i in range(1, len(x) - 1):
        if delta[i - 1] * delta[i] <= 0:
            m[i] = 0.0
        else:
            w1, w2 = 2 * h[i] + h[i - 1], h[i] + 2 * h[i - 1]
            m[i] = (w1 + w2) / (w1 / delta[i - 1] + w2 / delta[i])
    for i, d in enumerate(delta):   # ends: keep the sign and at most 3x the secant
        if d == 0:
            m[i] = m[i + 1] = 0.0
    m[0] = min(max(m[0], 0.0), 3 * delta[0]) if delta[0] > 0 else 0.0
    m[-1] = min(max(m[-1], 0.0), 3 * delta[-1]) if delta[-1] > 0 else 0.0
    return m


def hit_rate(curve: HitCurve, fraction: float) -> float:
    """The curve's hit rate at a cache of ``fraction`` of the host-resident experts (monotone cubic
    interpolation between the points; constant beyond the ends; never outside 0..1)."""
    x = np.asarray(curve.fractions, float)
    y = np.asarray(curve.hits, float)
    f = float(fraction)
    if f <= x[0]:
        return float(min(max(y[0], 0.0), 1.0))
    if f >= x[-1]:
        return float(min(max(y[-1], 0.0), 1.0))
    i = int(np.searchsorted(x, f, side="right") - 1)
    m = _pchip_slopes(x, y)
    h = x[i + 1] - x[i]
    s = (f - x[i]) / h
    h00, h10 = 2 * s**3 - 3 * s**2 + 1, s**3 - 2 * s**2 + s
    h01, h11 = -2 * s**3 + 3 * s**2, s**3 - s**2
    v = h00 * y[i] + h10 * h * m[i] + h01 * y[i + 1] + h11 * h * m[i + 1]
    lo, hi = min(y[i], y[i + 1]), max(y[i], y[i + 1])
    return float(min(max(v, lo), hi))


_COLD = np.iinfo(np.int64).max   # distance of a first use: a miss at every size


def lru_distances(trace: Trace, policy: str = "lru-layer") -> np.ndarray:
    """For every pick ``(t, l, r)``: how many experts were used more recently than this one when the token
    reached the layer (its LRU stack distance; ``_COLD`` for a first use). An LRU of ``s`` slots hits exactly
    the picks whose distance is below ``s``."""
    if policy not in POLICIES:
        raise ValueError(f"policy {policy!r}: expected one of {POLICIES}")
    ids = trace.ids
    t_n, nl, k = ids.shape
    e_n = trace.n_expert
    out = np.empty((t_n, nl, k), np.int64)
    # last use of each (layer, expert) as an increasing stamp: ((token * layers) + layer) * k + rank
    last = np.full((nl, e_n), -1, np.int64)
    rows = np.arange(nl)[:, None]
    stamp_base = (np.arange(nl)[:, None] * k + np.arange(k)[None, :])
    if policy == "lru-global":
        layer_of = np.repeat(np.arange(nl), k)
        earlier_layer = layer_of[None, :] < layer_of[:, None]          # [j, i]: i's layer before j's
    for t in range(t_n):
        picks = ids[t]
        p = last[rows, picks]                                            # (nl, k) previous stamps
        if policy == "lru-layer":
            d = (last[:, None, :] > p[:, :, None]).sum(-1)
        else:
            flat_old = np.sort(last, axis=None)
            pf = p.reshape(-1)
            newer = flat_old.size - np.searchsorted(flat_old, pf, side="right")
            # picks of earlier layers in this token are newer than anything before it: count each once
            old_of_earlier = pf[None, :] > pf[:, None]                   # [j, i]: i's old stamp is newer than j's
            d = (newer - (old_of_earlier & earlier_layer).sum(1) + layer_of * k).reshape(nl, k)
        out[t] = np.where(p < 0, _COLD, d)
        last[rows, picks] = t * nl * k + stamp_base
    return out


def _hits_by_slots(dist: np.ndarray, max_slots: int) -> np.ndarray:
    """hits[s] = fraction of picks with distance < s, for s = 0..max_slots."""
    d = dist.reshape(-1)
    hist = np.bincount(np.minimum(d, max_slots).astype(np.int64), minlength=max_slots + 1)
    cum = np.concatenate([[0], np.cumsum(hist)[:-1]])
    return cum[: max_slots + 1] / max(d.size, 1)


CPU_MISS_FRACTIONS = (0.05, 0.10, 0.15, 0.20, 0.30, 0.40, 0.50, 0.75, 1.0)


def cpu_miss_rates(trace: Trace, fractions: tuple[float, ...] = CPU_MISS_FRACTIONS) -> CpuMissRates:
    """Replay ``trace`` through the patch's cache with CPU-computed misses, one bank per layer of
    ``round(fraction * n_expert)`` slots: a pick in a slot is a hit; a pick missing from the slots is uploaded
    (into the least recently used slot that the token does not use) when fewer than the slot count of distinct
    experts were used since its own last use (an LRU of that size would hold it), else computed on the CPU.
    A token's picks are used together. Returns the hit and upload shares of all picks at each size (0 and 0 where
    a bank would hold fewer experts than one token picks: the cache does not serve that)."""
    ids = trace.ids
    t_n, nl, k = ids.shape
    e_n = trace.n_expert
    rows = np.arange(nl)[:, None]
    hits_out, ups_out = [], []
    for f in fractions:
        slots = int(round(f * e_n))
        if slots < k:                                  # a bank smaller than one token's picks serves nothing
            hits_out.append(0.0)
            ups_out.append(0.0)
            continue
        ghost = np.full((nl, e_n), -1, np.int64)      # last use of every expert, cached or not
        stamp = np.full((nl, e_n), -1, np.int64)      # last use of the experts in slots; -1 = not in a slot
        filled = np.zeros(nl, np.int64)
        hits = ups = 0
        for t in range(t_n):
            picks = ids[t]
            cached = stamp[rows, picks] >= 0
            g = ghost[rows, picks]
            recency = (ghost[:, None, :] > g[:, :, None]).sum(-1)
            admit = ~cached & (g >= 0) & (recency < slots)
            hits += int(cached.sum())
            ups += int(admit.sum())
            stamp[rows, picks] = np.where(cached, t, stamp[rows, picks])
            for li in np.flatnonzero(admit.any(1)):
                for e in picks[li][admit[li]]:
                    if filled[li] < slots:
                        filled[li] += 1
                    else:
                        row = stamp[li]
                        older = np.flatnonzero((row >= 0) & (row < t))
                        row[older[np.argmin(row[older])]] = -1
                    stamp[li, e] = t
            ghost[rows, picks] = t
        n = max(1, t_n * nl * k)
        hits_out.append(hits / n)
        ups_out.append(ups / n)
    return CpuMissRates(tuple(float(f) for f in fractions), tuple(hits_out), tuple(ups_out))


@dataclass(frozen=True)
class LayerStats:
    layer: int
    hits: tuple[float, ...]      # per-layer LRU hit rate with s = 0..n_expert slots
    experts_for_90: int          # fewest experts that cover 90% of the layer's picks over the whole trace
    distinct: tuple[tuple[int, float], ...]   # (window tokens, mean distinct experts per window)
    consecutive_overlap: float   # mean share of a token's picks that the previous token also picked


@dataclass(frozen=True)
class RoutingProfile:
    """Hit-rate curves and coverage of one trace: ``curve(policy)`` is what the plan reads."""

    n_expert: int
    n_expert_used: int
    n_tokens: int
    layers: tuple[LayerStats, ...]
    global_hits: tuple[float, ...]   # global LRU hit rate with s * n_layers slots, s = 0..n_expert
    source: str
    cpu_misses: CpuMissRates | None = None   # per-layer banks with CPU-computed misses (None: not simulated)

    def fractions(self) -> tuple[float, ...]:
        return tuple(s / self.n_expert for s in range(self.n_expert + 1))

    def layer_total(self) -> tuple[float, ...]:
        """Per-layer LRUs, all layers together (each layer has as many picks, so the mean)."""
        return tuple(float(np.mean([ls.hits[s] for ls in self.layers])) for s in range(self.n_expert + 1))

    def curve(self, policy: str = "lru-layer") -> HitCurve:
        if policy not in POLICIES:
            raise ValueError(f"policy {policy!r}: expected one of {POLICIES}")
        hits = self.layer_total() if policy == "lru-layer" else self.global_hits
        return HitCurve(self.fractions(), tuple(float(h) for h in hits), self.source, policy,
                        self.cpu_misses if policy == "lru-layer" else None, self.distinct_windows())

    def distinct_windows(self) -> tuple[tuple[int, float], ...]:
        """(window tokens, distinct experts a layer uses in such a window), the mean over layers: windows every
        layer has. Each layer's count as the profile stores it (3 decimals), so a profile read back gives the same."""
        shared = set.intersection(*(set(w for w, _ in ls.distinct) for ls in self.layers)) if self.layers else set()
        return tuple((w, float(np.mean([round(dict(ls.distinct)[w], 3) for ls in self.layers])))
                     for w in sorted(shared))

    def to_json(self) -> dict:
        return {
            "n_expert": self.n_expert, "n_expert_used": self.n_expert_used, "n_tokens": self.n_tokens,
            "source": self.source,
            "curves": {p: self.curve(p).to_json() for p in POLICIES},
            "layers": [{"layer": ls.layer, "hits": [round(h, 5) for h in ls.hits],
                        "experts_for_90": ls.experts_for_90,
                        "distinct": [[w, round(v, 3)] for w, v in ls.distinct],
                        "consecutive_overlap": round(ls.consecutive_overlap, 5)} for ls in self.layers],
            **({"cpu_misses": self.cpu_misses.to_json()} if self.cpu_misses is not None else {}),
        }

    @classmethod
    def from_json(cls, d: dict) -> "RoutingProfile":
        layers = tuple(LayerStats(int(x["layer"]), tuple(float(h) for h in x["hits"]), int(x["experts_for_90"]),
                                  tuple((int(w), float(v)) for w, v in x["distinct"]),
                                  float(x["consecutive_overlap"])) for x in d["layers"])
        glob = tuple(float(h) for h in d["curves"]["lru-global"]["hits"])
        cpu = CpuMissRates.from_json(d["cpu_misses"]) if d.get("cpu_misses") else None
        return cls(int(d["n_expert"]), int(d["n_expert_used"]), int(d["n_tokens"]), layers, glob, str(d["source"]),
                   cpu)


WINDOWS = (8, 32, 128, 512)


def profile(trace: Trace, source: str = "measured") -> RoutingProfile:
    """Hit-rate curves (both policies) and coverage statistics of ``trace``."""
    e_n, k = trace.n_expert, trace.n_expert_used
    t_n, nl, _ = trace.ids.shape
    d_layer = lru_distances(trace, "lru-layer")
    d_glob = lru_distances(trace, "lru-global")
    glob_all = _hits_by_slots(d_glob, nl * e_n)
    global_hits = tuple(float(glob_all[s * nl]) for s in range(e_n + 1))
    stats = []
    for li, layer in enumerate(trace.layers):
        ids = trace.ids[:, li, :]
        counts = np.sort(np.bincount(ids.reshape(-1), minlength=e_n))[::-1]
        cover = int(np.searchsorted(np.cumsum(counts), 0.9 * counts.sum() - 1e-9) + 1)
        distinct = []
        for w in WINDOWS:
            if t_n >= w:
                n_win = t_n // w
                distinct.append((w, float(np.mean([len(np.unique(ids[i * w:(i + 1) * w])) for i in range(n_win)]))))
        if t_n > 1:
            onehot = np.zeros((t_n, e_n), bool)
            onehot[np.arange(t_n)[:, None], ids] = True
            overlap = float((onehot[1:] & onehot[:-1]).sum(1).mean() / k)
        else:
            overlap = 0.0
        stats.append(LayerStats(layer, tuple(float(h) for h in _hits_by_slots(d_layer[:, li, :], e_n)), cover,
                                tuple(distinct), overlap))
    return RoutingProfile(e_n, k, t_n, tuple(stats), global_hits, source, cpu_miss_rates(trace))


def format_profile(p: RoutingProfile, points: tuple[float, ...] = (0.05, 0.10, 0.15, 0.30, 0.50)) -> str:
    """The curve at a few sizes (both policies, per layer) and the coverage, as text."""
    lay, glob = p.curve("lru-layer"), p.curve("lru-global")
    lines = [f"routing profile: {p.n_tokens} tokens in decode order, {len(p.layers)} MoE layers, "
             f"{p.n_expert} experts (top {p.n_expert_used}); {p.source}",
             "LRU hit rate by cache size (fraction of host-resident experts):",
             f"  {'size':>6} {'slots/layer':>11} {'per-layer LRU':>13} {'global LRU':>10}"]
    for f in points:
        lines.append(f"  {f:>6.0%} {f * p.n_expert:>11.1f} {hit_rate(lay, f):>13.1%} {hit_rate(glob, f):>10.1%}")
    if p.cpu_misses is not None:
        lines.append("with CPU-computed misses (--moe-cache-cpu-misses), hits / uploaded / on the CPU:")
        for f in points:
            h, u = p.cpu_misses.at(f)
            if round(f * p.n_expert) >= p.n_expert_used:
                lines.append(f"  {f:>6.0%} {h:>7.1%} / {u:.1%} / {max(0.0, 1 - h - u):.1%}")
    lines.append(f"  {'layer':>6} " + " ".join(f"{f:>6.0%}" for f in points)
                 + f" {'90% cover':>9} {'overlap':>7}")
    for ls in p.layers:
        c = HitCurve(p.fractions(), ls.hits, "")
        lines.append(f"  {ls.layer:>6} " + " ".join(f"{hit_rate(c, f):>6.1%}" for f in points)
                     + f" {ls.experts_for_90:>9} {ls.consecutive_overlap:>7.1%}")
    return "\n".join(lines)
