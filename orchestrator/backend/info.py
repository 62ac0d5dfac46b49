"""What a llama-server binary is and can do, as a pure value: the planner and the launch renderer read it.

Probing a binary (running ``--version``/``--help``/``--list-devices``) is :mod:`orchestrator.backend.detect`'s
side effect; this module only names the flavors and features and reads them from ``--help`` text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Mapping

from orchestrator.backend.server_options import BY_FEATURE, IK_MARKERS, help_pattern


class Flavor(str, Enum):
    """Which llama.cpp a binary is. String-valued, so JSON and YAML carry the plain names."""

    MAINLINE = "mainline"
    IK = "ik_llama.cpp"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @classmethod
    def of(cls, value: "str | Flavor") -> "Flavor":
        """The flavor named ``value`` ("mainline", "ik_llama.cpp"); a bug (ValueError) for anything else."""
        return cls(value)


# Plan documents written before the expert cache's features took the project's name: the older name -> the name now
FORMER_FEATURES = {"moe_cache": "expert_cache", "moe_cache_cpu_misses": "expert_cache_cpu_misses",
                   "moe_cache_prefill": "expert_cache_slot_reads", "moe_cache_prefetch": "expert_cache_prefetch",
                   "moe_cache_slots": "expert_cache_slots", "moe_cache_prefill_ahead": "expert_cache_staging",
                   "moe_cache_prefill_ahead_min_batch": "expert_cache_stage_min_batch"}


@dataclass(frozen=True)
class BackendInfo:
    """What a llama-server binary is and can do. Pure data: the planner reads it."""

    server: str                                 # path to llama-server
    flavor: Flavor = Flavor.MAINLINE
    version: str = ""                           # e.g. "0 (0c1e570)"; build number and commit when known
    build_info: str = ""                        # "built with ... for ..."
    cuda: bool = False                          # built with the CUDA backend
    gpu_offload: bool = False                   # -ngl is offered (a GPU backend is compiled in)
    features: frozenset[str] = field(default_factory=frozenset)
    split_modes: tuple[str, ...] = ()           # values -sm accepts, as --help lists them
    devices: tuple[str, ...] = ()               # `--list-devices` lines, e.g. "CUDA0: NVIDIA H200 (143156 MiB, ...)"
    bench: str | None = None                    # llama-bench next to it, if any
    fit_params: str | None = None               # llama-fit-params next to it, if any

    def __post_init__(self) -> None:
        object.__setattr__(self, "flavor", Flavor.of(self.flavor))
        object.__setattr__(self, "features", frozenset(self.features))

    @property
    def ik(self) -> bool:
        return self.flavor is Flavor.IK

    def has(self, feature: str) -> bool:
        return feature in self.features

    def to_dict(self) -> dict:
        return {
            "server": self.server, "flavor": self.flavor.value, "version": self.version,
            "build_info": self.build_info, "cuda": self.cuda, "gpu_offload": self.gpu_offload,
            "features": sorted(self.features), "split_modes": list(self.split_modes), "devices": list(self.devices),
            "bench": self.bench, "fit_params": self.fit_params,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "BackendInfo":
        return cls(server=d["server"], flavor=d.get("flavor", Flavor.MAINLINE), version=d.get("version", ""),
                   build_info=d.get("build_info", ""), cuda=bool(d.get("cuda")),
                   gpu_offload=bool(d.get("gpu_offload")),
                   features=frozenset(FORMER_FEATURES.get(f, f) for f in d.get("features", ())),
                   split_modes=tuple(d.get("split_modes", ())), devices=tuple(d.get("devices", ())),
                   bench=d.get("bench"), fit_params=d.get("fit_params"))


# feature name -> regex on --help text, one per option of the table that names a feature
FEATURES = {name: help_pattern(o) for name, o in BY_FEATURE.items()}


def parse_help(help_text: str) -> tuple[Flavor, frozenset[str], tuple[str, ...], bool]:
    """(flavor, features, split modes, gpu_offload) from ``llama-server --help`` output."""
    feats = {name for name, rx in FEATURES.items() if re.search(rx, help_text, re.M)}
    modes: list[str] = []
    m = re.search(r"--split-mode\s+\{([a-z,]+)\}", help_text)
    if m:
        modes = m.group(1).split(",")
    else:  # ik_llama.cpp lists the modes as "  - graph: ..." lines under -sm
        block = re.search(r"--split-mode[^\n]*\n((?:\s+.*\n){1,12})", help_text)
        if block:
            modes = re.findall(r"^\s+-\s+([a-z]+)(?:\s*\(default\))?\s*:", block.group(1), re.M)
    gpu_offload = bool(re.search(r"--gpu-layers\b|--n-gpu-layers\b", help_text))
    # features only ik_llama.cpp has: any of them (or -sm graph) tells the flavor
    flavor = Flavor.IK if (feats & IK_MARKERS or "graph" in modes) else Flavor.MAINLINE
    if flavor is Flavor.IK:
        feats.add("override_tensor")  # ik_llama.cpp's parser takes -ot/--override-tensor; its --help omits it
    for mode in modes:
        feats.add(f"sm_{mode}")
    return flavor, frozenset(feats), tuple(modes), gpu_offload


# What the pinned llama-server of each flavor offers, for planning a recorded machine where no binary is at hand
# (mainline: as `orchestrator build` makes it, with our patch series, hence the expert cache).
NOMINAL_FEATURES = {
    Flavor.MAINLINE: frozenset({"fit", "fit_target", "n_cpu_moe", "cpu_moe", "override_tensor", "load_mode", "numa",
                                "flash_attn", "metrics", "no_host", "cpu_range", "threads_batch", "no_op_offload",
                                "kv_unified", "sm_none", "sm_layer", "sm_row", "sm_tensor", "expert_cache",
                                "expert_cache_cpu_misses", "expert_cache_slot_reads", "expert_cache_prefetch",
                                "expert_cache_slots", "expert_cache_staging", "expert_cache_stage_min_batch"}),
    Flavor.IK: frozenset({"fit", "fit_margin", "n_cpu_moe", "cpu_moe", "override_tensor", "no_mmap", "mlock",
                          "numa", "flash_attn", "metrics", "threads_batch", "mla", "merge_qkv",
                          "attn_max_batch", "graph_reuse", "split_mode_graph_scheduling", "cuda_params",
                          "offload_policy", "sm_none", "sm_layer", "sm_graph"}),
}
NOMINAL_SPLIT_MODES = {Flavor.MAINLINE: ("none", "layer", "row", "tensor"), Flavor.IK: ("none", "layer", "graph")}


def nominal_backend(flavor: "str | Flavor", cuda: bool) -> BackendInfo:
    """The pinned llama-server of ``flavor`` as the plan assumes it when no binary is at hand."""
    fl = Flavor.of(flavor)
    return BackendInfo(server="llama-server", flavor=fl, version="(planned without a binary)", cuda=cuda,
                       gpu_offload=True, features=NOMINAL_FEATURES[fl], split_modes=NOMINAL_SPLIT_MODES[fl])
