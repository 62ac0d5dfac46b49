"""What ``up`` started, on disk, so ``status`` and ``down`` (other processes, later) find it.

One JSON file per namespace under ``orchestrator.paths.state_dir()/cluster/``; written to a temporary name and
renamed, so a reader never sees half a file.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from orchestrator.fsutil import write_atomic
from orchestrator.paths import state_dir


@dataclass
class ClusterState:
    namespace: str
    ray_address: str
    embedded: bool                      # True: up started the Ray head below and down stops it
    up_pid: int
    started_at: float
    phase: str = "starting"             # starting | running
    head_pid: int | None = None
    head_create_time: float | None = None
    head_temp_dir: str | None = None
    head_log: str | None = None
    dashboard_url: str | None = None
    metrics_url: str | None = None
    gateway_url: str | None = None
    auth_mode: str | None = None
    foreground: bool = False
    workers: list[dict[str, Any]] = field(default_factory=list)   # name, node, url: for messages only

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict) -> "ClusterState":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def state_path(namespace: str) -> Path:
    return state_dir() / "cluster" / f"{namespace}.json"


def write(st: ClusterState) -> Path:
    path = state_path(st.namespace)
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_atomic(path, st.to_json(), mode=0o600)


def read(namespace: str) -> ClusterState | None:
    try:
        return ClusterState.from_dict(json.loads(state_path(namespace).read_text()))
    except FileNotFoundError:
        return None
    except (ValueError, TypeError):
        return None


def remove(namespace: str) -> None:
    try:
        state_path(namespace).unlink()
    except FileNotFoundError:
        pass


def recorded() -> list[str]:
    d = state_dir() / "cluster"
    return sorted(p.stem for p in d.glob("*.json")) if d.is_dir() else []
