"""What ``status`` shows: a worker's binding and devices (from the settings stored with its spec), and the table
itself. Pure."""

from __future__ import annotations

import os
from typing import Any, Iterable, Mapping, Sequence

from orchestrator.backend.server_options import option
from orchestrator.launch.llama_args import flags_of
from orchestrator.launch.spec import LaunchSpec
from orchestrator.units import fmt_bytes

# options of llama-server that say where it computes, for a hand-written argv (no settings with it)
_LLAMA_DEVICE_OPTS = flags_of("n_gpu_layers", "split_mode", "tensor_split", "main_gpu") + option("--device").flags
_LLAMA_CPU_OPTS = flags_of("numa_flag", "threads") + option("--cpu-mask").flags + option("--cpu-range").flags


def describe_binding(spec: LaunchSpec) -> str:
    """The CPU/memory binding of a worker: its NUMA policy, whether NUMA balancing is switched off, llama-server's
    own ``--numa`` and threads; '-' when there is none. A planned worker's settings say it; a hand-written argv
    (no settings) is read for numactl's and the wrappers' options."""
    s = spec.settings
    if s is None:
        return _binding_from_argv(spec.argv)
    parts = []
    if s.disable_numa_balancing:
        parts.append("numa-balancing off")
    if s.numa.mode != "none":
        parts.append(s.numa.describe())
    if s.numa_flag:
        parts.append(f"--numa {s.numa_flag}")
    if s.threads is not None:
        parts.append(f"-t {s.threads}" + (f" -tb {s.threads_batch}" if s.threads_batch not in (None, s.threads)
                                          else ""))
    return ", ".join(parts) if parts else "-"


def _binding_from_argv(argv: Sequence[str]) -> str:
    parts: list[str] = []
    i = 0
    n = len(argv)
    while i < n:
        b = os.path.basename(argv[i])
        if b == "disable-numa-balancing.sh":
            parts.append("numa-balancing off")
            i += 1
            continue
        if b in ("numactl", "numactl-bind-socket.sh"):
            j = i + 1
            opts = []
            while j < n and argv[j].startswith("-"):
                if argv[j] == "--":
                    j += 1
                    break
                opt = argv[j]
                # "--socket 0" style: the next token is a value, not the command
                if "=" not in opt and j + 1 < n and not argv[j + 1].startswith("-") and (
                        b == "numactl-bind-socket.sh" or opt in ("-N", "-m", "-C", "-i", "-p")):
                    opt = f"{opt} {argv[j + 1]}"
                    j += 1
                opts.append(opt)
                j += 1
            parts.append(f"{'numactl' if b == 'numactl' else 'socket'} {' '.join(opts)}".strip())
            i = j
            continue
        if b.startswith("llama-server") or b.startswith("llama_server"):
            rest = argv[i + 1:]
            for k, a in enumerate(rest):
                if a in _LLAMA_CPU_OPTS and k + 1 < len(rest):
                    parts.append(f"{a} {rest[k + 1]}")
            break
        i += 1
    return ", ".join(parts) if parts else "-"


def describe_devices(spec: LaunchSpec) -> str:
    """``cuda:0,1`` for the GPUs a worker sees (plus its layers and split), ``cpu`` when every GPU is hidden,
    ``-`` when nothing says. From the settings of a planned worker, else from its env and argv."""
    s = spec.settings
    if s is not None:
        parts = []
        if s.gpus is not None:
            parts.append(f"cuda:{','.join(map(str, s.gpus))}" if s.gpus else "cpu")
        for flag, value in (("-ngl", s.n_gpu_layers), ("-sm", s.split_mode),
                            ("-ts", ",".join(f"{x:g}" for x in s.tensor_split) or None), ("-mg", s.main_gpu)):
            if value is not None:
                parts.append(f"{flag} {value}")
        return ", ".join(parts) if parts else "-"
    parts = []
    cvd = spec.env.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None:
        parts.append(f"cuda:{cvd}" if cvd.strip() not in ("", "-1") else "cpu")
    for k, a in enumerate(spec.argv):
        if a in _LLAMA_DEVICE_OPTS and k + 1 < len(spec.argv):
            parts.append(f"{a} {spec.argv[k + 1]}")
    return ", ".join(parts) if parts else "-"


