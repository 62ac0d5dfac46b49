"""The CPU side of a worker: which NUMA nodes it binds to or interleaves over, and how many threads."""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.hardware.topology import Machine
from orchestrator.launch.numa import NumaPolicy
from orchestrator.plan.types import Decision
from orchestrator.units import fmt_bytes, format_cpulist


@dataclass(frozen=True)
class CpuChoice:
    numa: NumaPolicy
    numa_flag: str                  # llama.cpp's --numa for that policy ("" = not passed)
    threads: int
    threads_batch: int
    decisions: tuple[Decision, ...]
    host_nodes: tuple[int, ...]     # nodes whose memory holds the CPU-resident bytes


def _cpu_nodes(machine: Machine) -> list:
    allowed = set(machine.allowed_nodes or [n.id for n in machine.numa_nodes])
    allowed_cpus = set(machine.allowed_cpus or machine.pus)
    return [n for n in machine.numa_nodes if n.id in allowed and set(n.cpus) & allowed_cpus]


def node_available(machine: Machine, node) -> int:
    """Memory a worker can get on ``node``: its free memory plus its share of what the kernel can reclaim (page
    cache: often the model file itself). /proc/meminfo's MemAvailable is machine-wide; it is shared out over the
    nodes in proportion to their size."""
    free = node.free_bytes if node.free_bytes is not None else (node.memory_bytes or 0)
    nodes = [n for n in machine.numa_nodes if n.memory_bytes]
    if machine.memory_available_bytes and nodes:
        total_free = sum((n.free_bytes if n.free_bytes is not None else n.memory_bytes or 0) for n in nodes)
        reclaimable = max(0, machine.memory_available_bytes - total_free)
        total = sum(n.memory_bytes for n in nodes)
        free += int(reclaimable * (node.memory_bytes or 0) / total) if total else 0
    return free


def _node_cpus(machine: Machine, nodes) -> list[int]:
    allowed_cpus = set(machine.allowed_cpus or machine.pus)
    return sorted({c for n in nodes for c in n.cpus if c in allowed_cpus})


def _physical(machine: Machine, cpus: list[int]) -> list[int]:
    """One hardware thread per core among ``cpus`` (the lowest-numbered)."""
    wanted = set(cpus)
    out = []
    for core in machine.cores:
        pus = sorted(p for p in core.pus if p in wanted)
        if pus:
            out.append(pus[0])
    return sorted(out)


