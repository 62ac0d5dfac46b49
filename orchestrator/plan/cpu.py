"""The CPU side of a worker: which NUMA nodes it binds to or interleaves over, and how many threads."""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.hardware.topology import Machine
from orchestrator.launch.numa import NumaPolicy
from orchestrator.plan.types import Decision
from orchestrator.units import fmt_bytes, format_cpulist

# Why the plan never passes llama.cpp's --numa: with any of its strategies on a machine with more than one node,
# the CPU backend sets its worker threads' affinity itself (distribute: thread i on node i mod n, over every node
# of the machine) and, after each compute, resets the main thread's to every CPU ("numactl": the binding numactl
# gave, then all CPUs). Either way the CPUs the plan binds are not the CPUs the kernel shows. Without the flag
# llama.cpp leaves affinity alone and every thread inherits numactl's binding.
NO_NUMA_FLAG_WHY = ("not passed: with --numa, llama.cpp resets its main thread's CPU affinity to every CPU after "
                    "each compute (and distribute pins threads over all nodes), so numactl's binding would leak")


@dataclass(frozen=True)
class CpuChoice:
    numa: NumaPolicy
    numa_flag: str                  # llama.cpp's --numa for that policy ("" = not passed)
    threads: int
    threads_batch: int
    decisions: tuple[Decision, ...]
    host_nodes: tuple[int, ...]     # nodes whose memory holds the CPU-resident bytes


@dataclass(frozen=True)
class CpuShare:
    """The part of a machine one worker gets when it is not alone there (replicas, one worker per socket or per
    node): the NUMA nodes whose memory and cores are its own, and the CPUs its threads run on.

    ``shared``: there are fewer cores than workers, so some of ``cpus`` are also another worker's.
    ``why`` says how the machine was divided, for the plan's reason lines."""

    index: int                      # this worker, 0-based
    count: int                      # workers dividing the machine
    nodes: tuple[int, ...]          # NUMA nodes it owns (memory and CPUs); () = the machine shows none
    cpus: tuple[int, ...]           # CPUs its threads run on (every allowed hardware thread of its cores)
    shared: bool = False
    why: str = ""


def _cpu_nodes(machine: Machine) -> list:
    allowed = set(machine.allowed_nodes or [n.id for n in machine.numa_nodes])
    allowed_cpus = set(machine.allowed_cpus or machine.pus)
    return [n for n in machine.numa_nodes if n.id in allowed and set(n.cpus) & allowed_cpus]


def cpu_nodes(machine: Machine) -> list:
    """The NUMA nodes a worker can run on: allowed, with allowed CPUs (memory-only nodes left out)."""
    return _cpu_nodes(machine)


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


@dataclass(frozen=True)
class CpuWants:
    """What the topology asks of the CPU side (``workers.numa``, ``smt``, ``threads``, ``threads_batch``)."""

    policy: str = "auto"
    smt: str = "auto"
    threads: int | None = None
    threads_batch: int | None = None


def choose_cpu(machine: Machine, *, host_bytes: int, ram_reserve: int, anchor_node: int | None,
               package: int | None = None, share: CpuShare | None = None,
               wants: CpuWants = CpuWants()) -> CpuChoice:
    """Bind when the CPU-resident bytes fit the anchor node's free memory; else interleave over the anchor's
    socket, else over every node. ``anchor_node`` = the node nearest the main GPU (or the socket's first).

    With a ``share`` (the worker is not alone on the machine) the worker stays on the share's nodes and CPUs:
    bound to its node, or interleaved over its nodes when it has several, and over every node only when its own
    cannot hold it."""
    policy, smt, threads, threads_batch = wants.policy, wants.smt, wants.threads, wants.threads_batch
    if share is not None:
        return _choose_shared(machine, host_bytes=host_bytes, ram_reserve=ram_reserve, policy=policy, smt=smt,
                              threads=threads, threads_batch=threads_batch, share=share)
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
    decisions.append(_numa_decision(mode, chosen, why))
    cpus = _node_cpus(machine, chosen)
    return _finish(machine, mode, cpus, [n.id for n in chosen], decisions, smt=smt, threads=threads,
                   threads_batch=threads_batch)


def _numa_decision(mode: str, chosen, why: str) -> Decision:
    ids = ",".join(str(n.id) for n in chosen)
    return Decision("numa", mode + (f" nodes {ids}" if mode != "none" else ""), why)


