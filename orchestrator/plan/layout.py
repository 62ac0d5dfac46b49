"""How the workers of one machine divide it: which GPUs, which socket and which share of its CPUs each gets."""

from __future__ import annotations

from typing import NamedTuple

from orchestrator.errors import PlanError
from orchestrator.hardware.topology import Machine
from orchestrator.plan.costs import ModelCosts
from orchestrator.plan import rates as R
from orchestrator.plan.cpu import CpuShare, cpu_nodes, node_available
from orchestrator.plan.request import NodeRequest, PlanRequest
from orchestrator.plan.types import Decision
from orchestrator.units import fmt_bytes, format_cpulist


class WorkerSlot(NamedTuple):
    """One worker's part of a machine."""

    gpus: tuple[int, ...]                 # GPU indexes it pools
    package: int | None                   # the socket it lives on (None: not tied to one)
    share: CpuShare | None                # its own nodes and CPUs when others share the machine (None: alone)


# -- memory bandwidth, as the layout compares it ---------------------------------------------------------------

def _local_bw(machine: Machine, node: int) -> tuple[float, bool]:
    """Read bandwidth of ``node``'s threads from its own memory: measured by the probe, else the default."""
    host = dict(machine.bandwidth.host) if machine.bandwidth is not None else {}
    if host.get((node, node)):
        return float(host[(node, node)]), True
    per, _ = R.host_memory_bandwidth_default(len(machine.numa_nodes))
    return per, False


def _pair_bw(machine: Machine, cpu_node: int, mem_node: int) -> tuple[float, bool]:
    """Threads on ``cpu_node`` reading ``mem_node``'s memory: measured, else the local figure scaled by the
    firmware's relative distance (SLIT: 10 = local), else half the local figure."""
    host = dict(machine.bandwidth.host) if machine.bandwidth is not None else {}
    if host.get((cpu_node, mem_node)):
        return float(host[(cpu_node, mem_node)]), True
    local, measured = _local_bw(machine, cpu_node)
    if cpu_node == mem_node:
        return local, measured
    dist = next((n.distance_to(mem_node) for n in machine.numa_nodes if n.id == cpu_node), None)
    return (local * 10.0 / dist if dist and dist > 10 else local * 0.5), False


def _interleaved_bw(machine: Machine, group: list[int]) -> tuple[float, bool]:
    """Bandwidth of one worker whose threads run on every node of ``group`` and whose memory is interleaved
    page by page over them: each node's threads read an equal part from every node of the group, so they
    stream at the harmonic mean of those pairs; the nodes' rates add up."""
    total, measured = 0.0, True
    for i in group:
        pairs = [_pair_bw(machine, i, j) for j in group]
        measured = measured and all(m for _, m in pairs)
        total += len(pairs) / sum(1.0 / bw for bw, _ in pairs)
    return total, measured


def _gb(x: float) -> str:
    return f"{x / 1e9:.0f} GB/s"


# -- dividing a machine's CPUs ---------------------------------------------------------------------------------

def _node_cores(machine: Machine, node_id: int | None) -> list[tuple[int, ...]]:
    """The allowed hardware threads of each core of a node (of the machine when ``node_id`` is None)."""
    allowed = set(machine.allowed_cpus or machine.pus)
    out = []
    for c in machine.cores:
        if node_id is not None and c.node != node_id:
            continue
        pus = tuple(p for p in c.pus if p in allowed)
        if pus:
            out.append(pus)
    if node_id is None and not out:
        out = [(p,) for p in sorted(allowed)]
    return out


def _chunks(count: int, parts: int) -> list[tuple[int, int]]:
    """``count`` items cut into ``parts`` contiguous runs as equal as possible: [(start, stop)]."""
    out, start = [], 0
    for k in range(parts):
        size = count // parts + (1 if k < count % parts else 0)
        out.append((start, start + size))
        start += size
    return out


def _sorted_nodes(machine: Machine) -> list:
    """CPU nodes in socket order, so that contiguous runs of nodes keep a socket's nodes together."""
    return sorted(cpu_nodes(machine), key=lambda n: (min(n.packages) if n.packages else 0, n.id))


