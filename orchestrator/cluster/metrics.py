"""What a worker measures about its llama-server, and where it reports it.

- llama-server's own ``/metrics`` (enabled by ``--metrics``): token counters turned into tokens/s between two
  scrapes, requests processing / deferred;
- resident memory of the llama-server process tree (psutil);
- per GPU the worker uses (NVML, when GPUs exist): memory used, utilisation, temperature, power, and the VRAM
  held by the worker's processes;
- the node's NUMA-balancing state (``/proc/sys/kernel/numa_balancing``, read under a root path), once per node:
  by the one worker of the node that holds the node's :class:`NodeClaim`;
- the expert cache's counters (``llamacpp:moe_cache_*``, when llama-server runs one): lookups, misses, uploaded
  bytes, the slots' VRAM and the hit ratio of the last interval.

Values go to a :class:`MetricsSink`; in an actor that is :class:`orchestrator.cluster.ray_api.RayMetricsSink`
(``ray.util.metrics``, shown by the Ray dashboard and its Prometheus endpoint), in tests a dict.
"""

from __future__ import annotations

import collections
import http.client
import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Protocol
from urllib.parse import urlsplit

from orchestrator.cluster.latency import RATE_BUCKETS, SECONDS_BUCKETS
from orchestrator.hardware.nvml import Nvml

# name -> (kind, description). Exported by Ray with the prefix "ray_".
METRICS: dict[str, tuple[str, str]] = {
    "orchestrator_worker_healthy": ("gauge", "1 when the worker's llama-server answers /health, else 0"),
    "orchestrator_worker_restarts": ("counter", "llama-server restarts of the worker"),
    "orchestrator_worker_prompt_tokens_per_second": ("gauge", "prompt tokens processed per second (last 30 s)"),
    "orchestrator_worker_generation_tokens_per_second": ("gauge", "tokens generated per second (last 30 s)"),
    "orchestrator_worker_requests_in_flight": ("gauge", "requests llama-server is processing"),
    "orchestrator_worker_requests_deferred": ("gauge", "requests waiting for a free llama-server slot"),
    "orchestrator_worker_resident_memory_bytes": ("gauge", "resident memory of the llama-server process tree"),
    "orchestrator_worker_vram_bytes": ("gauge", "GPU memory held by the worker's processes, per GPU"),
    "orchestrator_gpu_memory_used_bytes": ("gauge", "GPU memory used (whole device)"),
    "orchestrator_gpu_utilization_percent": ("gauge", "GPU utilisation"),
    "orchestrator_gpu_temperature_celsius": ("gauge", "GPU temperature"),
    "orchestrator_gpu_power_watts": ("gauge", "GPU power draw"),
    "orchestrator_worker_expert_cache_hit_ratio": ("gauge", "expert cache: hits / lookups since the last scrape "
                                                   "(the last value while nothing was looked up)"),
    "orchestrator_worker_expert_cache_lookups": ("counter", "expert cache: experts looked up (per batch and tensor)"),
    "orchestrator_worker_expert_cache_misses": ("counter", "expert cache: lookups not found in a slot (uploaded, "
                                                "or computed on the CPU)"),
    "orchestrator_worker_expert_cache_cpu_misses": ("counter", "expert cache: misses computed on the CPU instead of "
                                                    "uploaded (--moe-cache-cpu-misses)"),
    "orchestrator_worker_expert_cache_uploaded_bytes": ("counter", "expert cache: bytes uploaded from host memory"),
    "orchestrator_worker_expert_cache_prompt_saved_bytes": ("counter", "expert cache: bytes prompts read from its "
                                                            "slots instead of copying them from host memory"),
    "orchestrator_worker_expert_cache_prompt_copied_bytes": ("counter", "expert cache: bytes prompts on the GPU "
                                                             "copied from host memory"),
    "orchestrator_worker_expert_cache_bytes": ("gauge", "expert cache: GPU memory held by its slots"),
    "orchestrator_node_numa_balancing": ("gauge", "kernel.numa_balancing on the node (0 = off)"),
    "orchestrator_gateway_requests": ("counter", "requests the gateway answered, by model and HTTP status"),
    "orchestrator_gateway_requests_in_flight": ("gauge", "requests the gateway is proxying, per replica"),
    "orchestrator_gateway_healthy_replicas": ("gauge", "replicas the gateway routes to"),
    "orchestrator_gateway_time_to_first_token_seconds": ("histogram", "streamed answers: from the end of the "
                                                         "request to the first byte of its answer's body"),
    "orchestrator_gateway_request_duration_seconds": ("histogram", "proxied requests: from the end of the request "
                                                      "to the end of its answer"),
    "orchestrator_gateway_stream_tokens_per_second": ("histogram", "streamed answers: events (about one per token) "
                                                      "per second after the first, per stream"),
    "orchestrator_gateway_recent_time_to_first_token": ("gauge", "streamed answers of the last 5 minutes whose time "
                                                        "to first token was at most le seconds (per gateway "
                                                        "process; read by `status`)"),
    "orchestrator_gateway_recent_stream_tokens_per_second": ("gauge", "streamed answers of the last 5 minutes with "
                                                             "at most le tokens per second"),
}
# bucket bounds of the histograms (Ray adds +Inf)
BUCKETS: dict[str, tuple[float, ...]] = {
    "orchestrator_gateway_time_to_first_token_seconds": SECONDS_BUCKETS,
    "orchestrator_gateway_request_duration_seconds": SECONDS_BUCKETS,
    "orchestrator_gateway_stream_tokens_per_second": RATE_BUCKETS,
}
TAG_KEYS: dict[str, tuple[str, ...]] = {
    **{n: ("worker", "node") for n in METRICS if n.startswith("orchestrator_worker_")},
    "orchestrator_worker_vram_bytes": ("worker", "node", "gpu"),
    **{n: ("worker", "node", "gpu") for n in METRICS if n.startswith("orchestrator_gpu_")},
    "orchestrator_node_numa_balancing": ("node",),
    "orchestrator_gateway_requests": ("model", "code"),
    "orchestrator_gateway_requests_in_flight": ("replica",),
    "orchestrator_gateway_healthy_replicas": ("model",),
    "orchestrator_gateway_time_to_first_token_seconds": ("model", "replica"),
    "orchestrator_gateway_request_duration_seconds": ("model", "replica"),
    "orchestrator_gateway_stream_tokens_per_second": ("model", "replica"),
    "orchestrator_gateway_recent_time_to_first_token": ("replica", "le"),
    "orchestrator_gateway_recent_stream_tokens_per_second": ("replica", "le"),
}


