"""What llama-server itself says it allocated, read from its log (with ``-lv 4``, llama.cpp's trace level: the
buffer sizes at load, what ``--fit`` decided, the memory breakdown at exit).

The bench adds ``-lv 4`` to every configuration when the binary knows it, so a run records per buffer type the
bytes of weights (``model``), KV cache (``kv``) and compute buffers (``compute``) — e.g. how much of the model
``--fit`` put on ``CUDA0`` against a ``--n-cpu-moe`` point — next to the NVML peak.
"""

from __future__ import annotations

import re
from pathlib import Path

_MiB = 1 << 20
_PATTERNS = {
    "model": re.compile(r"load_tensors:\s+(\S+) model buffer size\s*=\s*([\d.]+) MiB"),
    "kv": re.compile(r"llama_kv_cache:\s+(\S+) KV buffer size\s*=\s*([\d.]+) MiB"),
    "compute": re.compile(r"sched_reserve:\s+(\S+) compute buffer size\s*=\s*([\d.]+) MiB"),
}
_OFFLOADED = re.compile(r"offloaded (\d+)/(\d+) layers to GPU")
_FIT = re.compile(r"(common_params_fit_impl|common_fit_params|llama_params_fit\w*): (.*)")
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def parse_server_log(path: str | Path, max_fit_lines: int = 40) -> dict:
    """``{"buffers": {"model": {"CUDA0": bytes, "CPU_Mapped": bytes}, "kv": {...}, "compute": {...}},
    "offloaded_layers": [n, of], "fit": [lines]}`` with only what the log contains (the last load wins)."""
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return {}
    buffers: dict[str, dict[str, int]] = {}
    fit: list[str] = []
    out: dict = {}
    for raw in text.splitlines():
        line = _ANSI.sub("", raw)
        if "load_tensors: loading model tensors" in line:
            buffers = {}                      # a new load (the log file is appended to)
        for kind, rx in _PATTERNS.items():
            m = rx.search(line)
            if m:
                buffers.setdefault(kind, {})[m.group(1)] = int(float(m.group(2)) * _MiB)
        m = _OFFLOADED.search(line)
        if m:
            out["offloaded_layers"] = [int(m.group(1)), int(m.group(2))]
        m = _FIT.search(line)
        if m and len(fit) < max_fit_lines:
            fit.append(" ".join(m.group(2).split()))
    if buffers:
        out["buffers"] = buffers
    if fit:
        out["fit"] = fit
    return out


def device_totals(buffers: dict) -> dict[str, int]:
    """Bytes per buffer type over weights, KV and compute: ``{"CUDA0": ..., "CPU_Mapped": ..., "CPU": ...}``."""
    out: dict[str, int] = {}
    for kind in ("model", "kv", "compute"):
        for dev, n in (buffers.get(kind) or {}).items():
            out[dev] = out.get(dev, 0) + n
    return out
