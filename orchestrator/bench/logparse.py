"""What llama.cpp itself says it allocated, read from its log: the one parser of llama.cpp load logs.

``llama-server -lv 4`` (llama.cpp's trace level) logs the buffer sizes at load, what ``--fit`` decided and the
memory breakdown at exit. The bench adds ``-lv 4`` to every configuration when the binary knows it, so a run
records per buffer type the bytes of weights (``model``), KV cache (``kv``) and compute buffers (``compute``)
next to the NVML peak; the memory model's calibration (``lab/calibrate.py``) reads the same lines.

Lines read (mainline llama.cpp, late 2026; ik_llama.cpp prints the same first four)::

    load_tensors:   CPU_Mapped model buffer size =   768.17 MiB
    llama_context:        CPU  output buffer size =     0.58 MiB
    llama_kv_cache:        CPU KV buffer size =    32.00 MiB
    sched_reserve:        CPU compute buffer size =    92.01 MiB
    load_tensors: offloaded 49/49 layers to GPU

and, from a build with the expert cache (``--moe-cache-mib``), its size as the server made it::

    ggml_backend_sched_moe_cache_init: expert cache: 78 host-resident expert tensors x 34 slots (of 128 experts),
        2237.6 MiB of device memory, batches up to 4 tokens

Buffer names map to devices as :func:`orchestrator.backend.devices.device_of_buffer` says: ``CUDA<n>`` (and
``CUDA<n>_Split``) is ``CUDA<n>``, ``RPC<i>[HOST:PORT]`` an RPC device, everything else (``CPU``, ``CPU_Mapped``,
``CPU_REPACK``, ``CUDA_Host``, ...) is host memory, ``CPU``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator.backend.devices import device_of_buffer

MiB = 1024 * 1024

_MODEL_RE = re.compile(r"load_tensors:\s+(\S+) model buffer size\s*=\s*([\d.]+) MiB")
_KV_RE = re.compile(r"llama_kv_cache(?:_\w+)?:\s+(\S+) KV buffer size\s*=\s*([\d.]+) MiB")
_OUT_RE = re.compile(r"llama_context:\s+(\S+)\s+output buffer size\s*=\s*([\d.]+) MiB")
_COMPUTE_RE = re.compile(r"(?:sched_reserve|llama_context|graph_reserve):\s+(\S+) compute buffer size\s*=\s*"
                         r"([\d.]+) MiB")
_LOAD_START = "load_tensors: loading model tensors"   # a new load: the bench's log file is appended to
_RESERVE_START = re.compile(r"sched_reserve: reserving")
_CTX_RE = re.compile(r"llama_context: (n_ctx|n_ctx_seq|n_batch|n_ubatch|n_seq_max|flash_attn|kv_unified)\s+= (\S+)")
_FA_RE = re.compile(r"Flash Attention (enabled|disabled)")
_CELLS_RE = re.compile(r"llama_kv_cache: size =\s+([\d.]+) MiB \(\s*(\d+) cells,\s+(\d+) layers")
_OFFLOADED = re.compile(r"offloaded (\d+)/(\d+) layers to GPU")
_FIT = re.compile(r"(common_params_fit_impl|common_fit_params|llama_params_fit\w*): (.*)")
_CACHE_MADE = re.compile(r"expert cache: (\d+) host-resident expert tensors x (\d+) slots \(of (\d+) experts\), "
                        r"([\d.]+) MiB of device memory, batches up to (\d+) tokens(;.*)?$")
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


@dataclass
class LoadReport:
    """Buffers (bytes) by buffer name, as llama.cpp logged them for the last load in the log."""

    model: dict[str, int] = field(default_factory=dict)
    kv: dict[str, int] = field(default_factory=dict)
    output: dict[str, int] = field(default_factory=dict)
    compute: dict[str, int] = field(default_factory=dict)
    context: dict[str, str] = field(default_factory=dict)
    kv_cells: list[tuple[int, int]] = field(default_factory=list)   # (cells, layers) per KV cache
    offloaded_layers: tuple[int, int] | None = None                 # (on the GPU, of)
    fit: list[str] = field(default_factory=list)                    # what --fit said, whitespace folded
    expert_cache: dict | None = None                                # the expert cache the server made

    def by_device(self, rpc_endpoints: tuple[str, ...] | list[str] = ()) -> dict[str, dict[str, int]]:
        """Bytes per device (``CUDA0``, ``RPC1``, ``CPU``); ``rpc_endpoints``: the ``--rpc`` list, which tells
        the RPC devices' buffers apart."""
        out: dict[str, dict[str, int]] = {}
        for part in ("model", "kv", "output", "compute"):
            for buf, n in getattr(self, part).items():
                d = out.setdefault(device_of_buffer(buf, rpc_endpoints),
                                   {"model": 0, "kv": 0, "output": 0, "compute": 0})
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


def parse_load_log(text: str, max_fit_lines: int = 40) -> LoadReport:
    """Parse a llama.cpp log. Only the last load counts (a log appended to by several starts); within it, model
    and KV buffers add up per buffer name (a split model maps one buffer per file; SWA models have two KV
    caches) and compute buffers keep the last reservation."""
    r = LoadReport()
    compute_round: dict[str, int] = {}
    for raw in text.splitlines():
        line = _ANSI.sub("", raw)
        if _LOAD_START in line:
            r = LoadReport(fit=r.fit)
            compute_round = {}
            continue
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
            continue
        m = _OFFLOADED.search(line)
        if m:
            r.offloaded_layers = (int(m.group(1)), int(m.group(2)))
            continue
        m = _CACHE_MADE.search(line)
        if m:
            r.expert_cache = {"tensors": int(m.group(1)), "slots": int(m.group(2)), "n_expert": int(m.group(3)),
                           "bytes": _mib(m.group(4)), "max_batch": int(m.group(5)),
                           "cpu_misses": m.group(6) is not None}
            continue
        m = _FIT.search(line)
        if m and len(r.fit) < max_fit_lines:
            r.fit.append(" ".join(m.group(2).split()))
    return r


def parse_server_log(path: str | Path, max_fit_lines: int = 40) -> dict:
    """What the bench stores per run: ``{"buffers": {"model": {"CUDA0": bytes, "CPU_Mapped": bytes}, "kv": {...},
    "compute": {...}}, "offloaded_layers": [n, of], "fit": [lines], "expert_cache": {"slots": n, "bytes": n, ...}}``
    with only what the log contains."""
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return {}
    r = parse_load_log(text, max_fit_lines)
    out: dict = {}
    if r.offloaded_layers:
        out["offloaded_layers"] = list(r.offloaded_layers)
    buffers = {kind: dict(part) for kind, part in (("model", r.model), ("kv", r.kv), ("compute", r.compute)) if part}
    if buffers:
        out["buffers"] = buffers
    if r.fit:
        out["fit"] = r.fit
    if r.expert_cache:
        out["expert_cache"] = r.expert_cache
    return out


def device_totals(buffers: dict) -> dict[str, int]:
    """Bytes per buffer type over weights, KV and compute: ``{"CUDA0": ..., "CPU_Mapped": ..., "CPU": ...}``."""
    out: dict[str, int] = {}
    for kind in ("model", "kv", "compute"):
        for dev, n in (buffers.get(kind) or {}).items():
            out[dev] = out.get(dev, 0) + n
    return out