def spread(machine: Machine, n: int) -> list[CpuShare]:
    """``n`` workers (replicas) over one machine without overlap: with no more workers than NUMA nodes each gets
    whole nodes (a contiguous run in socket order: a socket's nodes stay together), its cores and its memory;
    with more, each node gets workers in proportion to its cores and its cores are split between them; with
    fewer cores than workers, workers share cores and the reason says so."""
    nodes = _sorted_nodes(machine)
    domains: list[tuple[tuple[int, ...], list[tuple[int, ...]]]] = (
        [((x.id,), _node_cores(machine, x.id)) for x in nodes] if nodes else [((), _node_cores(machine, None))])
    domains = [d for d in domains if d[1]]
    n_cores = sum(len(cores) for _, cores in domains)
    shares: list[CpuShare] = []
    if n <= len(domains):
        why = (f"{n} workers, {len(domains)} NUMA nodes: each gets whole nodes, their cores and their memory "
               f"(nothing shared)")
        for k, (lo, hi) in enumerate(_chunks(len(domains), n)):
            ids = tuple(i for d in domains[lo:hi] for i in d[0])
            cpus = tuple(p for d in domains[lo:hi] for core in d[1] for p in core)
            shares.append(CpuShare(k, n, ids, tuple(sorted(cpus)), False, why))
        return shares
    # more workers than nodes: each node at least one, the rest to the node with the most cores per worker
    counts = [1] * len(domains)
    for _ in range(n - len(domains)):
        best = max(range(len(domains)), key=lambda i: (len(domains[i][1]) / counts[i], -i))
        counts[best] += 1
    if n_cores >= n:
        why = (f"{n} workers, {len(domains)} NUMA node{'s' if len(domains) > 1 else ''}, {n_cores} cores: each "
               f"gets its own cores (no oversubscription); workers on one node share its memory")
    else:
        why = (f"{n} workers but {n_cores} cores: workers share cores (oversubscribed: each runs slower than "
               f"alone)")
    k = 0
    for (ids, cores), c in zip(domains, counts):
        if len(cores) >= c:
            for lo, hi in _chunks(len(cores), c):
                cpus = tuple(sorted(p for core in cores[lo:hi] for p in core))
                shares.append(CpuShare(k, n, ids, cpus, False, why))
                k += 1
        else:
            for j in range(c):
                shares.append(CpuShare(k, n, ids, tuple(sorted(cores[j % len(cores)])), True, why))
                k += 1
    return shares


def _group_shares(machine: Machine, groups: list[list[int]], why: str) -> list[CpuShare]:
    allowed = set(machine.allowed_cpus or machine.pus)
    out = []
    for k, ids in enumerate(groups):
        cpus = sorted({p for i in ids for core in _node_cores(machine, i) for p in core} & allowed)
        out.append(CpuShare(k, len(groups), tuple(ids), tuple(cpus), False, why))
    return out


def _split_crowded_nodes(machine: Machine, slots: list[WorkerSlot]) -> list[WorkerSlot]:
    """GPU workers whose GPUs hang off the same NUMA node would each bind to all of that node's CPUs: split
    its cores between them instead (its memory they share)."""
    by_node: dict[int, list[int]] = {}
    for i, slot in enumerate(slots):
        if slot.share is None and slot.gpus:
            node = machine.nearest_cpu_node(machine.gpu(slot.gpus[0]))
            if node is not None:
                by_node.setdefault(node, []).append(i)
    out = list(slots)
    for node, idxs in by_node.items():
        if len(idxs) < 2:
            continue
        cores, c = _node_cores(machine, node), len(idxs)
        if not cores:
            continue
        if len(cores) >= c:
            cpus = [tuple(sorted(p for core in cores[lo:hi] for p in core)) for lo, hi in _chunks(len(cores), c)]
            why = (f"{c} GPU workers nearest node {node}: its {len(cores)} cores split between them (no "
                   f"oversubscription); they share its memory")
        else:
            cpus = [tuple(sorted(cores[j % len(cores)])) for j in range(c)]
            why = f"{c} GPU workers nearest node {node} but {len(cores)} cores: workers share cores"
        for j, i in enumerate(idxs):
            out[i] = out[i]._replace(share=CpuShare(j, c, (node,), cpus[j], len(cores) < c, why))
    return out


