"""The ``orchestrator inspect`` tree, like ``lstopo``: packages → NUMA nodes → core ranges, GPUs under their
NUMA node with link and bandwidth; then the NUMA distances and the measured host bandwidth as tables. A rich tree
and rich tables, rendered to text. Pure: Machine in, text out (rich is imported only here, so ``inspect --json``
runs without it)."""

from __future__ import annotations

import io

from orchestrator.hardware.topology import Core, Gpu, Machine, NumaNode
from orchestrator.units import fmt_bytes, format_cpulist


def gbps(v: float | None) -> str:
    return "?" if v is None else f"{v / 1e9:.1f} GB/s"


def _core_lines(cores: list[Core]) -> list[str]:
    """Runs of consecutive cores with the same number of PUs: 'cores 0-7: 8 x 2 PUs (PUs 0-7,64-71)'."""
    out = []
    run: list[Core] = []

    def flush():
        if not run:
            return
        n = len(run[0].pus)
        pus = format_cpulist(p for c in run for p in c.pus)
        idx = format_cpulist(c.index for c in run)
        word = "core" if len(run) == 1 else "cores"
        out.append(f"{word} {idx}: {len(run)} x {n} PU{'s' if n != 1 else ''} (PUs {pus})")

    for c in cores:
        if run and (len(c.pus) != len(run[0].pus) or c.index != run[-1].index + 1):
            flush()
            run = []
        run.append(c)
    flush()
    return out


def _node_line(n: NumaNode) -> str:
    mem = fmt_bytes(n.memory_bytes) if n.memory_bytes is not None else "memory unknown"
    free = f" ({fmt_bytes(n.free_bytes)} free)" if n.free_bytes is not None and n.memory_bytes else ""
    what = {"cpu+memory": "", "memory-only": " memory-only (no CPUs)", "memory-less": " memory-less (CPUs only)",
            "gpu-memory": f" GPU memory of {n.gpu_memory_of}", "empty": " empty"}.get(n.kind, f" {n.kind}")
    cpus = f", CPUs {format_cpulist(n.cpus)}" if n.cpus else ""
    return f"NUMANode {n.id}{what}: {mem}{free}{cpus}"


def _gpu_line(m: Machine, g: Gpu) -> str:
    parts = [f"GPU {g.index}: {g.name} [{g.pci}]"]
    if g.memory_bytes is not None:
        parts.append(fmt_bytes(g.memory_bytes))
    if g.pcie_gen or g.pcie_width:
        link = f"PCIe {g.pcie_gen or '?'} x{g.pcie_width or '?'}"
        if (g.pcie_gen_max, g.pcie_width_max) not in ((None, None), (g.pcie_gen, g.pcie_width)):
            link += f" (max {g.pcie_gen_max or '?'} x{g.pcie_width_max or '?'})"
        parts.append(link)
    if g.compute_capability:
        parts.append(f"sm {g.compute_capability}")
    if g.memory_node is not None:
        parts.append(f"memory as NUMA node {g.memory_node}")
    bw = m.bandwidth
    if bw is not None:
        best = bw.best_node_for_gpu(g.index)
        if best is not None:
            parts.append(f"H2D {gbps(bw.gpu_h2d.get((g.index, best)))}, D2H {gbps(bw.gpu_d2h.get((g.index, best)))} "
                         f"from node {best}")
    if g.source == "sysfs":
        parts.append("(from sysfs)")
    return ", ".join(parts)


