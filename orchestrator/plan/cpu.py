"""The CPU side of a worker: which NUMA nodes it binds to or interleaves over, and how many threads."""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.hardware import Machine
from orchestrator.plan.types import Decision, NumaPlan
from orchestrator.units import fmt_bytes, format_cpulist


@dataclass(frozen=True)
class CpuChoice:
    numa: NumaPlan
    threads: int
    threads_batch: int
    decisions: tuple[Decision, ...]
    host_nodes: tuple[int, ...]     # nodes whose memory holds the CPU-resident bytes


def _cpu_nodes(machine: Machine) -> list:
    allowed = set(machine.allowed_nodes or [n.id for n in machine.numa_nodes])
    allowed_cpus = set(machine.allowed_cpus or machine.pus)
    return [n for n in machine.numa_nodes if n.id in allowed and set(n.cpus) & allowed_cpus]


def _free(node) -> int:
    return node.free_bytes if node.free_bytes is not None else (node.memory_bytes or 0)


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
               threads: int | None = None, threads_batch: int | None = None) -> CpuChoice:
    """Bind when the CPU-resident bytes fit the anchor node's free memory; else interleave over the anchor's
    socket, else over every node. ``anchor_node`` = the node nearest the main GPU (or the socket's first)."""
    nodes = _cpu_nodes(machine)
    decisions: list[Decision] = []
    if not nodes:  # no NUMA information at all: whole machine, no binding
        cpus = sorted(machine.allowed_cpus or machine.pus)
        phys = _physical(machine, cpus) or cpus
        t = threads or len(phys)
        return CpuChoice(NumaPlan("none", tuple(cpus)), t, threads_batch or len(cpus),
                         (Decision("numa", "none", "no NUMA nodes with CPUs are visible"),), ())
    by_id = {n.id: n for n in nodes}
    if anchor_node not in by_id:
        if package is not None:
            cands = [n for n in nodes if package in n.packages]
            anchor_node = cands[0].id if cands else nodes[0].id
        else:
            anchor_node = max(nodes, key=_free).id
    anchor = by_id[anchor_node]
    pkg = package if package is not None else (anchor.packages[0] if anchor.packages else None)
    socket_nodes = [n for n in nodes if pkg is not None and pkg in n.packages] or [anchor]
    need = host_bytes + ram_reserve

    if len(machine.numa_nodes) <= 1 or len(nodes) == 1 and policy == "auto":
        chosen, mode = [anchor], "none"
        why = "one NUMA node: nothing to bind or interleave"
    elif policy == "none":
        chosen, mode, why = nodes, "none", "numa: none requested"
    elif policy == "bind" or (policy == "auto" and need <= _free(anchor)):
        chosen, mode = [anchor], "bind"
        why = (f"CPU-resident {fmt_bytes(host_bytes)} + reserve {fmt_bytes(ram_reserve)} fit node {anchor.id}'s "
               f"free {fmt_bytes(_free(anchor))}: local memory only")
        if policy == "bind" and need > _free(anchor):
            why = f"bind requested although node {anchor.id} has only {fmt_bytes(_free(anchor))} free"
    elif policy == "interleave" or sum(_free(n) for n in socket_nodes) >= need:
        if policy == "auto" and len(socket_nodes) > 1 and sum(_free(n) for n in socket_nodes) >= need:
            chosen = socket_nodes
            why = (f"{fmt_bytes(need)} exceed node {anchor.id}'s free {fmt_bytes(_free(anchor))}; socket {pkg}'s "
                   f"nodes {[n.id for n in socket_nodes]} hold it: interleave there")
        else:
            chosen = socket_nodes if sum(_free(n) for n in socket_nodes) >= need else nodes
            why = (f"interleave over nodes {[n.id for n in chosen]} ({fmt_bytes(sum(_free(n) for n in chosen))} "
                   f"free for {fmt_bytes(need)})")
        mode = "interleave"
    else:
        chosen, mode = nodes, "interleave"
        why = (f"{fmt_bytes(need)} exceed socket {pkg}'s free memory: interleave over all nodes "
               f"({fmt_bytes(sum(_free(n) for n in nodes))} free)")
    decisions.append(Decision("numa", mode + (f" nodes {','.join(str(n.id) for n in chosen)}" if mode != "none" else ""),
                              why))
    cpus = _node_cpus(machine, chosen if mode != "none" or len(machine.numa_nodes) <= 1 else chosen)
    phys = _physical(machine, cpus) or cpus
    use_smt = {"on": True, "off": False}.get(smt, machine.smt)
    t = threads or len(phys)
    tb = threads_batch or (len(cpus) if use_smt else len(phys))
    decisions.append(Decision("threads", f"-t {t} -tb {tb}",
                              f"generation: one thread per physical core of CPUs {format_cpulist(phys)}; "
                              f"batches: {'every hardware thread' if use_smt and machine.smt else 'one per core'}"
                              + (" (set by the topology)" if threads else "")))
    numa_flag = {"bind": "numactl", "interleave": "distribute"}.get(mode, "")
    plan = NumaPlan(mode=mode, cpus=tuple(cpus), cpu_nodes=tuple(n.id for n in chosen) if mode != "none" else (),
                    mem_nodes=tuple(n.id for n in chosen) if mode != "none" else (),
                    physical_only=False, numa_flag=numa_flag)
    return CpuChoice(plan, t, tb, tuple(decisions), tuple(n.id for n in chosen))