def _package_of(machine: Machine, share: CpuShare | None) -> int | None:
    """The socket a share lies in, when it lies in one."""
    if share is None:
        return None
    pkgs = {c.package for c in machine.cores if set(c.pus) & set(share.cpus)}
    return pkgs.pop() if len(pkgs) == 1 else None


def _auto_cpu_layout(machine: Machine, costs: ModelCosts, kv_total: int, node_req: NodeRequest
                     ) -> tuple[str, list[list[int]] | None, str]:
    """CPU only: one worker per NUMA node, one per socket over its nodes, or one for the machine, whichever
    gives the machine the most memory bandwidth for generation (the bytes per token are the same for each; a
    CPU worker streams its weights, so its rate follows its bandwidth) among those whose workers fit."""
    nodes = _sorted_nodes(machine)
    packages = sorted(machine.packages, key=lambda p: p.id)
    need = costs.total_bytes + kv_total + node_req.ram_reserve
    if len(nodes) <= 1:
        if len(packages) > 1:
            return "machine", None, (f"CPU only, {len(packages)} sockets but one NUMA node: one worker (nothing "
                                     f"to keep local)")
        return "machine", None, "one socket: one worker"
    per_node = [[x.id] for x in nodes]
    per_socket = [ids for ids in ([x.id for x in nodes if p.id in x.packages] for p in packages) if ids]
    # a node in two sockets' lists (one node spanning sockets) makes the socket split overlap: not offered
    flat = [i for g in per_socket for i in g]
    sockets_ok = bool(per_socket) and len(flat) == len(set(flat))
    options: list[tuple[str, list[list[int]], float, bool]] = []

    def fits(groups):
        return all(sum(node_available(machine, machine.node(i)) for i in g) >= need for g in groups)

    def option(name, groups):
        rates = [_interleaved_bw(machine, g) for g in groups]
        options.append((name, groups, sum(r for r, _ in rates), all(m for _, m in rates)))

    rejected = []

    def too_small(groups, what):
        g = min(groups, key=lambda g: sum(node_available(machine, machine.node(i)) for i in g))
        free = sum(node_available(machine, machine.node(i)) for i in g)
        rejected.append(f"one per {what} does not fit ({what} {format_cpulist(g)} has {fmt_bytes(free)} free)")

    if fits(per_node):
        option("node", per_node)
    else:
        too_small(per_node, "node")
    if sockets_ok and per_socket != per_node:
        if fits(per_socket):
            option("socket", per_socket)
        else:
            too_small(per_socket, "socket's nodes")
    if not options:
        return "machine", None, (f"CPU only; the model ({fmt_bytes(need)} with KV cache and reserve) fits no "
                                 f"single NUMA node or socket: one worker over the machine")
    # most bandwidth first; on a tie fewer workers (each request runs faster, fewer copies of the weights)
    options.sort(key=lambda o: (-round(o[2] / 1e9, 1), len(o[1])))
    name, groups, rate, measured = options[0]
    label = "socket" if name == "socket" or per_socket == per_node and sockets_ok else "node"
    src = "measured by the probe" if measured else "estimated: probe defaults, SLIT distances for remote reads"
    what = {"node": "one replica per NUMA node, bound to its cores and memory",
            "socket": "one replica per socket over its nodes (memory interleaved)"}
    n_pkgs = len({p for x in nodes for p in x.packages}) or 1
    why = (f"CPU only, {len(nodes)} NUMA nodes on {n_pkgs} socket{'s' if n_pkgs > 1 else ''}, each "
           f"{'node' if name == 'node' else 'socket'} with room for the model ({fmt_bytes(need)}): "
           f"{what[name]}: {_gb(rate)} of memory bandwidth in all")
    for other, ogroups, orate, _ in options[1:]:
        why += f", vs {_gb(orate)} for {what[other]} ({len(ogroups)} workers)"
    why += f" ({src})"
    if rejected:
        why += "; " + "; ".join(rejected)
    if name == "node" and len(options) > 1:
        why += "; a single request runs at one node's speed"
    return label, groups, why


