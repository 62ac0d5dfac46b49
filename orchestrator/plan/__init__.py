"""Planning: pure decisions from (machines, model, request, backend) to a Plan. No processes, files or network.

import-linter contracts in pyproject.toml (run by tests/test_architecture.py) keep processes, Ray, the network
and archives out of this package, transitively.
"""

from orchestrator.plan.request import NodeRequest, PlanRequest
from orchestrator.plan.types import Decision, DeviceMemory, LayerRange, Plan, Prediction, WorkerPlan

__all__ = ["NodeRequest", "PlanRequest", "Decision", "DeviceMemory", "LayerRange", "Plan", "Prediction",
           "WorkerPlan", "make_plan"]


def make_plan(**kw):
    from orchestrator.plan.planner import make_plan as _mp

    return _mp(**kw)
