"""Parse the memory llama.cpp reports when it loads a model (``llama-server -lv 4`` or any llama.cpp tool).

Lines read (mainline llama.cpp, late 2026; ik_llama.cpp prints the same first four)::

    load_tensors:   CPU_Mapped model buffer size =   768.17 MiB
    llama_context:        CPU  output buffer size =     0.58 MiB
    llama_kv_cache:        CPU KV buffer size =    32.00 MiB
    sched_reserve:        CPU compute buffer size =    92.01 MiB
    common_memory_breakdown_print: |   - CUDA0 (NVIDIA H200) | 143771 = 120000 + (20000 = 15000 + 3000 + 2000) + 771 |

Buffer names map to devices: ``CUDA<n>`` (and ``CUDA<n>_Split``) is GPU n, everything else (``CPU``,
``CPU_Mapped``, ``CPU_REPACK``, ``CUDA_Host``, ...) is host memory.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

MiB = 1024 * 1024

_MODEL_RE = re.compile(r"load_tensors:\s+(\S+) model buffer size =\s+([\d.]+) MiB")
_KV_RE = re.compile(r"llama_kv_cache(?:_\w+)?:\s+(\S+) KV buffer size =\s+([\d.]+) MiB")
_OUT_RE = re.compile(r"llama_context:\s+(\S+)\s+output buffer size =\s+([\d.]+) MiB")
_COMPUTE_RE = re.compile(r"(?:sched_reserve|llama_context|graph_reserve):\s+(\S+) compute buffer size =\s+([\d.]+) MiB")
_RESERVE_START = re.compile(r"sched_reserve: reserving")
_CTX_RE = re.compile(r"llama_context: (n_ctx|n_ctx_seq|n_batch|n_ubatch|n_seq_max|flash_attn|kv_unified)\s+= (\S+)")
_FA_RE = re.compile(r"Flash Attention (enabled|disabled)")
_CELLS_RE = re.compile(r"llama_kv_cache: size =\s+([\d.]+) MiB \(\s*(\d+) cells,\s+(\d+) layers")
_GPU_NAME = re.compile(r"^CUDA(\d+)")


def device_of_buffer(name: str) -> str:
    """``"CUDA0"``/``"CUDA0_Split"`` -> ``"cuda0"``; every host buffer (CPU, CPU_Mapped, CPU_REPACK, CUDA_Host)
    -> ``"cpu"``."""
    m = _GPU_NAME.match(name)
    if m and not name.startswith("CUDA_Host"):
        return f"cuda{m.group(1)}"
    return "cpu"


@dataclass
class LoadReport:
    """Buffers (bytes) by buffer name, as llama.cpp logged them."""

    model: dict[str, int] = field(default_factory=dict)
    kv: dict[str, int] = field(default_factory=dict)
    output: dict[str, int] = field(default_factory=dict)
    compute: dict[str, int] = field(default_factory=dict)
    context: dict[str, str] = field(default_factory=dict)
    kv_cells: list[tuple[int, int]] = field(default_factory=list)   # (cells, layers) per KV cache

    def by_device(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for part in ("model", "kv", "output", "compute"):
            for buf, n in getattr(self, part).items():
                d = out.setdefault(device_of_buffer(buf), {"model": 0, "kv": 0, "output": 0, "compute": 0})
                d[part] += n
        for d in out.values():
            d["total"] = d["model"] + d["kv"] + d["output"] + d["compute"]
        return out

    def to_json(self) -> dict:
        return {"model": self.model, "kv": self.kv, "output": self.output, "compute": self.compute,
                "context": self.context, "kv_cells": [list(x) for x in self.kv_cells],
                "by_device": self.by_device()}


def _mib(s: str) -> int:
    return round(float(s) * MiB)


def parse_load_log(text: str) -> LoadReport:
    """Parse one llama.cpp load log. Model and KV buffers add up per buffer name (a split model maps one
    buffer per file; SWA models have two KV caches); compute buffers keep the last reservation."""
    r = LoadReport()
    compute_round: dict[str, int] = {}
    for line in text.splitlines():
        m = _MODEL_RE.search(line)
        if m:
            r.model[m.group(1)] = r.model.get(m.group(1), 0) + _mib(m.group(2))
            continue
        m = _KV_RE.search(line)
        if m:
            r.kv[m.group(1)] = r.kv.get(m.group(1), 0) + _mib(m.group(2))
            continue
        m = _OUT_RE.search(line)
        if m:
            r.output[m.group(1)] = _mib(m.group(2))
            continue
        if _RESERVE_START.search(line):
            compute_round = {}
            continue
        m = _COMPUTE_RE.search(line)
        if m:
            compute_round[m.group(1)] = _mib(m.group(2))
            r.compute = dict(compute_round)
            continue
        m = _CTX_RE.search(line)
        if m:
            r.context[m.group(1)] = m.group(2)
            continue
        m = _FA_RE.search(line)
        if m:
            r.context["flash_attn_resolved"] = m.group(1)
            continue
        m = _CELLS_RE.search(line)
        if m:
            r.kv_cells.append((int(m.group(2)), int(m.group(3))))
    return r
