"""How the workers of one machine divide it: which GPUs, which socket and which share of its CPUs each gets."""

from __future__ import annotations

from typing import NamedTuple

from orchestrator.errors import PlanError
from orchestrator.hardware.topology import Machine
from orchestrator.plan.costs import ModelCosts
from orchestrator.plan.cpu import node_available
from orchestrator.plan.request import NodeRequest, PlanRequest
from orchestrator.plan.types import Decision
from orchestrator.units import fmt_bytes


class WorkerSlot(NamedTuple):
    """One worker's part of a machine."""

    gpus: tuple[int, ...]                 # GPU indexes it pools
    package: int | None                   # the socket it lives on (None: not tied to one)
    share: tuple[int, int] | None         # replica k of n sharing the same CPUs (None: alone on them)


def worker_layout(machine: Machine, costs: ModelCosts, req: PlanRequest, gpus: tuple[int, ...], kv_total: int,
                  node_req: NodeRequest) -> tuple[list[WorkerSlot], Decision]:
    """One :class:`WorkerSlot` per worker on one machine, and why the layout is what it is."""
    packages = sorted(machine.packages, key=lambda p: p.id)
    layout = req.layout
    if layout == "auto":
        if gpus:
            layout = "machine"
            why = "GPUs present: one worker pools every selected GPU's memory (fewest CPU-resident experts)"
        elif len(packages) > 1:
            per_socket_free = []
            for p in packages:
                per_socket_free.append(sum(node_available(machine, n) for n in machine.numa_nodes
                                           if p.id in n.packages))
            need = costs.total_bytes + kv_total + node_req.ram_reserve // len(packages)
            if all(f >= need for f in per_socket_free):
                layout = "socket"
                why = (f"CPU only, {len(packages)} sockets each with room for the model ({fmt_bytes(need)}): one "
                       f"replica per socket, all memory local")
            else:
                layout = "machine"
                why = (f"CPU only; the model ({fmt_bytes(need)}) does not fit one socket's memory: one worker over "
                       f"all sockets")
        else:
            layout = "machine"
            why = "one socket: one worker"
    else:
        why = "set by the topology"
    if layout == "machine":
        n = req.replicas or 1
        if n > 1 and gpus:
            raise PlanError(f"workers.replicas: {n} replicas of a GPU worker would share GPUs {list(gpus)}: use "
                            f"layout gpu-group (one worker per group of GPUs) or one replica per machine")
        slots = [WorkerSlot(gpus, None, (k, n) if n > 1 else None) for k in range(n)]
        return slots, Decision("layout", f"machine x{n}", why)
    if layout == "socket":
        out = []
        for p in packages:
            node_ids = set(p.nodes)
            pg = tuple(g.index for g in machine.gpus if g.index in gpus and machine.nearest_cpu_node(g) in node_ids)
            out.append(WorkerSlot(pg, p.id, None))
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
