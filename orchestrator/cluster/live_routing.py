"""The model's routing profile from what a deployment served, and the live hit rate beside the predicted one.

With ``workers.live_routing: on`` every worker's llama-server keeps the router's picks of the tokens it generated
last (``--router-trace N``, our patch of llama.cpp) and returns them as a routing trace on ``GET /router-trace``.
:class:`LiveRouting` (run by the controller) reads every worker's trace now and then and at the stop, joins them,
and caches their routing profile as the model's (:func:`orchestrator.model.routing.served_profile`), where the
next ``plan`` and ``up`` read it instead of a profile of a built-in text or the default curve.

:func:`compare_hit_rates` is what ``status`` says: each worker's live expert-cache hit rate (the counters
llama-server exports, as ``up`` samples them) beside the plan's prediction.
"""

from __future__ import annotations

import http.client
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping
from urllib.parse import urlsplit

import numpy as np

from orchestrator.errors import ModelError

TRACE_PATH = "/router-trace"
FLAG = "--router-trace"
# the ring each worker keeps ("on") is ROUTER_TRACE_TOKENS (launch/worker_spec.py): 2048 generated tokens, twice
# what `orchestrator model --routing` traces by default. Their profile took 30 s on a busy core of a 2-core machine
# for a 48-layer, 128-expert model (the replay of the CPU-miss rule is most of it), so it is made in a thread
# fewer tokens than this say little about locality: no profile is made from them
MIN_TOKENS = 256
HARVEST_S = 120.0       # between two reads of the workers' traces (each read makes a profile when tokens were added)
# live against predicted: a difference beyond this many points of hit rate is reported. The cache's counters follow
# the profile's replay of the same traffic within 5 points (tests/backend/test_expert_cache_rpc.py,
# test_router_trace_rpc.py), so a larger gap says the traffic routes otherwise than the profile the plan used, or
# that more streams share the cache than planned
DIFFER_POINTS = 5.0


@dataclass(frozen=True)
class WorkerTrace:
    """One worker's answer: its trace (None when it has none yet) and its counters."""

    url: str
    trace: Any = None                 # routing_profile.Trace
    recorded: int = 0                 # tokens recorded since its llama-server started
    skipped: int = 0                  # generated tokens it could not attribute
    error: str = ""


def fetch_trace(url: str, api_key: str | None = None, timeout: float = 10.0) -> WorkerTrace:
    """``GET url/router-trace``: the worker's trace, or why there is none (never raises on a bad answer)."""
    from orchestrator.model.routing_profile import parse_trace

    parts = urlsplit(url)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    conn = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=timeout)
    try:
        conn.request("GET", TRACE_PATH, headers=headers)
        resp = conn.getresponse()
        body = resp.read(256 << 20)
        recorded = int(resp.getheader("X-Router-Trace-Recorded") or 0)
        skipped = int(resp.getheader("X-Router-Trace-Skipped") or 0)
    except (OSError, http.client.HTTPException, ValueError) as e:
        return WorkerTrace(url, error=f"{url}{TRACE_PATH}: {e}")
    finally:
        conn.close()
    if resp.status == 503:                     # on, nothing generated yet
        return WorkerTrace(url, None, recorded, skipped)
    if resp.status != 200:
        return WorkerTrace(url, None, recorded, skipped, f"{url}{TRACE_PATH}: HTTP {resp.status}")
    try:
        return WorkerTrace(url, parse_trace(body, f"{url}{TRACE_PATH}"), recorded, skipped)
    except ModelError as e:
        return WorkerTrace(url, None, recorded, skipped, str(e))


def join_traces(traces: Iterable) -> Any:
    """The traces one after another (each is a series of streams already): one trace of the same model."""
    from orchestrator.model.routing_profile import Trace

    traces = [t for t in traces if t is not None]
    if not traces:
        return None
    first = traces[0]
    for t in traces[1:]:
        if (t.n_expert, t.n_expert_used, t.layers) != (first.n_expert, first.n_expert_used, first.layers):
            raise ModelError(f"the workers' router traces disagree on the model: {t.n_expert} experts top "
                             f"{t.n_expert_used} over {len(t.layers)} layers against {first.n_expert} top "
                             f"{first.n_expert_used} over {len(first.layers)}")
    return Trace(first.n_expert, first.n_expert_used, first.layers, np.concatenate([t.ids for t in traces]))