def _mib(b: Any) -> str:
    return fmt_bytes(b) if b else "-"


def _seconds(a: float | None, b: float | None) -> str:
    """``41/120 ms`` or ``1.2/3.4 s``: two latencies in the unit of the larger."""
    if a is None or b is None:
        return "-"
    if max(a, b) < 10:
        return f"{a * 1000:.0f}/{b * 1000:.0f} ms"
    return f"{a:.1f}/{b:.1f} s"


def latency_cells(lat: Mapping[str, Any] | None) -> list[str]:
    """Time to first token p50/p95 and tokens/s per stream (p50) of the last minutes, as the gateway saw them;
    '-' where no stream was answered in that time."""
    lat = lat or {}
    if not lat.get("streams"):
        return ["-", "-"]
    tps = lat.get("tokens_per_s_p50")
    return [_seconds(lat.get("ttft_p50_s"), lat.get("ttft_p95_s")), f"{tps:.1f}" if tps is not None else "-"]


def worker_rows(workers: Iterable[Mapping[str, Any]]) -> list[list[str]]:
    rows = []
    for w in workers:
        m = w.get("metrics") or {}
        gpus = m.get("gpus") or []
        vram = sum(g.get("worker_vram", 0) for g in gpus)
        mem = _mib(m.get("rss_bytes"))
        if vram:
            mem += f" +{_mib(vram)} vram"
        tps = "-"
        if w.get("state") == "ready":
            tps = f"{m.get('prompt_tps', 0):.0f}/{m.get('generation_tps', 0):.1f}"
        err = w.get("reason") or w.get("last_error") or ""
        rows.append([
            str(w.get("name", "?")), str(w.get("state", "?")), str(w.get("pid") or "-"),
            str(w.get("node") or "-"), str(w.get("binding") or "-"), str(w.get("devices") or "-"), mem, tps,
            *latency_cells(w.get("latency")), str(w.get("restarts", 0)), err,
        ])
    return rows


HEADER = ["worker", "state", "pid", "node", "binding", "devices", "memory", "tok/s p/g", "ttft p50/p95",
          "stream tok/s", "restarts", "last error"]
LATENCY_NOTE = ("ttft p50/p95, stream tok/s: streamed answers of the last 5 minutes, through the gateway "
                "(from Ray's metrics endpoint)")


def format_table(rows: list[list[str]], header: list[str] = HEADER, max_last: int = 90) -> str:
    rows = [r[:-1] + [r[-1] if len(r[-1]) <= max_last else r[-1][: max_last - 1] + "…"] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(header)] + [line(r) for r in rows])


def format_status(st: Mapping[str, Any]) -> str:
    """The human view of :meth:`Controller.status`."""
    gw = st.get("gateway") or {}
    head = [f"deployment {st.get('namespace')}: {st.get('phase')}"
            + (f" ({st['error']})" if st.get("error") else ""),
            f"gateway    {gw.get('url', '-')}  {gw.get('state', '-')}"
            + (f"  {gw.get('error')}" if gw.get("error") else "")
            + (f"  healthy replicas: {gw.get('healthy', 0)}/{len(st.get('workers') or [])}")]
    for key, label in (("dashboard_url", "dashboard "), ("metrics_url", "metrics   "), ("ray_address", "ray       ")):
        if st.get(key):
            head.append(f"{label} {st[key]}")
    workers = st.get("workers") or []
    note = ""
    if st.get("latency_error"):
        note = f"\n\nttft and stream tok/s unknown: {st['latency_error']}"
    elif any((w.get("latency") or {}).get("streams") for w in workers):
        note = "\n\n" + LATENCY_NOTE
    return "\n".join(head) + "\n\n" + format_table(worker_rows(workers)) + note