def render_tree(m: Machine, width: int = 160) -> str:
    from rich import box
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text
    from rich.tree import Tree

    s = m.summary()
    plural = lambda n, w: f"{n} {w}{'' if n == 1 else 's'}"  # noqa: E731
    label = lambda text: Text(text, no_wrap=True, overflow="ignore")  # noqa: E731
    smt = f"SMT {m.threads_per_core} threads/core" if m.smt else "no SMT"
    root = Tree(label(f"Machine {m.hostname} ({m.arch}{', ' + m.cpu_model if m.cpu_model else ''})"))
    root.add(label(f"{plural(s['packages'], 'package')}, {plural(s['numa_nodes'], 'NUMA node')}, "
                   f"{plural(s['cores'], 'core')}, {plural(s['pus'], 'PU')} ({smt}), {plural(s['gpus'], 'GPU')}; "
                   f"memory {fmt_bytes(m.memory_total_bytes)}"
                   + (f" ({fmt_bytes(m.memory_available_bytes)} available)"
                      if m.memory_available_bytes is not None else "")))
    if m.source:
        root.add(label(f"source: {m.source}"))

    gpus_by_node: dict[int | None, list[Gpu]] = {}
    for g in m.gpus:
        gpus_by_node.setdefault(m.nearest_cpu_node(g), []).append(g)

    def node_block(parent, n: NumaNode, cores: list[Core] | None = None):
        branch = parent.add(label(_node_line(n)))
        for line in _core_lines(cores if cores is not None else list(m.cores_of_node(n.id))):
            branch.add(label(line))
        for g in gpus_by_node.pop(n.id, []):
            branch.add(label(_gpu_line(m, g)))

    shown: set[int] = set()
    node_in_one_pkg = all(len(n.packages) <= 1 for n in m.numa_nodes)
    pkg_in_one_node = all(len(p.nodes) <= 1 for p in m.packages)
    if node_in_one_pkg:
        for p in m.packages:
            pb = root.add(label(f"Package {p.id}: {plural(len(p.cores), 'core')}, PUs {format_cpulist(p.cpus)}"))
            for nid in p.nodes:
                node_block(pb, m.node(nid))
                shown.add(nid)
            loose = [c for c in m.cores_of_package(p.id) if c.node is None]
            if loose:
                lb = pb.add(label("(in no NUMA node)"))
                for line in _core_lines(loose):
                    lb.add(label(line))
    elif pkg_in_one_node:
        for n in m.numa_nodes:
            if not n.packages:
                continue
            nb_ = root.add(label(_node_line(n)))
            shown.add(n.id)
            for pid in n.packages:
                p = m.package(pid)
                pb = nb_.add(label(f"Package {p.id}: PUs {format_cpulist(p.cpus)}"))
                for line in _core_lines(list(m.cores_of_package(pid))):
                    pb.add(label(line))
            for g in gpus_by_node.pop(n.id, []):
                nb_.add(label(_gpu_line(m, g)))
    else:
        for p in m.packages:
            root.add(label(f"Package {p.id}: {plural(len(p.cores), 'core')}, PUs {format_cpulist(p.cpus)}, "
                           f"NUMA nodes {format_cpulist(p.nodes)}"))
        for n in m.numa_nodes:
            if n.cpus:
                node_block(root, n)
                shown.add(n.id)
    for n in m.numa_nodes:
        if n.id not in shown:
            node_block(root, n, cores=[])
    for g in gpus_by_node.pop(None, []) + [g for v in gpus_by_node.values() for g in v]:
        root.add(label(_gpu_line(m, g) + ", NUMA node unknown"))

    after: list = []
    links = [(g.index, j, link) for g in m.gpus for j, link in g.peers if j > g.index]
    if links:
        after.append("GPU links: " + ", ".join(f"{a}-{b} {link}" for a, b, link in links))
    for d in m.pci_devices:
        after.append(f"Other PCI device {d.pci} class {d.pci_class} vendor {d.vendor_id or '?'}"
                     f"{', NUMA node ' + str(d.numa_node) if d.numa_node >= 0 else ''}")

    ids = [n.id for n in m.numa_nodes]
    if len(ids) > 1 and all(n.distances for n in m.numa_nodes):
        after.append("NUMA distances:")
        t = Table(box=box.SIMPLE_HEAD)
        t.add_column("node", justify="right")
        for i in ids:
            t.add_column(str(i), justify="right")
        for n in m.numa_nodes:
            t.add_row(str(n.id), *(str(n.distance_to(j)) if n.distance_to(j) is not None else "?" for j in ids))
        after.append(t)
    elif len(ids) > 1:
        after.append("NUMA distances: unknown")

    if m.bandwidth is not None and m.bandwidth.host:
        cpu_nodes = sorted({c for c, _ in m.bandwidth.host})
        mem_nodes = sorted({mm for _, mm in m.bandwidth.host})
        after.append("Host memory read bandwidth, GB/s (row: CPUs of node, column: memory of node):")
        t = Table(box=box.SIMPLE_HEAD)
        t.add_column("CPUs of", justify="right")
        for j in mem_nodes:
            t.add_column(str(j), justify="right")
        for c in cpu_nodes:
            t.add_row(str(c), *(f"{m.bandwidth.host[(c, j)] / 1e9:.1f}" if (c, j) in m.bandwidth.host else "?"
                                 for j in mem_nodes))
        after.append(t)
    if m.bandwidth is not None:
        after.append(f"  (probe of {m.bandwidth.measured_at}; `orchestrator probe --refresh` measures again)")

    nb = {None: "not in this kernel", 0: "off (0)"}.get(m.numa_balancing, f"ON ({m.numa_balancing})")
    hp = ", ".join(f"{fmt_bytes(h.page_bytes, precision=0)}: {h.total if h.total is not None else '?'} "
                   f"({h.free if h.free is not None else '?'} free)" for h in m.hugepages if h.node is None)
    after.append(f"Memory: NUMA balancing {nb}; transparent huge pages {m.thp or 'unknown'}; "
                 f"huge pages {hp or 'none'}")
    if m.restricted:
        after.append(f"This process may use: CPUs {format_cpulist(m.allowed_cpus)} ({len(m.allowed_cpus)} of "
                     f"{len(m.pus)}), NUMA nodes {format_cpulist(m.allowed_nodes)}"
                     + (f" [{m.cgroup}]" if m.cgroup else ""))
    else:
        after.append("This process may use every CPU and NUMA node" + (f" [{m.cgroup}]" if m.cgroup else ""))
    if m.offline_cpus or m.offline_nodes:
        after.append("Offline: " + "; ".join(x for x in (
            f"CPUs {format_cpulist(m.offline_cpus)}" if m.offline_cpus else "",
            f"NUMA nodes {format_cpulist(m.offline_nodes)}" if m.offline_nodes else "") if x))
    if m.gpu_driver:
        after.append(f"NVIDIA driver {m.gpu_driver}")
    for note in m.notes:
        after.append(f"note: {note}")

    buf = io.StringIO()
    console = Console(file=buf, width=width, color_system=None, force_terminal=False, highlight=False,
                      legacy_windows=False)
    console.print(root)
    for item in after:
        console.print(label(item) if isinstance(item, str) else item)
    return "\n".join(line.rstrip() for line in buf.getvalue().splitlines()) + "\n"
