"""What every step of planning one worker reads, as one frozen value."""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.backend.info import BackendInfo, Flavor
from orchestrator.hardware.topology import Machine
from orchestrator.model.info import ModelInfo
from orchestrator.model.routing_profile import HitCurve
from orchestrator.plan.costs import ModelCosts
from orchestrator.plan.cpu import CpuShare
from orchestrator.plan.buffers import BufferShape
from orchestrator.plan.request import NodeRequest, PlanRequest


@dataclass(frozen=True)
class PlanningContext:
    """One worker's planning inputs: the machine it runs on, the model and what its tensors cost, the request and
    this node's part of it, the llama-server that will run it, the routing curve the expert cache is sized from,
    and what the layout gave the worker (its socket, its share of the cores). ``fa`` is the worker's flash
    attention (``-fa``), decided first since the buffers depend on it."""

    machine: Machine
    model: ModelInfo
    costs: ModelCosts
    req: PlanRequest
    node_req: NodeRequest
    backend: BackendInfo
    curve: HitCurve
    package: int | None = None
    share: CpuShare | None = None
    fa: str = "on"

    @property
    def flavor(self) -> Flavor:
        return self.backend.flavor

    def n_batch(self, ub: int) -> int:
        return n_batch(self.req, ub)

    def buffers(self, ub: int) -> BufferShape:
        """The buffers' shape for micro-batch ``ub``."""
        return buffer_shape(self.req, ub, self.fa, self.flavor)


def n_batch(req: PlanRequest, ub: int) -> int:
    """``-b``: the request's logical batch, never below the micro-batch."""
    return max(req.batch or 2048, ub)


def buffer_shape(req: PlanRequest, ub: int, fa: str, flavor: Flavor) -> BufferShape:
    return BufferShape(n_ctx=req.context, n_parallel=req.parallel, n_ubatch=ub, n_batch=n_batch(req, ub),
                       type_k=req.type_k, type_v=req.type_v, flash_attn=fa != "off", flavor=flavor)
