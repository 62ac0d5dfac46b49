"""orchestrator probe: measure PCIe (per GPU and host NUMA node) and host memory bandwidth; cached per machine."""

from __future__ import annotations

import argparse
import json
import sys

HELP = "Measure PCIe and memory bandwidth per GPU and NUMA node (cached per machine; --refresh to re-measure)"
DESCRIPTION = (
    "Pinned host-to-device and device-to-host copy bandwidth for every GPU with the host buffer on each NUMA "
    "node in turn (so the best node per GPU is measured, not assumed), and host memory read bandwidth with "
    "threads pinned on each NUMA node reading memory of each node. The native probes (native/) are built on "
    "demand with cc and nvcc (or the CUDA runtime is called through ctypes). Results are cached per machine "
    "under the orchestrator cache and used by `inspect` and the planner. Without a GPU only host memory is "
    "measured."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--refresh", action="store_true", help="measure again even if a cached result exists")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    part = p.add_mutually_exclusive_group()
    part.add_argument("--host-only", action="store_true", help="measure host memory bandwidth only")
    part.add_argument("--gpu-only", action="store_true", help="measure GPU copy bandwidth only")
    p.add_argument("--gpu-backend", choices=("auto", "nvcc", "cudart"), default="auto",
                   help="how to reach the GPUs: native/pcie_bw.cu built with nvcc, or libcudart through ctypes "
                        "(default: nvcc when present)")
    p.add_argument("--gpu-alloc", choices=("register", "hostalloc"), default="register",
                   help="pinned host buffer: mmap+mbind+cudaHostRegister (default) or cudaHostAlloc under a bound "
                        "memory policy")
    p.add_argument("--host-bytes", metavar="SIZE", help="host buffer per memory node (default: 4x the last-level "
                                                        "cache, 512 MiB to 4 GiB)")
    p.add_argument("--gpu-bytes", metavar="SIZE", default="256MiB", help="bytes per copy (default 256MiB)")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions (default 8 per copy, 5 per host pass)")


def _size(text: str | None, flag: str) -> int | None:
    from orchestrator.errors import HardwareError
    from orchestrator.units import parse_size

    if text is None:
        return None
    try:
        n = parse_size(text)
    except ValueError as err:
        raise HardwareError(f"{flag}: {err}") from None
    if n < (1 << 20):
        raise HardwareError(f"{flag}: at least 1 MiB, got {text!r}")
    return n


def run(args: argparse.Namespace) -> int:
    from orchestrator.errors import HardwareError
    from orchestrator.hardware.probe import GPU_REPS, HOST_REPS, gpu_seconds, run_probe
    from orchestrator.hardware.render import gbps
    from orchestrator.hardware.sysfs import read_machine
    from orchestrator.resolve import cpu_prompt_probe

    if args.reps is not None and args.reps < 1:
        raise HardwareError(f"--reps: at least 1, got {args.reps}")
    host_bytes = _size(args.host_bytes, "--host-bytes")
    gpu_bytes = _size(args.gpu_bytes, "--gpu-bytes")
    machine = read_machine("/")
    log = (lambda s: None) if args.json else (lambda s: print(f"orchestrator probe: {s}", file=sys.stderr))
    res = run_probe(machine, refresh=args.refresh, host=not args.gpu_only, gpu=not args.host_only,
                    host_bytes=host_bytes, host_reps=args.reps or HOST_REPS, gpu_bytes=gpu_bytes,
                    gpu_reps=args.reps or GPU_REPS, gpu_backend=args.gpu_backend, gpu_alloc=args.gpu_alloc, log=log,
                    cpu_prompt=cpu_prompt_probe)
    bw = res.bandwidth
    if args.json:
        json.dump(res.to_json(), sys.stdout, indent=1)
        sys.stdout.write("\n")
        for msg in res.messages:
            print(f"orchestrator probe: {msg}", file=sys.stderr)
        return 1 if res.failed else 0

    when = f"cached result of {bw.measured_at} ({res.cache_file}); --refresh measures again" if res.cached \
        else f"measured {bw.measured_at} in {res.backends.get('seconds', '?')} s; cached in {res.cache_file}"
    print(f"Bandwidth probe of {machine.hostname}: {when}")
    for msg in res.messages:
        print(f"  {msg}")
    if bw.gpu_h2d:
        secs = gpu_seconds(res.records)
        for g in machine.gpus:
            best = bw.best_node_for_gpu(g.index)
            if best is None:
                continue
            extra = f" ({secs[g.index]:.2f} s)" if g.index in secs and not res.cached else ""
            print(f"GPU {g.index} {g.name} [{g.pci}], NUMA node {g.numa_node if g.numa_node >= 0 else '?'}{extra}:")
            for (gi, node), v in sorted(bw.gpu_h2d.items()):
                if gi != g.index:
                    continue
                mark = "  <- best" if node == best else ""
                print(f"  host buffer on node {node}: H2D {gbps(v)}, D2H {gbps(bw.gpu_d2h.get((gi, node)))}{mark}")
    if bw.host:
        from rich import box
        from rich.console import Console
        from rich.table import Table

        cpu_nodes = sorted({c for c, _ in bw.host})
        mem_nodes = sorted({mm for _, mm in bw.host})
        print("Host memory read bandwidth, GB/s (row: threads on the CPUs of node, column: memory of node):")
        t = Table(box=box.SIMPLE_HEAD)
        t.add_column("CPUs of", justify="right")
        for j in mem_nodes:
            t.add_column(str(j), justify="right")
        for c in cpu_nodes:
            t.add_row(str(c), *(f"{bw.host[(c, j)] / 1e9:.1f}" if (c, j) in bw.host else "-" for j in mem_nodes))
        Console(highlight=False).print(t)
    if bw.cpu_probe_pp:
        from orchestrator.plan.rates import CPU_PROBE_REFERENCE_PP

        print(f"CPU prompt speed: {bw.cpu_probe_pp:.0f} tokens/s on one core (the probe's small model, 512 tokens), "
              f"x{bw.cpu_probe_pp / CPU_PROBE_REFERENCE_PP:.2f} of the machine the CPU model was fitted on")
    return 1 if res.failed else 0