class MetricsSink(Protocol):
    def set(self, name: str, value: float, tags: Mapping[str, str]) -> None: ...

    def inc(self, name: str, value: float, tags: Mapping[str, str]) -> None:
        """Adds ``value`` (>= 0); 0 makes the series exist, so a counter is seen at 0 before its first event."""

    def observe(self, name: str, value: float, tags: Mapping[str, str]) -> None:
        """One observation into a histogram (:data:`BUCKETS` says its bounds)."""


class DictSink:
    """A sink that keeps the last value (gauges), the sum (counters) and every observation (histograms): tests."""

    def __init__(self) -> None:
        self.values: dict[tuple[str, tuple], float] = {}
        self.observed: dict[tuple[str, tuple], list[float]] = {}

    def set(self, name: str, value: float, tags: Mapping[str, str]) -> None:
        self.values[(name, tuple(sorted(tags.items())))] = float(value)

    def inc(self, name: str, value: float, tags: Mapping[str, str]) -> None:
        key = (name, tuple(sorted(tags.items())))
        self.values[key] = self.values.get(key, 0.0) + float(value)

    def observe(self, name: str, value: float, tags: Mapping[str, str]) -> None:
        self.observed.setdefault((name, tuple(sorted(tags.items()))), []).append(float(value))

    def get(self, name: str, **tags: str) -> float | None:
        return self.values.get((name, tuple(sorted(tags.items()))))

    def observations(self, name: str, **tags: str) -> list[float]:
        return self.observed.get((name, tuple(sorted(tags.items()))), [])


