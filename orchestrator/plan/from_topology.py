"""Topology (validated topology.yaml) -> PlanRequest: the user's explicit wishes; "auto" stays the planner's call."""

from __future__ import annotations

from pathlib import Path

from orchestrator.config import Topology
from orchestrator.plan.request import DEFAULT_CONTEXT, DEFAULT_VRAM_RESERVE, OFFLOAD_NEVER, NodeRequest, PlanRequest

AUTO = "auto"


def _auto(v, default=None):
    return default if v in (AUTO, None) else v


def request_from_topology(topo: Topology) -> PlanRequest:
    """The request of a topology; what it leaves "auto" stays None (the plan decides, with the defaults of
    plan/request.py, where a request built in code gets them too)."""
    m, w = topo.model, topo.workers
    nodes = []
    for n in topo.nodes:
        gpus = n.gpus
        if gpus == "all":
            sel = None
        elif gpus == "none":
            sel = ()
        else:
            sel = tuple(gpus)
        limit = n.vram_limit
        if limit in (AUTO, None):
            vram_limit = None
        elif isinstance(limit, (list, tuple)):
            order = list(sel) if sel else list(range(len(limit)))
            vram_limit = {g: int(v) for g, v in zip(order, limit)}
        else:
            vram_limit = int(limit)
        nodes.append(NodeRequest(
            name=n.name, address=n.address, gpus=sel, vram_limit=vram_limit,
            vram_reserve=int(_auto(n.vram_reserve, DEFAULT_VRAM_RESERVE)),
            ram_reserve=None if n.ram_reserve in (AUTO, None) else int(n.ram_reserve),
        ))
    ctk = _auto(m.cache_type_k, "f16")
    ctv = _auto(m.cache_type_v, ctk)
    alias = m.alias or Path(str(m.path)).name.removesuffix(".gguf")
    op = w.op_offload_min_batch
    op_val = None if op in (AUTO, None) else (OFFLOAD_NEVER if op == "off" else int(op))
    dnb = w.disable_numa_balancing
    ec = w.expert_cache
    cache = None if ec in (AUTO, None) else (0 if ec == "off" else int(ec))
    return PlanRequest(
        context=int(_auto(m.context, DEFAULT_CONTEXT)), parallel=int(_auto(m.parallel, 1)),
        type_k=ctk, type_v=ctv, kv_auto=m.cache_type_k in (AUTO, None) and m.cache_type_v in (AUTO, None),
        gpu_group_size=_auto(w.gpu_group_size), flash_attn=_auto(m.flash_attn, "auto"), alias=alias,
        flavor=_auto(topo.backend.flavor), nodes=tuple(nodes), layout=w.layout, replicas=_auto(w.replicas),
        numa=w.numa, smt=w.smt, threads=_auto(w.threads), threads_batch=_auto(w.threads_batch),
        disable_numa_balancing=True if dnb in (AUTO, None) else bool(dnb),
        op_offload_min_batch=op_val, batch=_auto(w.batch), ubatch=_auto(w.ubatch), split_mode=w.split_mode,
        load_mode=w.load_mode, extra_args=tuple(w.extra_args), host=w.host or "127.0.0.1", port_base=w.port_base,
        objective=w.objective, expert_cache_bytes=cache, expert_cache_misses=w.expert_cache_misses,
        expert_cache_prefetch=w.expert_cache_prefetch, expert_cache_slots=w.expert_cache_slots,
        expert_cache_staging=w.expert_cache_staging,
    )
