"""WorkerSettings: everything one llama-server worker is decided to run with, as a typed, frozen value.

The planner returns one per worker; the bench derives its alternatives with ``dataclasses.replace``; ``status``
shows it; :mod:`orchestrator.launch.llama_args` is the one place it becomes argv and environment. Pure.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, Mapping

from orchestrator.backend.server_options import ALL_LAYERS, SLOT_ASSIGNMENTS  # noqa: F401  (re-exported)
from orchestrator.launch.numa import NumaPolicy

LOAD_MODES = ("mmap", "pinned", "mlock")   # memory-mapped; read into pinned host buffers; read and locked

# Plan documents written before the fields took the project's name: the older field -> its field now
FORMER_FIELDS = {"moe_cache_mib": "expert_cache_mib", "moe_cache_max_batch": "expert_cache_max_batch",
                 "moe_cache_cpu_misses": "expert_cache_cpu_misses", "moe_cache_prefetch": "expert_cache_prefetch",
                 "moe_cache_slots": "expert_cache_slots", "moe_cache_prefill_ahead": "expert_cache_stage_buffers",
                 "moe_cache_prefill_ahead_min_batch": "expert_cache_stage_min_batch"}


@dataclass(frozen=True)
class WorkerSettings:
    """One worker's llama-server settings. ``None`` means "not passed": llama.cpp's own default applies."""

    model_path: str = ""
    context: int | None = None                 # -c: tokens of the worker, shared by its slots
    parallel: int | None = None                # -np: concurrent slots
    alias: str | None = None                   # the model name clients use
    host: str | None = None                    # where it listens (the planner always says)
    port: int | None = None
    # placement
    gpus: tuple[int, ...] | None = None        # machine GPU indexes (PCI order) it sees; () = none; None = inherit
    n_gpu_layers: int | None = None            # -ngl; ALL_LAYERS = every layer
    split_mode: str | None = None              # -sm, with several GPUs
    tensor_split: tuple[float, ...] = ()       # -ts
    main_gpu: int | None = None                # -mg, numbered among the worker's own GPUs
    tensor_overrides: tuple[tuple[str, str], ...] = ()   # -ot (pattern, buffer type): the first match wins
    cpu_moe: bool = False                      # --cpu-moe: every routed expert in host memory
    n_cpu_moe: int | None = None               # --n-cpu-moe N: routed experts of layers 0..N-1 in host memory
    fit: bool | None = None                    # llama.cpp's own automatic placement (--fit on|off)
    fit_ctx: int | None = None                 # --fit-ctx: the context --fit must keep
    op_offload_min_batch: int | None = None    # batch from which host-resident weights are copied to the GPU;
                                               # None = llama.cpp's default; llama_args.OFFLOAD_NEVER = never
    expert_cache_mib: int = 0                  # VRAM for the expert cache (--moe-cache-mib); 0 = off
    expert_cache_max_batch: int | None = None  # largest batch the cache serves (--moe-cache-max-batch); None =
                                               # llama-server's default (8)
    expert_cache_cpu_misses: bool = False      # rarely used experts are computed on the CPU,
                                               # not uploaded (--moe-cache-cpu-misses)
    expert_cache_prefetch: bool = False        # uploads ahead of need (--moe-cache-prefetch on)
    expert_cache_slots: str | None = None      # where slots are assigned, one of SLOT_ASSIGNMENTS
                                               # (--moe-cache-slots); None = llama-server's default (host)
    expert_cache_stage_buffers: int = 0        # staging: buffers for a prompt's uncached experts, copied ahead
                                               # of their layer (--moe-cache-prefill-ahead N); 0 = off
    expert_cache_stage_min_batch: int = 0      # of those, micro-batches staged only from this many tokens
                                               # (--moe-cache-prefill-ahead-min-batch N); 0 = the patch's own rule
    load_mode: str = "mmap"                    # one of LOAD_MODES
    # CPU side
    numa: NumaPolicy = field(default_factory=NumaPolicy.none)
    numa_flag: str = ""                        # llama.cpp's --numa (distribute, isolate, numactl); "" = not passed
    disable_numa_balancing: bool = False       # run under the wrapper that switches automatic balancing off
    threads: int | None = None                 # -t: generation threads
    threads_batch: int | None = None           # -tb: prompt threads
    # batches and cache
    n_batch: int | None = None                 # -b
    n_ubatch: int | None = None                # -ub
    flash_attn: str = "auto"                   # on | off | auto
    type_k: str = "f16"
    type_v: str = "f16"
    metrics: bool = True                       # --metrics (when the binary offers it)
    extra_args: tuple[str, ...] = ()           # the user's own flags, passed last

    def __post_init__(self) -> None:
        if self.load_mode not in LOAD_MODES:
            raise ValueError(f"WorkerSettings.load_mode must be one of {', '.join(LOAD_MODES)}; "
                             f"got {self.load_mode!r}")
        if self.expert_cache_mib < 0:
            raise ValueError(f"WorkerSettings.expert_cache_mib must be >= 0; got {self.expert_cache_mib}")
        if self.expert_cache_slots is not None and self.expert_cache_slots not in SLOT_ASSIGNMENTS:
            raise ValueError(f"WorkerSettings.expert_cache_slots must be one of {', '.join(SLOT_ASSIGNMENTS)}; "
                             f"got {self.expert_cache_slots!r}")
        if self.expert_cache_max_batch is not None and self.expert_cache_max_batch < 1:
            raise ValueError(f"WorkerSettings.expert_cache_max_batch must be >= 1; got {self.expert_cache_max_batch}")
        if self.expert_cache_stage_buffers < 0:
            raise ValueError("WorkerSettings.expert_cache_stage_buffers must be >= 0; got "
                             f"{self.expert_cache_stage_buffers}")
        if self.expert_cache_stage_min_batch < 0:
            raise ValueError("WorkerSettings.expert_cache_stage_min_batch must be >= 0; got "
                             f"{self.expert_cache_stage_min_batch}")
        if self.gpus is not None:
            object.__setattr__(self, "gpus", tuple(int(g) for g in self.gpus))
        object.__setattr__(self, "tensor_split", tuple(self.tensor_split))
        object.__setattr__(self, "tensor_overrides", tuple((str(p), str(b)) for p, b in self.tensor_overrides))
        object.__setattr__(self, "extra_args", tuple(str(a) for a in self.extra_args))

    def to_dict(self) -> dict:
        d = asdict(self)
        d["numa"] = self.numa.to_dict()
        d["gpus"] = list(self.gpus) if self.gpus is not None else None
        d["tensor_split"] = list(self.tensor_split)
        d["tensor_overrides"] = [list(p) for p in self.tensor_overrides]
        d["extra_args"] = list(self.extra_args)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "WorkerSettings":
        known = {f.name for f in fields(cls)}
        d = {**{FORMER_FIELDS[k]: v for k, v in d.items() if k in FORMER_FIELDS}, **d}
        kw = {k: v for k, v in d.items() if k in known}
        if "expert_cache_slots" not in d and d.get("moe_cache_device_slots"):
            kw["expert_cache_slots"] = "device"   # older documents said it as a boolean
        if "numa" in kw:
            kw["numa"] = NumaPolicy.from_dict(dict(kw["numa"]))
        if kw.get("gpus") is not None:
            kw["gpus"] = tuple(kw["gpus"])
        for k in ("tensor_split", "extra_args"):
            if k in kw:
                kw[k] = tuple(kw[k])
        if "tensor_overrides" in kw:
            kw["tensor_overrides"] = tuple(tuple(p) for p in kw["tensor_overrides"])
        return cls(**kw)
