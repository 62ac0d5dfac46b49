"""What the planner decides, as frozen data. ``launch`` turns a worker's :class:`WorkerSettings` into a process."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from orchestrator.backend.info import BackendInfo
from orchestrator.launch.llama_args import server_args, server_env
from orchestrator.launch.numa import NumaPolicy
from orchestrator.launch.settings import WorkerSettings
from orchestrator.plan.expert_cache import CachePlan


@dataclass(frozen=True)
class Decision:
    """One decision and its one-line reason (what ``orchestrator plan`` prints under "why")."""

    what: str
    value: str
    why: str

    def to_dict(self) -> dict:
        return {"what": self.what, "value": self.value, "why": self.why}


@dataclass(frozen=True)
class DeviceMemory:
    """Predicted memory on one device of one worker (bytes)."""

    device: str                 # llama.cpp's name (orchestrator.backend.devices): "CUDA0" in the worker's own
                                # numbering, "CPU"
    weights: int = 0
    kv: int = 0
    compute: int = 0
    overhead: int = 0           # CUDA context + kernels, output buffers, margins
    budget: int | None = None   # what the plan may use on it
    cache: int = 0              # the expert cache's slots and id buffers (--moe-cache-mib)

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.compute + self.overhead + self.cache

    def to_dict(self) -> dict:
        d = {"device": self.device, "weights": self.weights, "kv": self.kv, "compute": self.compute,
             "overhead": self.overhead, "total": self.total, "budget": self.budget}
        if self.cache:
            d["cache"] = self.cache
        return d


@dataclass(frozen=True)
class LayerRange:
    """Layers [first, last] whose attention part runs on ``attn`` and routed experts live on ``experts``."""

    first: int
    last: int
    attn: str
    experts: str

    def to_dict(self) -> dict:
        return {"layers": [self.first, self.last], "attention": self.attn, "experts": self.experts}


TTFT_LENGTHS = (512, 4096)   # prompt lengths whose time to first token a plan states


@dataclass(frozen=True)
class Prediction:
    """Roofline prediction. ``pp``: prompt length -> tokens/s; ``tg``: generation tokens/s at short depth;
    ``tg_streams``: aggregate generation tokens/s of ``streams`` streams (the worker's parallel slots) decoding
    together."""

    pp: Mapping[int, float] = field(default_factory=dict)
    tg: float = 0.0
    tg_bytes_per_token: Mapping[str, int] = field(default_factory=dict)   # device -> bytes read per token
    streams: int = 1
    tg_streams: float = 0.0

    def ttft(self, length: int) -> float | None:
        """Seconds from a prompt of ``length`` tokens to its first generated token: the prompt, then one step."""
        pp = self.pp.get(length)
        if not pp or not self.tg:
            return None
        return length / pp + 1.0 / self.tg

    def summary(self) -> str:
        """One line: generation, the streams' aggregate, prompts and time to first token."""
        pp = ", ".join(f"pp{k} {v:.0f}" for k, v in sorted(self.pp.items()) if k in (32, 512, 4096))
        agg = f"; {self.streams} streams {self.tg_streams:.1f} t/s aggregate" if self.streams > 1 else ""
        ttft = ", ".join(f"{k} tokens {t * 1e3:.0f} ms" for k in TTFT_LENGTHS if (t := self.ttft(k)) is not None)
        return f"tg {self.tg:.1f} t/s{agg}; {pp} t/s" + (f"; time to first token: {ttft}" if ttft else "")

    def to_dict(self) -> dict:
        out = {"pp": {str(k): round(v, 1) for k, v in sorted(self.pp.items())}, "tg": round(self.tg, 2),
               "tg_bytes_per_token": dict(self.tg_bytes_per_token), "streams": self.streams,
               "tg_streams": round(self.tg_streams, 2)}
        ttft = {str(k): round(t, 4) for k in TTFT_LENGTHS if (t := self.ttft(k)) is not None}
        if ttft:
            out["ttft_s"] = ttft
        return out


@dataclass(frozen=True)
class WorkerPlan:
    """One llama-server worker: its typed :class:`WorkerSettings` (what launch runs), where it is and why.

    ``args`` (llama-server's own flags, no binary, no wrappers) and ``env`` are rendered from the settings for
    ``backend`` by :mod:`orchestrator.launch.llama_args`, the one place they are spelled."""

    name: str
    node: str                              # topology node name (the machine)
    settings: WorkerSettings
    backend: BackendInfo
    placement: tuple[LayerRange, ...]
    memory: tuple[DeviceMemory, ...]
    predicted: Prediction
    decisions: tuple[Decision, ...]
    cpu_expert_layers: tuple[int, ...] = ()  # layers whose routed experts stay in host memory
    expert_cache: CachePlan | None = None    # the split of VRAM between whole expert layers and the cache

    @property
    def args(self) -> tuple[str, ...]:
        return server_args(self.settings, self.backend)

    @property
    def env(self) -> dict[str, str]:
        return server_env(self.settings, self.backend)

    @property
    def host(self) -> str:
        return self.settings.host

    @property
    def port(self) -> int:
        return self.settings.port

    @property
    def gpus(self) -> tuple[int, ...]:
        """Machine GPU indexes (NVML / PCI order) this worker uses."""
        return tuple(self.settings.gpus or ())

    @property
    def numa(self) -> NumaPolicy:
        return self.settings.numa

    @property
    def disable_numa_balancing(self) -> bool:
        return self.settings.disable_numa_balancing

    @property
    def model_alias(self) -> str:
        return self.settings.alias or "model"

    @property
    def op_offload_min_batch(self) -> int | None:
        return self.settings.op_offload_min_batch

    @property
    def n_ubatch(self) -> int | None:
        return self.settings.n_ubatch

    @property
    def n_batch(self) -> int | None:
        return self.settings.n_batch

    @property
    def load_mode(self) -> str:
        return self.settings.load_mode

    def to_dict(self) -> dict:
        s = self.settings
        return {
            "name": self.name, "node": self.node, "host": self.host, "port": self.port, "gpus": list(self.gpus),
            "args": list(self.args), "env": self.env,
            "numa": {**s.numa.to_dict(), "physical_only": False, "numa_flag": s.numa_flag},
            "disable_numa_balancing": self.disable_numa_balancing,
            "placement": [p.to_dict() for p in self.placement],
            "devices": {m.device: m.total for m in self.memory},
            "memory": [m.to_dict() for m in self.memory],
            "predicted": self.predicted.to_dict(),
            "decisions": [d.to_dict() for d in self.decisions],
            "cpu_expert_layers": list(self.cpu_expert_layers),
            "op_offload_min_batch": self.op_offload_min_batch, "n_ubatch": self.n_ubatch, "n_batch": self.n_batch,
            "load_mode": self.load_mode, "model_alias": self.model_alias,
            "settings": s.to_dict(),
            **({"expert_cache": {**self.expert_cache.to_json(), "arithmetic": self.expert_cache.arithmetic()}}
               if self.expert_cache is not None else {}),
        }


@dataclass(frozen=True)
class Plan:
    workers: tuple[WorkerPlan, ...]
    model: Mapping[str, object]            # summary of the model (arch, sizes)
    decisions: tuple[Decision, ...] = ()   # plan-wide decisions (layout ...)
    warnings: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        return {"model": dict(self.model), "decisions": [d.to_dict() for d in self.decisions],
                "warnings": list(self.warnings), "workers": [w.to_dict() for w in self.workers]}