def _finish(machine: Machine, mode: str, cpus: list[int], node_ids: list[int], decisions: list[Decision], *,
            smt: str, threads: int | None, threads_batch: int | None) -> CpuChoice:
    """Threads for ``cpus`` and the policy: the last steps common to a worker alone and a worker sharing."""
    phys = _physical(machine, cpus) or cpus
    use_smt = {"on": True, "off": False}.get(smt, machine.smt)
    t = threads or len(phys)
    tb = threads_batch or (len(cpus) if use_smt else len(phys))
    decisions.append(Decision("threads", f"-t {t} -tb {tb}",
                              f"generation: one thread per physical core of CPUs {format_cpulist(phys)}; "
                              f"batches: {'every hardware thread' if use_smt and machine.smt else 'one per core'}"
                              + (" (set by the topology)" if threads else "")))
    if mode != "none" and len(machine.numa_nodes) > 1:
        decisions.append(Decision("llama.cpp --numa", "not passed", NO_NUMA_FLAG_WHY))
    mem = tuple(node_ids) if mode != "none" else ()
    binding = NumaPolicy(mode, tuple(cpus), mem, mem)
    return CpuChoice(binding, "", t, tb, tuple(decisions), tuple(node_ids))


def _choose_shared(machine: Machine, *, host_bytes: int, ram_reserve: int, policy: str, smt: str,
                   threads: int | None, threads_batch: int | None, share: CpuShare) -> CpuChoice:
    nodes = _cpu_nodes(machine)
    by_id = {n.id: n for n in nodes}
    own = [by_id[i] for i in share.nodes if i in by_id]
    cpus = sorted(share.cpus)
    k, n = share.index, share.count
    where = (f"node {own[0].id}" if len(own) == 1 else f"nodes {format_cpulist(x.id for x in own)}") if own else ""
    decisions = [Decision("cpus", f"worker {k + 1}/{n}: CPUs {format_cpulist(cpus)}" + (f" ({where})" if where
                                                                                         else ""), share.why)]
    need = host_bytes + ram_reserve

    def _avail(ns) -> int:
        return sum(node_available(machine, x) for x in ns)

    if not own:   # the machine shows no NUMA node: nothing to bind memory to, and numactl needs one
        decisions.append(Decision("numa", "none", "no NUMA nodes with CPUs are visible: threads counted on "
                                                  f"CPUs {format_cpulist(cpus)}, not bound"))
        return _finish(machine, "none", cpus, [], decisions, smt=smt, threads=threads, threads_batch=threads_batch)
    if policy == "none":
        decisions.append(Decision("numa", "none", f"numa: none requested: no numactl; the threads are counted on "
                                                  f"CPUs {format_cpulist(cpus)} but nothing binds them"))
        return _finish(machine, "none", cpus, [x.id for x in own], decisions, smt=smt, threads=threads,
                       threads_batch=threads_batch)
    if len(machine.numa_nodes) <= 1:
        mode, chosen = "bind", own
        why = "one NUMA node: bound to this worker's cores so that workers do not share them"
    elif policy == "bind" or (policy == "auto" and len(own) == 1 and need <= _avail(own)):
        mode, chosen = "bind", own
        why = (f"CPU-resident {fmt_bytes(host_bytes)} + reserve {fmt_bytes(ram_reserve)} fit {where}'s free "
               f"{fmt_bytes(_avail(own))}: its own memory only")
        if need > _avail(own):
            why = f"bind requested although {where} has only {fmt_bytes(_avail(own))} free"
    elif need <= _avail(own):
        mode, chosen = "interleave", own
        why = (f"memory interleaved page by page over its {len(own)} nodes, so that each node's memory channels "
               f"serve its threads ({fmt_bytes(_avail(own))} free for {fmt_bytes(need)})")
    else:
        pkgs = {p for x in own for p in x.packages}
        socket = [x for x in nodes if set(x.packages) & pkgs]
        chosen = socket if len(socket) > len(own) and need <= _avail(socket) else nodes
        mode = "interleave"
        over = f"its socket's nodes {format_cpulist(x.id for x in chosen)}" if chosen is socket else "every node"
        why = (f"{fmt_bytes(need)} exceed {where}'s free {fmt_bytes(_avail(own))}: memory interleaved over {over} "
               f"({fmt_bytes(_avail(chosen))} free); the threads stay on its own CPUs")
    decisions.append(_numa_decision(mode, chosen, why))
    return _finish(machine, mode, cpus, [x.id for x in chosen], decisions, smt=smt, threads=threads,
                   threads_batch=threads_batch)
