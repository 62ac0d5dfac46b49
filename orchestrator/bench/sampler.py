"""Resources during one configuration: GPU memory, power and temperature (NVML), the server's host RSS (psutil).

A background thread samples every ``interval`` seconds. Phases ("load", "measure") are marked by the runner:
peaks cover the whole run (loading included: that is where an OOM happens), power and temperature summaries
cover the "measure" phase (the work being compared). Without NVML (no GPU) the GPU part is simply absent.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from orchestrator.hardware.nvml import Nvml

__all__ = ["Nvml", "ResourceSampler", "gpu_free", "process_tree_rss"]


def process_tree_rss(pid: int) -> tuple[int, set[int]]:
    """Resident bytes of ``pid`` and all its descendants, and their pids (0 and empty when it is gone)."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root] + root.children(recursive=True)
    except psutil.Error:
        return 0, set()
    total, pids = 0, set()
    for p in procs:
        try:
            total += p.memory_info().rss
            pids.add(p.pid)
        except psutil.Error:
            pass
    return total, pids


@dataclass
class _Gpu:
    baseline_used: int = 0
    peak_used: int = 0
    peak_process: int = 0
    power: list[float] = field(default_factory=list)
    temps: list[float] = field(default_factory=list)
    power_max: float | None = None
    temp_max: float | None = None


class ResourceSampler:
    """Samples GPUs and the server's process tree on a thread; :meth:`summary` reduces it for the JSON."""

    def __init__(self, nvml: Any | None, gpus: Sequence[int] | None = None, *, interval: float = 0.25,
                 rss_reader: Callable[[int], tuple[int, set[int]]] = process_tree_rss,
                 clock: Callable[[], float] = time.monotonic):
        self.nvml = nvml
        self.gpus = list(gpus) if gpus is not None else (list(range(nvml.count())) if nvml else [])
        self.interval = interval
        self._rss_reader = rss_reader
        self._clock = clock
        self._pids: tuple[int, ...] = ()
        self._phase = "idle"
        self._gpu = {i: _Gpu() for i in self.gpus}
        self._rss_peak = 0
        self._n = 0
        self._t_measure = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- control ----------------------------------------------------------------------------------------------

    def baseline(self) -> None:
        """Record GPU memory in use before the server starts (other processes, the VRAM ballast)."""
        for i in self.gpus:
            try:
                _t, used, _f = self.nvml.memory(i)
            except Exception:
                continue
            self._gpu[i].baseline_used = used
            self._gpu[i].peak_used = used

    def start(self) -> "ResourceSampler":
        self._thread = threading.Thread(target=self._loop, name="bench-sampler", daemon=True)
        self._thread.start()
        return self

    def attach(self, *pids: int | None) -> None:
        """The server's process (several: the replicas of a deployment, their memory summed)."""
        with self._lock:
            self._pids = tuple(p for p in pids if p)

    def phase(self, name: str) -> None:
        """Switch phase; a sample is taken first, so even a phase shorter than the interval is seen."""
        if self._thread is not None:
            self.sample()
        with self._lock:
            self._phase = name

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> "ResourceSampler":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- sampling ---------------------------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)
        self.sample()

    def sample(self) -> None:
        """One sample of everything (also callable directly, e.g. by tests with a fake NVML)."""
        with self._lock:
            roots, phase = self._pids, self._phase
        rss, pids = 0, set()
        for root in roots:
            r, p = self._rss_reader(root)
            rss, pids = rss + r, pids | p
        with self._lock:
            self._n += 1
            self._rss_peak = max(self._rss_peak, rss)
            for i in self.gpus:
                g = self._gpu[i]
                try:
                    _t, used, _f = self.nvml.memory(i)
                except Exception:
                    continue
                g.peak_used = max(g.peak_used, used)
                if pids:
                    own = sum(v for p, v in self.nvml.process_memory(i).items() if p in pids)
                    g.peak_process = max(g.peak_process, own)
                if phase == "measure":
                    p = self.nvml.power_w(i)
                    t = self.nvml.temperature_c(i)
                    if p is not None:
                        g.power.append(p)
                        g.power_max = p if g.power_max is None else max(g.power_max, p)
                    if t is not None:
                        g.temps.append(t)
                        g.temp_max = t if g.temp_max is None else max(g.temp_max, t)

    def summary(self) -> dict:
        with self._lock:
            gpus = {}
            for i, g in self._gpu.items():
                d: dict[str, Any] = {
                    "baseline_used": g.baseline_used, "peak_used": g.peak_used,
                    "peak_delta": max(0, g.peak_used - g.baseline_used),
                }
                if g.peak_process:
                    d["peak_process"] = g.peak_process
                if g.power:
                    d["power_mean_w"] = round(sum(g.power) / len(g.power), 1)
                    d["power_max_w"] = round(g.power_max or 0.0, 1)
                if g.temps:
                    d["temp_max_c"] = g.temp_max
                    d["temp_mean_c"] = round(sum(g.temps) / len(g.temps), 1)
                gpus[str(i)] = d
            return {"gpus": gpus, "rss_peak": self._rss_peak, "samples": self._n}


def gpu_free(nvml: Any | None, gpus: Sequence[int]) -> dict[str, int]:
    out = {}
    if nvml is None:
        return out
    for i in gpus:
        try:
            out[str(i)] = nvml.memory(i)[2]
        except Exception:
            pass
    return out
