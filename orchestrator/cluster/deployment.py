"""What ``up`` deploys: the planned workers plus where the gateway, Ray and the dashboard live.

Pure frozen dataclasses. The planner (``orchestrator/plan``) produces the :class:`LaunchSpec` list; the CLI glue
builds a :class:`Deployment` from it and the topology and hands it to :func:`orchestrator.cluster.up`.
Times are seconds, ports are ints, nothing here touches the machine.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from orchestrator.errors import ConfigError
from orchestrator.launch.spec import LaunchSpec

LOCAL = "local"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")


def gateway_processes(value: int | str | None) -> int:
    """``gateway.processes``: a number as given; auto = 1.

    One event loop streams several thousand chunks a second (about 200 µs of CPU each, measured on the H200), more
    than a GPU replica produces. Extra processes were measured to add latency there: four added 9.9 ms to the
    first token at 16 streams, one 1.9-2.0 ms (docs/benchmarks.md). Set a number for many fast replicas."""
    if value not in (None, "auto"):
        return int(value)
    return 1


@dataclass(frozen=True)
class RestartPolicy:
    """How a worker's llama-server is watched and restarted.

    A worker that exits, or whose ``/health`` fails for ``health_timeout_s`` (hung), is stopped and restarted after
    a backoff of ``backoff_initial_s * 2**k`` (capped at ``backoff_max_s``). After ``max_restarts`` consecutive
    failed runs (a run that stays healthy for ``stable_s`` resets the count) the worker gives up and ``status``
    shows why. A worker that fails before it was ever healthy fails at once when ``fail_fast`` (the default):
    a missing model or an out-of-memory load does not fix itself, and ``up`` reports the cause.
    """

    max_restarts: int = 5
    backoff_initial_s: float = 1.0
    backoff_max_s: float = 30.0
    health_timeout_s: float = 30.0      # /health failing this long on a running server = hung
    load_timeout_s: float = 900.0       # from spawn to the first healthy /health
    stable_s: float = 60.0              # healthy this long resets the consecutive-failure count
    health_interval_s: float = 1.0      # how often a ready server's /health is probed
    probe_timeout_s: float = 5.0        # one /health request
    stop_timeout_s: float = 10.0        # TERM, then KILL after this long
    port_wait_s: float = 90.0           # a restart waits this long for the port (left in FIN-WAIT by clients)
    fail_fast: bool = True              # a worker that never became healthy is not restarted

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ConfigError(f"restart.max_restarts: must be >= 0, got {self.max_restarts}")
        for name in ("backoff_initial_s", "backoff_max_s", "health_timeout_s", "load_timeout_s",
                     "health_interval_s", "probe_timeout_s", "stop_timeout_s", "port_wait_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"restart.{name}: must be > 0 seconds, got {getattr(self, name)}")
        if self.backoff_max_s < self.backoff_initial_s:
            raise ConfigError(f"restart.backoff_max_s ({self.backoff_max_s}) must be >= restart.backoff_initial_s "
                              f"({self.backoff_initial_s})")

    def backoff(self, failures: int) -> float:
        """Delay before the restart that follows the ``failures``-th consecutive failure (1-based)."""
        k = max(0, failures - 1)
        return min(self.backoff_max_s, self.backoff_initial_s * (2.0 ** min(k, 30)))

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "RestartPolicy":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


HEAD_START_S = 120.0       # an idle machine starts a local Ray head in 3-10 s
MAX_LOAD_SCALE = 10.0


@dataclass(frozen=True)
class StartLimits:
    """How long the parts Ray starts may take: the local head (``head_s``), an actor to be placed and running
    (``actor_s``), and Ray's own waits for its agents' ports and for the raylet to register (``ray_wait_s``,
    given to the head as RAY_agent_register_timeout_ms and RAY_raylet_start_wait_time_s)."""

    head_s: float = HEAD_START_S
    actor_s: float = HEAD_START_S / 2
    ray_wait_s: float = HEAD_START_S / 4

    @classmethod
    def from_start_timeout(cls, value: float | str, load_per_cpu: float = 0.0) -> "StartLimits":
        """``ray.start_timeout``: seconds, or auto = :data:`HEAD_START_S` scaled by the machine's load (the
        1-minute load average per CPU, 1x to :data:`MAX_LOAD_SCALE`); the other limits keep their proportions."""
        head = float(value) if value != "auto" else HEAD_START_S * min(MAX_LOAD_SCALE, max(1.0, load_per_cpu))
        return cls(head_s=head, actor_s=head / 2, ray_wait_s=head / 4)

    def ray_env(self) -> dict[str, str]:
        """Ray's own start-up waits, in the variables its raylet reads."""
        return {"RAY_agent_register_timeout_ms": str(int(self.ray_wait_s * 1000)),
                "RAY_raylet_start_wait_time_s": str(max(1, round(self.ray_wait_s))),
                # the dashboard's own start-up wait (60 s in Ray): an emulated guest took 11 minutes
                "RAY_DASHBOARD_STARTUP_TIMEOUT_S": str(max(60, round(self.head_s)))}

    def to_dict(self) -> dict:
        return {"head_s": self.head_s, "actor_s": self.actor_s, "ray_wait_s": self.ray_wait_s}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "StartLimits":
        return cls(**{k: float(d[k]) for k in cls.__dataclass_fields__ if k in d})