def worker_layout(machine: Machine, costs: ModelCosts, req: PlanRequest, gpus: tuple[int, ...], kv_total: int,
                  node_req: NodeRequest) -> tuple[list[WorkerSlot], Decision]:
    """One :class:`WorkerSlot` per worker on one machine, and why the layout is what it is."""
    packages = sorted(machine.packages, key=lambda p: p.id)
    layout = req.layout
    groups: list[list[int]] | None = None
    if layout == "auto":
        if gpus:
            layout = "machine"
            why = "GPUs present: one worker pools every selected GPU's memory (fewest CPU-resident experts)"
        else:
            layout, groups, why = _auto_cpu_layout(machine, costs, kv_total, node_req)
    else:
        why = "set by the topology"
    if layout == "machine":
        n = req.replicas or 1
        if n > 1 and gpus:
            raise PlanError(f"workers.replicas: {n} replicas of a GPU worker would share GPUs {list(gpus)}: use "
                            f"layout gpu-group (one worker per group of GPUs) or one replica per machine")
        shares = spread(machine, n) if n > 1 else [None]
        slots = [WorkerSlot(gpus, _package_of(machine, sh), sh) for sh in shares]
        return slots, Decision("layout", f"machine x{n}", why)
    if layout in ("socket", "node") and groups is not None:
        slots = [WorkerSlot((), _package_of(machine, sh), sh) for sh in _group_shares(machine, groups, why)]
        return slots, Decision("layout", f"{layout} x{len(slots)}", why)
    if layout == "socket":
        out = []
        socket_groups = [[x.id for x in _sorted_nodes(machine) if p.id in x.packages] for p in packages]
        for p, ids in zip(packages, socket_groups):
            node_ids = set(p.nodes)
            pg = tuple(g.index for g in machine.gpus if g.index in gpus and machine.nearest_cpu_node(g) in node_ids)
            share = None
            if not pg and ids:   # a CPU worker keeps to its socket's nodes and cores
                allowed = set(machine.allowed_cpus or machine.pus)
                cpus = tuple(sorted(c for c in p.cpus if c in allowed))
                shared = len(socket_groups) > 1 and any(set(ids) & set(o) for o in socket_groups if o is not ids)
                why = f"one worker per socket: socket {p.id}'s cores" + (
                    f" (its node{'s' if len(ids) > 1 else ''} {format_cpulist(ids)} shared with another socket: "
                    f"memory shared)" if shared else " and memory")
                share = CpuShare(len(out), len(packages), tuple(ids), cpus, False, why)
            out.append(WorkerSlot(pg, p.id, share))
        return out, Decision("layout", f"socket x{len(out)}", why)
    if layout == "gpu-group" and req.gpu_group_size:
        size = req.gpu_group_size
        if not gpus:
            raise PlanError("workers.layout: 'gpu-group' needs GPUs, and none are selected")
        if len(gpus) % size:
            raise PlanError(f"workers.gpu_group_size: {size} does not divide the {len(gpus)} selected GPUs "
                            f"{list(gpus)}: choose a divisor, or leave it out for one group per socket")
        out = []
        for k in range(0, len(gpus), size):
            grp = tuple(gpus[k:k + size])
            node = machine.nearest_cpu_node(next(g for g in machine.gpus if g.index == grp[0]))
            pkg = next((p.id for p in packages if node in p.nodes), None)
            out.append(WorkerSlot(grp, pkg, None))
        out = _split_crowded_nodes(machine, out)
        return out, Decision("layout", f"gpu-group x{len(out)}", why + f" ({size} GPUs per worker)")
    if layout == "gpu-group":
        groups: dict[int | None, list[int]] = {}
        for g in machine.gpus:
            if g.index not in gpus:
                continue
            node = machine.nearest_cpu_node(g)
            pkg = next((p.id for p in packages if node in p.nodes), None)
            groups.setdefault(pkg, []).append(g.index)
        if not groups:
            raise PlanError("workers.layout: 'gpu-group' needs GPUs, and none are selected")
        out = [WorkerSlot(tuple(v), k, None)
               for k, v in sorted(groups.items(), key=lambda kv: (kv[0] is None, kv[0] or 0))]
        return out, Decision("layout", f"gpu-group x{len(out)}", why + " (one worker per socket's GPUs)")
    raise PlanError(f"workers.layout: unknown layout {layout!r} (expected auto, machine, socket or gpu-group)")
