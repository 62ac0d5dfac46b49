"""Benchmark: our PCIe probe against torch's pinned copies, same machine, same run.

    python3 -m lab.bench_probe [--backends nvcc,cudart] [--allocs register,hostalloc]
                                                 [--bytes 256MiB] [--reps 8] [--host] [--json OUT]

For every GPU it prints the best pinned H2D and D2H bandwidth our probe measured (over the NUMA nodes the
host buffer was put on) and torch's (``tensor.copy_(pinned, non_blocking=True)`` timed with CUDA events, the
copying thread pinned to each NUMA node in turn before the pinned buffer is allocated), their ratio, and the
probe's time per GPU. Targets: ratio >= 0.95, <= 3 s per GPU. Needs torch with CUDA; the rest of
orchestrator.hardware needs only the standard library (and nvidia-ml-py for GPU names).
"""

from __future__ import annotations

import os

os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")  # before torch: CUDA ordinals in PCI order, like NVML

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402


def torch_pinned(nbytes: int, reps: int, nodes: list[tuple[int, tuple[int, ...]]]) -> dict:
    """{(gpu, node): (h2d_best, d2h_best)} with torch; PCI address per torch device index."""
    import torch

    out: dict = {}
    pci: dict = {}
    saved = os.sched_getaffinity(0)
    try:
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            if hasattr(props, "pci_bus_id"):
                pci[i] = (f"{getattr(props, 'pci_domain_id', 0):04x}:{props.pci_bus_id:02x}:"
                          f"{getattr(props, 'pci_device_id', 0):02x}.0")
            dev = torch.device(f"cuda:{i}")
            d = torch.empty(nbytes, dtype=torch.uint8, device=dev)
            for node, cpus in nodes:
                if cpus:
                    os.sched_setaffinity(0, cpus)
                h = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
                h.fill_(1)
                res = []
                with torch.cuda.device(dev):
                    stream = torch.cuda.Stream()
                    for direction in ("h2d", "d2h"):
                        vals = []
                        for r in range(reps + 1):
                            e0 = torch.cuda.Event(enable_timing=True)
                            e1 = torch.cuda.Event(enable_timing=True)
                            with torch.cuda.stream(stream):
                                e0.record(stream)
                                if direction == "h2d":
                                    d.copy_(h, non_blocking=True)
                                else:
                                    h.copy_(d, non_blocking=True)
                                e1.record(stream)
                            e1.synchronize()
                            if r > 0:
                                vals.append(nbytes / (e0.elapsed_time(e1) * 1e-3))
                        res.append(max(vals))
                out[(i, node)] = tuple(res)
                del h
                # torch caches pinned blocks: without this the next node would reuse this node's buffer
                if hasattr(torch._C, "_host_emptyCache"):
                    torch._C._host_emptyCache()
            del d
            torch.cuda.empty_cache()
    finally:
        os.sched_setaffinity(0, saved)
    return {"bw": out, "pci": pci}


