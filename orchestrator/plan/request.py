"""PlanRequest: the user's wishes, resolved from topology.yaml into plain values the planner reads.

``None`` (or "auto") means: the plan decides. Keeping this separate from the YAML schema lets the planner be
tested with a one-line request and keeps config parsing (files, line numbers) out of ``plan/``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping


from orchestrator.launch.llama_args import OFFLOAD_NEVER  # noqa: F401  (the one "never")
from orchestrator.units import GiB, MiB


# The plan's defaults, the same for a topology's "auto" and for a request built in code (tests, tools).
DEFAULT_CONTEXT = 8192
DEFAULT_VRAM_RESERVE = 256 * MiB   # the CUDA context and pool are predicted (measured on the H200)


def default_ram_reserve(total_bytes: int | None) -> int:
    """Host memory left to the OS and others: 10% of RAM, at least 1 GiB, at most 8 GiB (4 GiB when the
    machine's RAM is unknown)."""
    if not total_bytes:
        return 4 * GiB
    return int(min(8 * GiB, max(1 * GiB, total_bytes * 0.10)))


@dataclass(frozen=True)
class NodeRequest:
    """One machine of the topology."""

    name: str = "local"
    address: str | None = None               # Ray node address; None = the local machine
    gpus: tuple[int, ...] | None = None      # None = all GPUs of the machine; () = none
    vram_limit: Mapping[int, int] | int | None = None   # bytes per GPU (one value for all, or per index)
    vram_reserve: int = DEFAULT_VRAM_RESERVE  # bytes kept free on every GPU
    ram_reserve: int | None = None           # bytes of host RAM left for the OS and others;
                                             # None = default_ram_reserve(the machine's RAM)

    def for_machine(self, memory_total_bytes: int | None) -> "NodeRequest":
        """This request with its automatic values decided for a machine with that much RAM."""
        if self.ram_reserve is not None:
            return self
        return replace(self, ram_reserve=default_ram_reserve(memory_total_bytes))

    def limit_for(self, gpu_index: int) -> int | None:
        if self.vram_limit is None:
            return None
        if isinstance(self.vram_limit, int):
            return self.vram_limit
        return self.vram_limit.get(gpu_index)


@dataclass(frozen=True)
class PlanRequest:
    # model / serving
    context: int = DEFAULT_CONTEXT           # tokens per worker (-c), shared by its slots
    parallel: int = 1                        # concurrent slots per worker (llama-server -np)
    type_k: str = "f16"
    type_v: str = "f16"
    kv_auto: bool = False                    # the topology left the cache type to the plan: q8_0 if f16 won't fit
    flash_attn: str = "auto"                 # "auto" | "on" | "off"
    alias: str = "model"
    # backend
    flavor: str | None = None                # None = from the detected binary
    # machines
    nodes: tuple[NodeRequest, ...] = (NodeRequest(),)
    # workers
    layout: str = "auto"                     # "auto" | "machine" | "socket" | "gpu-group"
    gpu_group_size: int | None = None        # GPUs per worker with layout gpu-group (None = one socket's GPUs)
    replicas: int | None = None              # per machine, for layout "machine" (None = 1)
    numa: str = "auto"                       # "auto" | "bind" | "interleave" | "none"
    smt: str = "auto"                        # "auto" | "on" | "off"
    threads: int | None = None
    threads_batch: int | None = None
    disable_numa_balancing: bool = True
    op_offload_min_batch: int | None = None  # None = computed; OFFLOAD_NEVER = never (--no-op-offload)
    batch: int | None = None                 # -b
    ubatch: int | None = None                # -ub
    split_mode: str = "auto"                 # "auto" | "none" | "layer" | "row" | "tensor" | "graph"
    load_mode: str = "auto"                  # "auto" | "mmap" | "pinned" | "mlock"
    extra_args: tuple[str, ...] = ()
    host: str = "127.0.0.1"                  # where workers listen
    port_base: int = 8081
    expert_layers_on_cpu: tuple[int, ...] | None = None   # force this placement (benchmarks / experts)
    objective: str = "generation"            # "generation" | "balanced" | "prompt": what the VRAM split favours
    expert_cache_bytes: int | None = None    # None = the plan decides; 0 = off; else a cache of this many bytes
    expert_cache_misses: str = "upload"      # "upload" | "cpu" | "auto": what the cache does with a miss
    expert_cache_prefetch: str = "auto"      # "auto" | "on" | "off": uploads ahead of need (--moe-cache-prefetch)
    expert_cache_slots: str = "auto"         # "auto" | "device" | "host": where slots are assigned (--moe-cache-slots)
    expert_cache_staging: str = "auto"       # "auto" | "on" | "off": prompts' uncached experts copied ahead
                                             # into staging buffers (--moe-cache-prefill-ahead)

    def copy(self, **changes) -> "PlanRequest":
        return replace(self, **changes)