@dataclass(frozen=True)
class Deployment:
    """Everything ``up`` runs.

    ``ray_address`` is ``"local"`` (start an embedded Ray head on this machine, stopped again by ``down``) or
    the address of a running Ray cluster (``host:port``). Ports of the embedded head that are ``None`` are
    picked free at start and recorded in the state file. ``api_key_env`` names the environment variable (read by
    ``up`` on this machine) that holds the gateway's API key; ``None`` means no key.
    """

    specs: tuple[LaunchSpec, ...]
    gateway_host: str = "127.0.0.1"
    gateway_port: int = 8080
    api_key_env: str | None = None
    gateway_cors: str | None = "localhost"     # gateway.cors_origins
    ray_address: str = LOCAL
    dashboard_host: str = "127.0.0.1"
    dashboard_port: int = 8265
    namespace: str = "orchestrator"
    restart: RestartPolicy = field(default_factory=RestartPolicy)
    plan_json: Mapping[str, Any] = field(default_factory=dict)
    ray_port: int | None = None                 # GCS port of the embedded head (None: a free one)
    metrics_export_port: int | None = None      # Prometheus endpoint of the embedded head (None: a free one)
    log_dir: str | None = None                  # llama-server logs on each node (None: <state_dir>/logs/<ns>)
    gateway_processes: int = 1                  # gateway actors sharing the port (SO_REUSEPORT)
    early: Mapping[str, Mapping[str, str]] = field(default_factory=dict)   # worker -> `up`'s early llama-server
    limits: StartLimits = field(default_factory=StartLimits)

    def __post_init__(self) -> None:
        if not self.specs:
            raise ConfigError("deployment: no workers to run (the plan produced no LaunchSpec)")
        if not _NAME.match(self.namespace):
            raise ConfigError(f"ray.namespace: {self.namespace!r} is not a valid name (letters, digits, '_.-')")
        names = [s.name for s in self.specs]
        for s in self.specs:
            if not _NAME.match(s.name):
                raise ConfigError(f"worker {s.name!r}: not a valid worker name (letters, digits, '_.-')")
            if names.count(s.name) > 1:
                raise ConfigError(f"worker {s.name!r}: the name is used by more than one worker")
            if not s.argv:
                raise ConfigError(f"worker {s.name!r}: empty argv")
            if not 0 < s.port < 65536:
                raise ConfigError(f"worker {s.name!r}: port {s.port} is not in 1..65535")
        seen: dict[tuple, str] = {}
        for s in self.specs:
            key = (s.node, s.host, s.port)
            if key in seen:
                where = f"node {s.node!r}" if s.node else "this node"
                raise ConfigError(f"worker {s.name!r}: {s.host}:{s.port} on {where} is already used by worker "
                                  f"{seen[key]!r}")
            seen[key] = s.name
        for label, port in (("gateway.port", self.gateway_port), ("ray.dashboard_port", self.dashboard_port),
                            ("ray.port", self.ray_port), ("ray.metrics_export_port", self.metrics_export_port)):
            if port is not None and not 0 < port < 65536:
                raise ConfigError(f"{label}: {port} is not in 1..65535")
        if not 1 <= self.gateway_processes <= 64:
            raise ConfigError(f"gateway.processes: {self.gateway_processes} is not in 1..64")
        if self.api_key_env is not None and not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", self.api_key_env):
            raise ConfigError(f"gateway.api_key_env: {self.api_key_env!r} is not an environment variable name")

    @property
    def embedded(self) -> bool:
        return self.ray_address == LOCAL

    @property
    def model_aliases(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(s.model_alias for s in self.specs))

    def copy(self, **changes: Any) -> "Deployment":
        return replace(self, **changes)

    def to_dict(self) -> dict:
        return {
            "specs": [s.to_dict() for s in self.specs], "gateway_host": self.gateway_host,
            "gateway_port": self.gateway_port, "api_key_env": self.api_key_env,
            "gateway_cors": self.gateway_cors, "ray_address": self.ray_address,
            "dashboard_host": self.dashboard_host, "dashboard_port": self.dashboard_port,
            "namespace": self.namespace, "restart": self.restart.to_dict(), "plan_json": dict(self.plan_json),
            "ray_port": self.ray_port, "metrics_export_port": self.metrics_export_port, "log_dir": self.log_dir,
            "gateway_processes": self.gateway_processes, "early": {k: dict(v) for k, v in self.early.items()},
            "limits": self.limits.to_dict(),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Deployment":
        kw = dict(d)
        kw["specs"] = tuple(LaunchSpec.from_dict(s) for s in d["specs"])
        kw["restart"] = RestartPolicy.from_dict(d.get("restart", {}))
        kw["limits"] = StartLimits.from_dict(d.get("limits", {}))
        return cls(**{k: v for k, v in kw.items() if k in cls.__dataclass_fields__})