def main(argv: list[str] | None = None) -> int:
    from orchestrator.hardware.probe import build_native, find_nvcc, gpu_nodes, gpu_seconds, run_probe
    from orchestrator.hardware.sysfs import _norm_pci, read_machine
    from orchestrator.units import parse_size

    ap = argparse.ArgumentParser(prog="bench_probe", description=__doc__.split("\n\n")[0])
    ap.add_argument("--backends", default="nvcc,cudart", help="probe backends to run (nvcc, cudart)")
    ap.add_argument("--allocs", default="register,hostalloc",
                    help="host buffer kinds to run: register (mmap+mbind+cudaHostRegister), hostalloc")
    ap.add_argument("--bytes", default="256MiB")
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--host", action="store_true", help="also run the host memory probe")
    ap.add_argument("--json", metavar="OUT", help="write every number to OUT (JSON)")
    args = ap.parse_args(argv)
    nbytes = parse_size(args.bytes)

    m = read_machine("/")
    print(f"machine: {m.hostname}, {m.cpu_model}, {len(m.packages)} package(s), {len(m.numa_nodes)} NUMA node(s), "
          f"{len(m.gpus)} GPU(s), driver {m.gpu_driver}")
    for g in m.gpus:
        print(f"  GPU {g.index}: {g.name} [{g.pci}] numa_node {g.numa_node} PCIe {g.pcie_gen} x{g.pcie_width} "
              f"(max {g.pcie_gen_max} x{g.pcie_width_max})")
    for note in m.notes:
        print(f"  note: {note}")
    report: dict = {"machine": m.to_json(), "bytes": nbytes, "reps": args.reps, "probe": {}, "torch": None}
    if not m.gpus:
        print("no GPU: nothing to compare")
    ours: dict = {}
    runs = [(b, a) for b in args.backends.split(",") if b for a in args.allocs.split(",") if a]
    if m.gpus and any(b == "nvcc" for b, _ in runs) and find_nvcc():
        print(f"building native/pcie_bw.cu (once, outside the timings): {build_native('pcie_bw', find_nvcc())}")
    for backend, alloc in runs:
        label = f"{backend}/{alloc}"
        t0 = time.monotonic()
        res = run_probe(m, refresh=True, host=False, gpu=True, gpu_bytes=nbytes, gpu_reps=args.reps,
                        gpu_backend=backend, gpu_alloc=alloc, save=False)
        wall = time.monotonic() - t0
        secs = gpu_seconds(res.records)
        ours[label] = res
        report["probe"][label] = {**res.to_json(), "wall_seconds": wall, "gpu_seconds": secs}
        print(f"\nprobe {label}: {res.backends.get('gpu', 'unavailable')}; wall {wall:.2f} s for "
              f"{len(m.gpus)} GPU(s) = {wall / max(1, len(m.gpus)):.2f} s per GPU (build excluded if cached)")
        for msg in res.messages:
            print(f"  {msg}")
        for (gi, node), v in sorted(res.bandwidth.gpu_h2d.items()):
            rec = next((r for r in res.records if r.get("gpu") == gi and r.get("node") == node), {})
            print(f"  GPU {gi} host node {node} (placed {rec.get('placed_node', '?')}): H2D {v / 1e9:.2f} GB/s "
                  f"(median {rec.get('h2d_median', 0) / 1e9:.2f}), D2H {res.bandwidth.gpu_d2h[(gi, node)] / 1e9:.2f} "
                  f"GB/s (median {rec.get('d2h_median', 0) / 1e9:.2f})")
        for gi, s in sorted(secs.items()):
            print(f"  GPU {gi}: {s:.2f} s in the probe (context + copies){'  OVER 3 s' if s > 3 else ''}")

    if m.gpus and not args.no_torch:
        try:
            t = torch_pinned(nbytes, args.reps, gpu_nodes(m))
        except Exception as err:  # torch missing or without CUDA
            print(f"\ntorch: not measured ({type(err).__name__}: {err})")
            t = None
        if t is not None:
            by_pci = {g.pci: g.index for g in m.gpus}
            tb = {(by_pci.get(_norm_pci(t["pci"].get(i, "")), i), node): v for (i, node), v in t["bw"].items()}
            report["torch"] = [{"gpu": g, "node": n, "h2d": v[0], "d2h": v[1]} for (g, n), v in sorted(tb.items())]
            print("\ntorch pinned copies (thread pinned to the node before pin_memory allocation):")
            for (g, n), (h, d) in sorted(tb.items()):
                print(f"  GPU {g} node {n}: H2D {h / 1e9:.2f} GB/s, D2H {d / 1e9:.2f} GB/s")
            print("\nours / torch (best over nodes), target >= 0.95:")
            verdict = True
            for backend, res in ours.items():
                for g in m.gpus:
                    o_h = max((v for (gi, _), v in res.bandwidth.gpu_h2d.items() if gi == g.index), default=0)
                    o_d = max((v for (gi, _), v in res.bandwidth.gpu_d2h.items() if gi == g.index), default=0)
                    t_h = max((v[0] for (gi, _), v in tb.items() if gi == g.index), default=0)
                    t_d = max((v[1] for (gi, _), v in tb.items() if gi == g.index), default=0)
                    rh = o_h / t_h if t_h else 0
                    rd = o_d / t_d if t_d else 0
                    ok = rh >= 0.95 and rd >= 0.95
                    verdict &= ok
                    print(f"  {backend:17s} GPU {g.index}: H2D {o_h / 1e9:.2f} vs {t_h / 1e9:.2f} GB/s = {rh:.3f}; "
                          f"D2H {o_d / 1e9:.2f} vs {t_d / 1e9:.2f} GB/s = {rd:.3f}  {'OK' if ok else 'BELOW TARGET'}")
            report["ratio_target_met"] = verdict
    if args.host:
        res = run_probe(m, refresh=True, host=True, gpu=False, save=False)
        report["host"] = res.to_json()
        print("\nhost memory read bandwidth (GB/s):")
        for (c, mm), v in sorted(res.bandwidth.host.items()):
            print(f"  CPUs of node {c} reading node {mm}: {v / 1e9:.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