@dataclass
class LiveRouting:
    """Reads the workers' router traces and caches the model's profile of them. ``tick`` starts a read in a
    thread when one is due; ``finish`` makes the last one (bounded in time) when the deployment stops."""

    model_path: str
    api_key: str | None = None
    interval: float = HARVEST_S
    cache: Path | None = None
    min_tokens: int = MIN_TOKENS
    clock: Callable[[], float] = time.monotonic
    fetch: Callable[..., WorkerTrace] = fetch_trace
    last: dict = field(default_factory=dict)
    _next: float = 0.0
    _recorded_at_save: int = -1
    _thread: threading.Thread | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def from_specs(cls, specs: Iterable, api_key: str | None = None, **kw) -> "LiveRouting | None":
        """The harvester of a deployment whose workers keep a router trace (their argv has ``--router-trace``);
        None when none does."""
        for spec in specs:
            if FLAG in spec.argv and spec.settings is not None and spec.settings.model_path:
                return cls(spec.settings.model_path, api_key, **kw)
        return None

    def tick(self, urls: list[str]) -> None:
        now = self.clock()
        if not urls or now < self._next or (self._thread is not None and self._thread.is_alive()):
            return
        self._next = now + self.interval
        self._thread = threading.Thread(target=self.harvest, args=(list(urls),), name="live-routing", daemon=True)
        self._thread.start()

    def finish(self, urls: list[str], timeout: float = 10.0) -> dict:
        """The last read, before the workers stop: waits for one in flight, then reads and profiles for at most
        ``timeout`` seconds (a profile not done by then is left; the last one saved stands)."""
        if self._thread is not None:
            self._thread.join(timeout)
        t = threading.Thread(target=self.harvest, args=(list(urls),), name="live-routing-last", daemon=True)
        t.start()
        t.join(timeout)
        return self.status()

    def harvest(self, urls: list[str]) -> dict:
        """Read every worker's trace; when they hold at least ``min_tokens`` tokens and more were recorded since
        the last profile, cache the profile of all of them. Returns what it did (also :meth:`status`)."""
        from orchestrator.model.routing import served_profile

        got = [self.fetch(u, self.api_key) for u in urls]
        errors = [w.error for w in got if w.error]
        traces = [w.trace for w in got if w.trace is not None]
        recorded = sum(w.recorded for w in got)
        out: dict = {"workers": len(urls), "tokens": sum(t.n_tokens for t in traces), "recorded": recorded,
                     "skipped": sum(w.skipped for w in got), "errors": errors, "at": time.time()}
        try:
            tr = join_traces(traces)
            if tr is None or tr.n_tokens < self.min_tokens:
                out["note"] = f"{out['tokens']} generated tokens recorded, fewer than {self.min_tokens}: no profile yet"
            elif recorded == self._recorded_at_save:
                out["note"] = "nothing generated since the last profile"
            elif not Path(self.model_path).is_file():
                out["note"] = f"{self.model_path}: the model file is not on this machine: no profile"
            else:
                _prof, path = served_profile(self.model_path, tr, len(traces), self.cache)
                self._recorded_at_save = recorded
                out["profile"] = str(path)
                out["note"] = f"profile of {tr.n_tokens} generated tokens saved"
        except (ModelError, OSError) as e:
            out["errors"] = [*errors, str(e)]
        with self._lock:
            self.last = out
        return out

    def status(self) -> dict:
        with self._lock:
            return dict(self.last)


# --------------------------------------------------------------------------------------------------------------
# live against predicted


def predicted_hit_rates(worker_plan: Mapping[str, Any]) -> tuple[float, float, int] | None:
    """(one stream's, ``streams`` streams', streams) predicted hit rate of a planned worker's expert cache, from
    the plan's JSON; None without a cache."""
    cache = (worker_plan or {}).get("expert_cache") or {}
    chosen = cache.get("chosen") or {}
    if not cache.get("use_cache") or "hit_rate" not in chosen:
        return None
    streams = int(chosen.get("streams") or 1)
    many = float(chosen.get("stream_hit_rate") or 0.0) if streams > 1 else 0.0
    one = float(chosen["hit_rate"])
    return one, (many or one), streams


def compare_hit_rates(status: Mapping[str, Any], points: float = DIFFER_POINTS) -> list[dict]:
    """Per worker with an expert cache: its live hit rate (``metrics.expert_cache_hit_ratio``, hits / lookups over
    the last sample) beside the plan's, and whether they differ by more than ``points``. With several parallel
    slots the prediction spans one stream's and all streams' hit rate (the live one depends on how many decoded
    together); only a live rate outside that span, by more than ``points``, differs."""
    plans = {w.get("name"): w for w in ((status.get("plan") or {}).get("workers") or [])}
    out = []
    for w in status.get("workers") or []:
        pred = predicted_hit_rates(plans.get(w.get("name"), {}))
        if pred is None:
            continue
        live = ((w.get("metrics") or {}).get("expert_cache_hit_ratio"))
        one, many, streams = pred
        lo, hi = min(one, many), max(one, many)
        row = {"name": w.get("name"), "predicted": one, "predicted_streams": many, "streams": streams,
               "live": live, "differs": False, "points": None}
        if live is not None:
            gap = 0.0 if lo <= live <= hi else (lo - live if live < lo else live - hi)
            row["points"] = round(100 * gap, 1)
            row["differs"] = 100 * gap > points
        out.append(row)
    return out


def format_hit_rates(rows: list[dict], live_routing: Mapping[str, Any] | None = None,
                     points: float = DIFFER_POINTS) -> list[str]:
    """``status`` lines for :func:`compare_hit_rates`' rows and the last live profile."""
    lines = []
    for r in rows:
        pred = f"{r['predicted']:.1%}" + (f" (1 stream) .. {r['predicted_streams']:.1%} ({r['streams']} streams)"
                                          if r["streams"] > 1 else "")
        if r["live"] is None:
            lines.append(f"{r['name']}: expert cache hit rate predicted {pred}; live: no lookups sampled yet")
            continue
        line = f"{r['name']}: expert cache hit rate live {r['live']:.1%}, predicted {pred}"
        if r["differs"]:
            line += (f" -- differs by {r['points']:.1f} points (more than {points:g}): the traffic routes "
                     f"otherwise than the profile the plan used" + ("" if live_routing else
                                                                    "; workers.live_routing: on profiles it"))
        lines.append(line)
    if live_routing:
        note = live_routing.get("note") or ""
        errs = "; ".join(live_routing.get("errors") or [])
        lines.append(f"live routing: {note}" + (f" ({errs})" if errs else ""))
    return lines
