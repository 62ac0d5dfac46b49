"""Every Ray call orchestrator makes, behind one small class.

The control logic (:mod:`controller`, :mod:`supervisor`, :mod:`gateway`) never imports Ray: it receives a
:class:`RayApi` (or, in unit tests, a fake with the same methods) and sees Ray failures as :class:`ActorGone`.
This is the only module in ``orchestrator.cluster`` that imports ``ray`` (a test checks that).

Token authentication (Ray >= 2.52 turns it on for new local clusters): a driver only sends the token when
``RAY_AUTH_MODE=token`` is set before Ray reads its config, so :func:`prepare_auth` sets it whenever a token is
available (``$RAY_AUTH_TOKEN``, ``$RAY_AUTH_TOKEN_PATH`` or ``~/.ray/auth_token``) and the user did not choose a
mode; a cluster without authentication accepts such a driver too.
"""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from orchestrator.errors import ClusterError
from orchestrator.sigutil import keep_signal_handlers


class ActorGone(Exception):
    """The actor's process is gone (crashed, killed, its node lost) or it never could be scheduled."""


class RemoteError(Exception):
    """A method raised inside an actor; ``str()`` is the remote error's message (its traceback stays there)."""


@dataclass(frozen=True)
class NodeInfo:
    node_id: str
    name: str
    ip: str
    hostname: str
    alive: bool
    is_head: bool
    resources: Mapping[str, float]


def token_path() -> Path:
    return Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")


def token_available() -> bool:
    return bool(os.environ.get("RAY_AUTH_TOKEN")) or token_path().is_file()


def read_token() -> str | None:
    """The token a client needs for the dashboard API (``Authorization: Bearer ...``), if any."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return os.environ["RAY_AUTH_TOKEN"].strip()
    try:
        return token_path().read_text().strip() or None
    except OSError:
        return None


def prepare_auth() -> str:
    """Choose the auth mode for this process before Ray starts; returns it ('token' or 'disabled')."""
    mode = os.environ.get("RAY_AUTH_MODE")
    if mode is None:
        mode = "token" if token_available() else "disabled"
        os.environ["RAY_AUTH_MODE"] = mode
        if "ray" in sys.modules:  # Ray caches its config at import: refresh it
            try:
                from ray._raylet import Config

                Config.initialize("")
            except Exception:
                pass
    return mode.lower()


def tcp_reachable(address: str, timeout: float = 3.0) -> str | None:
    """None when ``host:port`` accepts a TCP connection, else why not."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        return f"{address!r} is not host:port"
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return None
    except OSError as e:
        return e.strerror or str(e) or type(e).__name__


def _same_endpoint(a: str, b: str) -> bool:
    """``host:port`` strings naming the same endpoint (localhost spelled either way)."""
    def norm(x: str) -> tuple[str, str]:
        host, _, port = x.rpartition(":")
        return ("127.0.0.1" if host in ("localhost", "") else host, port)
    return norm(a) == norm(b)