def choose_cpu(machine: Machine, *, host_bytes: int, ram_reserve: int, anchor_node: int | None,
               package: int | None = None, policy: str = "auto", smt: str = "auto",
               threads: int | None = None, threads_batch: int | None = None,
               share: tuple[int, int] | None = None) -> CpuChoice:
    """Bind when the CPU-resident bytes fit the anchor node's free memory; else interleave over the anchor's
    socket, else over every node. ``anchor_node`` = the node nearest the main GPU (or the socket's first)."""
    nodes = _cpu_nodes(machine)
    decisions: list[Decision] = []

    def _avail(n) -> int:
        return node_available(machine, n)

    if not nodes:  # no NUMA information at all: whole machine, no binding
        cpus = sorted(machine.allowed_cpus or machine.pus)
        phys = _physical(machine, cpus) or cpus
        t = threads or len(phys)
        return CpuChoice(NumaPolicy.none(cpus), "", t, threads_batch or len(cpus),
                         (Decision("numa", "none", "no NUMA nodes with CPUs are visible"),), ())
    by_id = {n.id: n for n in nodes}
    if anchor_node not in by_id:
        if package is not None:
            cands = [n for n in nodes if package in n.packages]
            anchor_node = cands[0].id if cands else nodes[0].id
        else:
            anchor_node = max(nodes, key=_avail).id
    anchor = by_id[anchor_node]
    pkg = package if package is not None else (anchor.packages[0] if anchor.packages else None)
    socket_nodes = [n for n in nodes if pkg is not None and pkg in n.packages] or [anchor]
    need = host_bytes + ram_reserve

    if len(machine.numa_nodes) <= 1 or len(nodes) == 1 and policy == "auto":
        chosen, mode = [anchor], "none"
        why = "one NUMA node: nothing to bind or interleave"
    elif policy == "none":
        chosen, mode, why = nodes, "none", "numa: none requested"
    elif policy == "bind" or (policy == "auto" and need <= _avail(anchor)):
        chosen, mode = [anchor], "bind"
        why = (f"CPU-resident {fmt_bytes(host_bytes)} + reserve {fmt_bytes(ram_reserve)} fit node {anchor.id}'s "
               f"free {fmt_bytes(_avail(anchor))}: local memory only")
        if policy == "bind" and need > _avail(anchor):
            why = f"bind requested although node {anchor.id} has only {fmt_bytes(_avail(anchor))} free"
    elif policy == "interleave" or sum(_avail(n) for n in socket_nodes) >= need:
        if policy == "auto" and len(socket_nodes) > 1 and sum(_avail(n) for n in socket_nodes) >= need:
            chosen = socket_nodes
            why = (f"{fmt_bytes(need)} exceed node {anchor.id}'s free {fmt_bytes(_avail(anchor))}; socket {pkg}'s "
                   f"nodes {[n.id for n in socket_nodes]} hold it: interleave there")
        else:
            chosen = socket_nodes if sum(_avail(n) for n in socket_nodes) >= need else nodes
            why = (f"interleave over nodes {[n.id for n in chosen]} ({fmt_bytes(sum(_avail(n) for n in chosen))} "
                   f"free for {fmt_bytes(need)})")
        mode = "interleave"
    else:
        chosen, mode = nodes, "interleave"
        why = (f"{fmt_bytes(need)} exceed socket {pkg}'s free memory: interleave over all nodes "
               f"({fmt_bytes(sum(_avail(n) for n in nodes))} free)")
    decisions.append(Decision("numa", mode + (f" nodes {','.join(str(n.id) for n in chosen)}" if mode != "none" else ""),
                              why))
    cpus = _node_cpus(machine, chosen)
    phys = _physical(machine, cpus) or cpus
    if share is not None and share[1] > 1:
        # several replicas on the same CPUs: give each its own slice of whole cores, bound with numactl
        k, n = share
        per = max(1, len(phys) // n)
        mine = phys[k * per:(k + 1) * per] if k < n - 1 else phys[k * per:]
        mine = mine or phys[-1:]
        siblings = {p for c in machine.cores if any(q in mine for q in c.pus) for p in c.pus}
        cpus = sorted(c for c in cpus if c in siblings) or sorted(mine)
        phys = sorted(mine)
        if mode == "none":
            mode = "bind"
            decisions.append(Decision("cpus", f"replica {k + 1}/{n}: CPUs {format_cpulist(cpus)}",
                                      f"{n} replicas share this machine: each gets its own cores (no oversubscription)"))
    use_smt = {"on": True, "off": False}.get(smt, machine.smt)
    t = threads or len(phys)
    tb = threads_batch or (len(cpus) if use_smt else len(phys))
    decisions.append(Decision("threads", f"-t {t} -tb {tb}",
                              f"generation: one thread per physical core of CPUs {format_cpulist(phys)}; "
                              f"batches: {'every hardware thread' if use_smt and machine.smt else 'one per core'}"
                              + (" (set by the topology)" if threads else "")))
    numa_flag = {"bind": "numactl", "interleave": "distribute"}.get(mode, "")
    nodes = tuple(n.id for n in chosen) if mode != "none" else ()
    binding = NumaPolicy(mode, tuple(cpus), nodes, nodes)
    return CpuChoice(binding, numa_flag, t, tb, tuple(decisions), tuple(n.id for n in chosen))