# --- llama-server /metrics ----------------------------------------------------------------------------------------
_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def parse_prometheus(text: str) -> dict[str, float]:
    """``name -> value`` for the unlabelled samples of a Prometheus text page (llama-server has no labels)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m or m.group(2):
            continue
        try:
            out[m.group(1)] = float(m.group(3))
        except ValueError:
            continue
    return out


def fetch_text(url: str, path: str, timeout: float, headers: Mapping[str, str] | None = None) -> str | None:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=timeout)
    try:
        conn.request("GET", path, headers=dict(headers or {}))
        resp = conn.getresponse()
        body = resp.read(1 << 20).decode("utf-8", "replace")
        return body if resp.status == 200 else None
    except (OSError, http.client.HTTPException):
        return None
    finally:
        conn.close()


RATE_WINDOW_S = 30.0


@dataclass
class TokenRates:
    """Tokens/s from llama-server's cumulative counters over the last :data:`RATE_WINDOW_S` of scrapes (a restart
    resets them). llama-server adds a request's prompt and generated tokens to its counters when the request ends
    (the slot's reset, ``metrics_on_prediction`` in tools/server/server-context.cpp), not as it goes: between two
    scrapes 2 s apart a deployment generating 762 tokens/s in long streams often finished none, and its rate
    read 0. Over a window of several request lengths the rate is the tokens of the requests that ended in it."""

    window_s: float = RATE_WINDOW_S
    samples: collections.deque = field(default_factory=collections.deque)   # (t, prompt, generated)
    prompt_tps: float = 0.0
    generation_tps: float = 0.0

    def update(self, sample: Mapping[str, float], t: float) -> None:
        p = sample.get("llamacpp:prompt_tokens_total", 0.0)
        g = sample.get("llamacpp:tokens_predicted_total", 0.0)
        last = self.samples[-1] if self.samples else None
        if last is None or t <= last[0] or p < last[1] or g < last[2]:
            self.samples.clear()                 # the first scrape, or a restarted server: nothing to compare
        self.samples.append((t, p, g))
        while len(self.samples) > 2 and self.samples[1][0] <= t - self.window_s:
            self.samples.popleft()               # the oldest that is still at least the window back stays
        t0, p0, g0 = self.samples[0]
        if t > t0:
            self.prompt_tps, self.generation_tps = (p - p0) / (t - t0), (g - g0) / (t - t0)
        else:
            self.prompt_tps = self.generation_tps = 0.0


# --- process tree memory --------------------------------------------------------------------------------------------
@dataclass
class ExpertCacheCounters:
    """The expert cache's cumulative counters on llama-server's page (``llamacpp:moe_cache_*``, our patched build)
    turned into increments and an interval hit ratio; a restart resets the counters."""

    prev: dict[str, float] | None = None
    hit_ratio: float | None = None

    KEYS = {"lookups": "llamacpp:moe_cache_lookups_total", "hits": "llamacpp:moe_cache_hits_total",
            "misses": "llamacpp:moe_cache_misses_total", "uploaded": "llamacpp:moe_cache_uploaded_bytes_total",
            "cpu_misses": "llamacpp:moe_cache_cpu_misses_total",
            "prompt_saved": "llamacpp:moe_cache_prefill_saved_bytes_total",
            "prompt_copied": "llamacpp:moe_cache_prefill_copied_bytes_total"}

    def update(self, sample: Mapping[str, float]) -> dict[str, float] | None:
        """Increments since the last page (all since the start on the first one), or None when the page has no
        active cache."""
        if not sample.get("llamacpp:moe_cache_active"):
            self.prev = None
            return None
        cur = {k: sample.get(v, 0.0) for k, v in self.KEYS.items()}
        prev = self.prev if self.prev and all(cur[k] >= self.prev[k] for k in cur) else dict.fromkeys(cur, 0.0)
        delta = {k: cur[k] - prev[k] for k in cur}
        if delta["lookups"] > 0:
            self.hit_ratio = delta["hits"] / delta["lookups"]
        self.prev = cur
        return delta


def tree_pids(pid: int) -> list[int]:
    import psutil

    try:
        p = psutil.Process(pid)
        return [pid] + [c.pid for c in p.children(recursive=True)]
    except psutil.Error:
        return []


def tree_rss(pid: int) -> int:
    """Resident bytes of ``pid`` and its descendants (llama-server under numactl / the balancing wrapper)."""
    import psutil

    total = 0
    for q in tree_pids(pid):
        try:
            total += psutil.Process(q).memory_info().rss
        except psutil.Error:
            pass
    return total


# --- NUMA balancing -------------------------------------------------------------------------------------------------
def numa_balancing(root: str = "/") -> int | None:
    """``kernel.numa_balancing`` (0 off, 1 on, 2 memory tiering) or None where the kernel has no such knob."""
    try:
        with open(os.path.join(root, "proc/sys/kernel/numa_balancing")) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


class NodeClaim:
    """Whether this process writes the node's own metrics: the one that holds an exclusive lock on the node's
    file (``path``, in the deployment's folder on that node) does. Ray sums a gauge that several processes
    write with the same tags, so one writer per node, not one per worker. The kernel drops the lock when its
    holder dies, and the next worker to ask takes it; ``path`` None: always (a lone sampler)."""

    def __init__(self, path: str | os.PathLike | None) -> None:
        self.path = path
        self._fd: int | None = None

    def held(self) -> bool:
        if self.path is None or self._fd is not None:
            return True
        import fcntl

        try:
            os.makedirs(os.path.dirname(os.fspath(self.path)) or ".", exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError:
            return True                 # no folder to coordinate in: report (a gauge twice beats none)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return False
        self._fd = fd
        return True

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


# --- GPUs -----------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GpuSample:
    index: int
    uuid: str
    memory_used: int
    memory_total: int
    utilization: float
    temperature: float
    power_w: float
    process_vram: int           # bytes held by the given pids


def visible_gpus(cuda_visible_devices: str | None, count: int, uuids: list[str]) -> list[int]:
    """NVML indices of the GPUs a worker sees. ``CUDA_VISIBLE_DEVICES`` entries are indices or (prefixes of)
    UUIDs; unset means all; an invalid entry ends the list, as in CUDA."""
    if cuda_visible_devices is None:
        return list(range(count))
    out: list[int] = []
    for tok in (t.strip() for t in cuda_visible_devices.split(",")):
        if not tok:
            break
        if tok.isdigit():
            i = int(tok)
            if i >= count:
                break
            out.append(i)
            continue
        match = [i for i, u in enumerate(uuids) if u == tok or u.startswith(tok) or u.removeprefix("GPU-") == tok]
        if len(match) != 1:
            break
        out.append(match[0])
    return out


def sample_gpus(nvml: Nvml, indices: Iterable[int], pids: Iterable[int]) -> list[GpuSample]:
    """One reading of each GPU in ``indices``; a GPU that does not answer every reading is left out."""
    if not getattr(nvml, "available", False):
        return []
    pidset, out = set(pids), []
    for i in indices:
        try:
            total, used, _free = nvml.memory(i)
            util = nvml.utilization(i)
            uuid = nvml.uuid(i)
        except Exception:
            continue
        temp, power = nvml.temperature_c(i), nvml.power_w(i)
        if temp is None or power is None:
            continue
        held = sum(n for pid, n in nvml.process_memory(i).items() if pid in pidset)
        out.append(GpuSample(i, uuid, used, total, util, temp, power, held))
    return out


@dataclass
class WorkerSampler:
    """Collects one worker's numbers and writes them to a sink. Side effects are injected for tests."""

    worker: str
    node: str
    url: str
    cuda_visible_devices: str | None
    sink: MetricsSink
    fetch: Callable[[str, str, float], str | None] = fetch_text
    rss: Callable[[int], int] = tree_rss
    pids: Callable[[int], list[int]] = tree_pids
    nvml: Any = None
    root: str = "/"
    node_claim: NodeClaim = field(default_factory=lambda: NodeClaim(None))
    rates: TokenRates = field(default_factory=TokenRates)
    cache: ExpertCacheCounters = field(default_factory=ExpertCacheCounters)
    last: dict = field(default_factory=dict)
    _restarts_reported: int | None = None     # None: the counter was not written yet

    def __post_init__(self) -> None:
        if self.nvml is None:
            self.nvml = Nvml()

    @property
    def tags(self) -> dict[str, str]:
        return {"worker": self.worker, "node": self.node}

    def sample(self, state: Mapping[str, Any], t: float) -> dict:
        """Read everything once; ``state`` is the supervisor snapshot (pid, healthy, restarts)."""
        tags, s = self.tags, self.sink
        healthy = bool(state.get("healthy"))
        s.set("orchestrator_worker_healthy", 1.0 if healthy else 0.0, tags)
        restarts = int(state.get("restarts", 0))
        if self._restarts_reported is None:
            # from the first sample on, so "no restarts yet" is a 0 on the dashboard, not a missing series
            s.inc("orchestrator_worker_restarts", restarts, tags)
            self._restarts_reported = restarts
        elif restarts > self._restarts_reported:
            s.inc("orchestrator_worker_restarts", restarts - self._restarts_reported, tags)
            self._restarts_reported = restarts
        out: dict[str, Any] = {"prompt_tps": 0.0, "generation_tps": 0.0, "requests_in_flight": 0,
                               "requests_deferred": 0, "rss_bytes": 0, "gpus": [], "numa_balancing": None}
        page = self.fetch(self.url, "/metrics", 2.0) if healthy else None
        if page is not None:
            m = parse_prometheus(page)
            self.rates.update(m, t)
            out["prompt_tps"] = round(self.rates.prompt_tps, 2)
            out["generation_tps"] = round(self.rates.generation_tps, 2)
            out["requests_in_flight"] = int(m.get("llamacpp:requests_processing", 0))
            out["requests_deferred"] = int(m.get("llamacpp:requests_deferred", 0))
            delta = self.cache.update(m)
            if delta is not None:
                s.inc("orchestrator_worker_expert_cache_lookups", delta["lookups"], tags)
                s.inc("orchestrator_worker_expert_cache_misses", delta["misses"], tags)
                s.inc("orchestrator_worker_expert_cache_uploaded_bytes", delta["uploaded"], tags)
                s.inc("orchestrator_worker_expert_cache_cpu_misses", delta["cpu_misses"], tags)
                s.inc("orchestrator_worker_expert_cache_prompt_saved_bytes", delta["prompt_saved"], tags)
                s.inc("orchestrator_worker_expert_cache_prompt_copied_bytes", delta["prompt_copied"], tags)
                s.set("orchestrator_worker_expert_cache_bytes", m.get("llamacpp:moe_cache_bytes", 0.0), tags)
                if self.cache.hit_ratio is not None:
                    s.set("orchestrator_worker_expert_cache_hit_ratio", self.cache.hit_ratio, tags)
                    out["expert_cache_hit_ratio"] = round(self.cache.hit_ratio, 4)
        else:
            self.rates = TokenRates()
        s.set("orchestrator_worker_prompt_tokens_per_second", out["prompt_tps"], tags)
        s.set("orchestrator_worker_generation_tokens_per_second", out["generation_tps"], tags)
        s.set("orchestrator_worker_requests_in_flight", out["requests_in_flight"], tags)
        s.set("orchestrator_worker_requests_deferred", out["requests_deferred"], tags)
        pid = state.get("pid")
        pids = self.pids(pid) if pid else []
        out["rss_bytes"] = self.rss(pid) if pid else 0
        s.set("orchestrator_worker_resident_memory_bytes", out["rss_bytes"], tags)
        if getattr(self.nvml, "available", False):
            idx = visible_gpus(self.cuda_visible_devices, self.nvml.count(), self.nvml.uuids)
            for g in sample_gpus(self.nvml, idx, pids):
                gt = {**tags, "gpu": str(g.index)}
                s.set("orchestrator_gpu_memory_used_bytes", g.memory_used, gt)
                s.set("orchestrator_gpu_utilization_percent", g.utilization, gt)
                s.set("orchestrator_gpu_temperature_celsius", g.temperature, gt)
                s.set("orchestrator_gpu_power_watts", g.power_w, gt)
                s.set("orchestrator_worker_vram_bytes", g.process_vram, gt)
                out["gpus"].append({"index": g.index, "uuid": g.uuid, "memory_used": g.memory_used,
                                    "memory_total": g.memory_total, "utilization": g.utilization,
                                    "temperature": g.temperature, "power_w": g.power_w,
                                    "worker_vram": g.process_vram})
        nb = numa_balancing(self.root)
        out["numa_balancing"] = nb
        if nb is not None and self.node_claim.held():
            s.set("orchestrator_node_numa_balancing", nb, {"node": self.node})
        self.last = out
        return out