class RayApi:
    """Thin, stateless-ish facade over Ray. One instance per process (driver or actor)."""

    def __init__(self) -> None:
        import ray

        self._ray = ray
        self._remote_classes: dict[tuple, Any] = {}
        self._sink: RayMetricsSink | None = None

    # --- driver -----------------------------------------------------------------------------------------------
    @classmethod
    def connect(cls, address: str, namespace: str) -> "RayApi":
        """Connect this process to the Ray cluster at ``address`` as a driver (ClusterError when it cannot)."""
        why = tcp_reachable(address)
        if why:
            raise ClusterError(f"ray.address: cannot reach the Ray cluster at {address}: {why}")
        prepare_auth()
        import ray

        if ray.is_initialized():
            # already the driver of that cluster and namespace (a foreground `up` stopping on Ctrl-C): keep the
            # connection. ray.shutdown() then ray.init() in one process can abort it ("The process is already
            # initialized for core worker", seen when the Ctrl-C landed while Ray was busy)
            try:
                ctx = ray.get_runtime_context()
                if ctx.namespace == namespace and _same_endpoint(ctx.gcs_address, address):
                    return cls()
            except Exception:
                pass
            with keep_signal_handlers():
                ray.shutdown()
        try:
            with keep_signal_handlers():
                ray.init(address=address, namespace=namespace, log_to_driver=False, logging_level="ERROR",
                         configure_logging=True)
        except Exception as e:  # ConnectionError, AuthenticationError, RuntimeError ...
            hint = ""
            if "auth" in str(e).lower() or not token_available():
                hint = (" (if the cluster uses token authentication, make its token available to this machine: "
                        "$RAY_AUTH_TOKEN or ~/.ray/auth_token)")
            raise ClusterError(f"ray.address: cannot connect to the Ray cluster at {address}: "
                               f"{str(e).splitlines()[0] if str(e) else type(e).__name__}{hint}") from None
        return cls()

    def disconnect(self) -> None:
        if self._ray.is_initialized():
            with keep_signal_handlers():
                self._ray.shutdown()

    def current_node_id(self) -> str:
        return self._ray.get_runtime_context().get_node_id()

    def nodes(self) -> list[NodeInfo]:
        out = []
        for n in self._ray.nodes():
            res = dict(n.get("Resources") or {})
            out.append(NodeInfo(node_id=n["NodeID"], name=n.get("NodeName") or n.get("NodeManagerAddress", ""),
                                ip=n.get("NodeManagerAddress", ""), hostname=n.get("NodeManagerHostname", ""),
                                alive=bool(n.get("Alive")), is_head="node:__internal_head__" in res,
                                resources=res))
        return out

    def get_actor(self, name: str, namespace: str | None = None) -> Any | None:
        try:
            return self._ray.get_actor(name, namespace=namespace)
        except ValueError:
            return None

    # --- actors ------------------------------------------------------------------------------------------------
    def create_actor(self, cls: type, *args: Any, name: str | None = None, detached: bool = False,
                     node_id: str | None = None, resources: Mapping[str, float] | None = None,
                     max_concurrency: int | None = None, max_restarts: int = 0,
                     namespace: str | None = None) -> Any:
        """Start ``cls`` as an actor pinned to ``node_id`` (hard affinity) reserving ``resources``
        (``CPU``/``GPU`` are Ray's own, anything else a custom resource; CPU defaults to 0)."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        key = (cls, max_concurrency)
        rc = self._remote_classes.get(key)
        if rc is None:
            rc = self._ray.remote(cls)
            self._remote_classes[key] = rc
        res = dict(resources or {})
        opts: dict[str, Any] = {"num_cpus": float(res.pop("CPU", 0.0)), "max_restarts": max_restarts}
        if "GPU" in res:
            opts["num_gpus"] = float(res.pop("GPU"))
        if res:
            opts["resources"] = res
        if name:
            opts["name"] = name
        if namespace:
            opts["namespace"] = namespace
        if detached:
            opts["lifetime"] = "detached"
        if max_concurrency:
            opts["max_concurrency"] = max_concurrency
        if node_id:
            opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)
        return rc.options(**opts).remote(*args)

    def submit(self, handle: Any, method: str, *args: Any) -> Any:
        """Call ``handle.method(*args)`` without waiting; returns a reference for :meth:`poll`/:meth:`get`."""
        return getattr(handle, method).remote(*args)

    def poll(self, ref: Any) -> tuple[bool, Any]:
        """``(False, None)`` while running, else ``(True, value)``; raises ActorGone / RemoteError."""
        ready, _ = self._ray.wait([ref], timeout=0)
        if not ready:
            return False, None
        return True, self.get(ref, timeout=1.0)

    def get(self, ref: Any, timeout: float) -> Any:
        """Wait for one result; ActorGone when the actor died, RemoteError when it raised, TimeoutError."""
        from ray import exceptions as rx

        try:
            return self._ray.get(ref, timeout=timeout)
        except rx.GetTimeoutError:
            raise TimeoutError(f"no answer within {timeout:g}s") from None
        except (rx.RayActorError, rx.ActorUnschedulableError) as e:
            raise ActorGone(_first_line(e)) from None
        except rx.RayTaskError as e:
            cause = e.cause if getattr(e, "cause", None) is not None else e
            raise RemoteError(_first_line(cause)) from None

    def call(self, handle: Any, method: str, *args: Any, timeout: float = 30.0) -> Any:
        return self.get(self.submit(handle, method, *args), timeout)

    def kill(self, handle: Any) -> None:
        try:
            self._ray.kill(handle, no_restart=True)
        except Exception:
            pass

    def was_restarted(self) -> bool:
        """In an actor: True when Ray restarted it after its process died."""
        try:
            return bool(self._ray.get_runtime_context().was_current_actor_reconstructed)
        except Exception:
            return False

    def metrics_sink(self) -> "RayMetricsSink":
        if self._sink is None:
            self._sink = RayMetricsSink()
        return self._sink


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    # Ray prefixes remote errors with their repr and a traceback; keep the last meaningful line
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if not lines:
        return type(e).__name__
    for ln in reversed(lines):
        if not ln.startswith(("File ", "^", "Traceback", "raise ", "return ")):
            return ln[:400]
    return lines[-1][:400]


class RayMetricsSink:
    """:class:`orchestrator.cluster.metrics.MetricsSink` on ``ray.util.metrics`` (one Gauge, Counter or Histogram
    per name)."""

    def __init__(self) -> None:
        from ray.util import metrics as rm

        from orchestrator.cluster.metrics import BUCKETS, METRICS, TAG_KEYS

        self._m: dict[str, Any] = {}
        for name, (kind, desc) in METRICS.items():
            keys = TAG_KEYS.get(name, ())
            if kind == "histogram":
                self._m[name] = rm.Histogram(name, description=desc, boundaries=list(BUCKETS[name]), tag_keys=keys)
            else:
                cls = rm.Counter if kind == "counter" else rm.Gauge
                self._m[name] = cls(name, description=desc, tag_keys=keys)

    def set(self, name: str, value: float, tags: Mapping[str, str]) -> None:
        self._m[name].set(float(value), tags=dict(tags))

    def inc(self, name: str, value: float, tags: Mapping[str, str]) -> None:
        if value > 0:
            self._m[name].inc(float(value), tags=dict(tags))
        elif value == 0:
            # Counter.inc refuses 0; recording 0 makes the series exist, so a counter is seen at 0 before its
            # first event
            self._m[name]._record(0.0, tags=dict(tags))

    def observe(self, name: str, value: float, tags: Mapping[str, str]) -> None:
        self._m[name].observe(float(value), tags=dict(tags))

