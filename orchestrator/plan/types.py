"""What the planner decides, as frozen data. ``launch`` turns a :class:`WorkerPlan` into a process."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping


@dataclass(frozen=True)
class Decision:
    """One decision and its one-line reason (what ``orchestrator plan`` prints under "why")."""

    what: str
    value: str
    why: str

    def to_dict(self) -> dict:
        return {"what": self.what, "value": self.value, "why": self.why}


@dataclass(frozen=True)
class NumaPlan:
    """How a worker is bound. ``mode``: "bind" (cpunodebind+membind), "interleave" (memory interleaved over
    ``mem_nodes``, threads on ``cpu_nodes``), "none" (no numactl). ``cpus`` = the hardware threads it may use;
    ``numa_flag`` = llama.cpp's ``--numa`` value ("" = not passed)."""

    mode: str = "none"
    cpus: tuple[int, ...] = ()
    cpu_nodes: tuple[int, ...] = ()
    mem_nodes: tuple[int, ...] = ()
    physical_only: bool = False
    numa_flag: str = ""

    def to_dict(self) -> dict:
        return {"mode": self.mode, "cpus": list(self.cpus), "cpu_nodes": list(self.cpu_nodes),
                "mem_nodes": list(self.mem_nodes), "physical_only": self.physical_only, "numa_flag": self.numa_flag}


@dataclass(frozen=True)
class DeviceMemory:
    """Predicted memory on one device of one worker (bytes)."""

    device: str                 # "CUDA0" (the worker's own numbering), "CPU"
    weights: int = 0
    kv: int = 0
    compute: int = 0
    overhead: int = 0           # CUDA context + kernels, output buffers, margins
    budget: int | None = None   # what the plan may use on it

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.compute + self.overhead

    def to_dict(self) -> dict:
        return {"device": self.device, "weights": self.weights, "kv": self.kv, "compute": self.compute,
                "overhead": self.overhead, "total": self.total, "budget": self.budget}


@dataclass(frozen=True)
class LayerRange:
    """Layers [first, last] whose attention part runs on ``attn`` and routed experts live on ``experts``."""

    first: int
    last: int
    attn: str
    experts: str

    def to_dict(self) -> dict:
        return {"layers": [self.first, self.last], "attention": self.attn, "experts": self.experts}


@dataclass(frozen=True)
class Prediction:
    """Roofline prediction. ``pp``: prompt length -> tokens/s; ``tg``: generation tokens/s at short depth."""

    pp: Mapping[int, float] = field(default_factory=dict)
    tg: float = 0.0
    tg_bytes_per_token: Mapping[str, int] = field(default_factory=dict)   # device -> bytes read per token

    def to_dict(self) -> dict:
        return {"pp": {str(k): round(v, 1) for k, v in sorted(self.pp.items())}, "tg": round(self.tg, 2),
                "tg_bytes_per_token": dict(self.tg_bytes_per_token)}


@dataclass(frozen=True)
class WorkerPlan:
    """Everything one llama-server worker needs; ``args`` are llama-server's own flags (no binary, no wrappers)."""

    name: str
    node: str                              # topology node name (the machine)
    host: str
    port: int
    gpus: tuple[int, ...]                  # machine GPU indexes (NVML / PCI order) this worker uses
    args: tuple[str, ...]
    env: Mapping[str, str]
    numa: NumaPlan
    disable_numa_balancing: bool
    placement: tuple[LayerRange, ...]
    memory: tuple[DeviceMemory, ...]
    predicted: Prediction
    decisions: tuple[Decision, ...]
    model_alias: str = "model"
    cpu_expert_layers: tuple[int, ...] = ()  # layers whose routed experts stay in host memory
    op_offload_min_batch: int | None = None
    n_ubatch: int = 512
    n_batch: int = 2048
    load_mode: str = "mmap"                # "mmap" | "pinned" | "mlock"

    def to_dict(self) -> dict:
        return {
            "name": self.name, "node": self.node, "host": self.host, "port": self.port, "gpus": list(self.gpus),
            "args": list(self.args), "env": dict(self.env), "numa": self.numa.to_dict(),
            "disable_numa_balancing": self.disable_numa_balancing,
            "placement": [p.to_dict() for p in self.placement],
            "devices": {m.device: m.total for m in self.memory},
            "memory": [m.to_dict() for m in self.memory],
            "predicted": self.predicted.to_dict(),
            "decisions": [d.to_dict() for d in self.decisions],
            "cpu_expert_layers": list(self.cpu_expert_layers),
            "op_offload_min_batch": self.op_offload_min_batch, "n_ubatch": self.n_ubatch, "n_batch": self.n_batch,
            "load_mode": self.load_mode, "model_alias": self.model_alias,
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
