"""Run a plan under Ray: a controller actor, one worker actor per planned llama-server, one OpenAI gateway.

Entry points (Ray is imported only when they run)::

    from orchestrator.cluster import Deployment, RestartPolicy, up, status, down, start_up
    start_up(topology, detach=False)                       # `orchestrator up`, every phase (startup.py)
    up(Deployment(specs=plan_specs, ...), foreground=True)   # a Deployment built by hand, from the head on

See ``docs/cluster.md`` for the picture, ``startup.py`` for `up`'s phases and what undoes each, ``lifecycle.py``
for the deployment's life after that: readiness, serving until stopped, ``status`` and ``down``.
"""

from __future__ import annotations

from typing import Any

from orchestrator.cluster.deployment import LOCAL, Deployment, RestartPolicy

__all__ = ["Deployment", "RestartPolicy", "LOCAL", "up", "down", "status", "start_up"]


def up(deployment: Deployment, foreground: bool = True, **kw: Any):
    from orchestrator.cluster.startup import run_deployment

    return run_deployment(deployment, foreground=foreground, **kw)


def down(namespace: str = "orchestrator", **kw: Any):
    from orchestrator.cluster.lifecycle import down as _down

    return _down(namespace, **kw)


def status(namespace: str = "orchestrator") -> dict:
    from orchestrator.cluster.lifecycle import status as _status

    return _status(namespace)


def start_up(topology: Any, **kw: Any) -> int:
    from orchestrator.cluster.startup import start_up as _start_up

    return _start_up(topology, **kw)
