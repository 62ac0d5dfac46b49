"""The controller: owns a deployment's worker actors and its gateway, and keeps them running.

:class:`Controller` is the control logic, stepped by :meth:`Controller.update` (one tick, never raises: a failed
step is recorded and the next tick tries again). It talks to Ray only through an ``api`` object with the methods
of :class:`orchestrator.cluster.ray_api.RayApi` (``nodes``, ``create_actor``, ``submit``, ``poll``, ``get``,
``kill``) so unit tests drive it with a fake api and a fake clock.

Per worker (a :class:`WorkerSlot`): create the worker actor on the Ray node the spec names (hard node affinity,
the spec's resources reserved), start it, poll its status every tick. The worker actor restarts its own
llama-server; the controller re-creates the *actor* when it is lost (its process died, its node went away), with
the same backoff and give-up bound. The healthy replicas go to the gateway as a routing table whenever it
changes. :class:`ControllerActor` runs a Controller as a named, detached Ray actor with a tick thread.
"""

from __future__ import annotations

import os
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

from orchestrator.cluster.deployment import Deployment
from orchestrator.cluster.view import describe_binding, describe_devices
from orchestrator.launch.spec import LaunchSpec

TICK_S = 0.5
STARTING_TICK_S = 0.1    # until the deployment is ready: each tick only polls, and readiness shows sooner
STALE_S = 5.0            # a replica whose last status is older than this is not routed to
PUSH_EVERY_S = 5.0       # the routing table is re-sent this often even when unchanged (a restarted gateway)

# deployment phases
STARTING, READY, DEGRADED, FAILED, STOPPING, STOPPED = "starting", "ready", "degraded", "failed", "stopping", "stopped"


def _gone_types() -> tuple[type, ...]:
    from orchestrator.cluster import ray_api as ra  # imports no Ray at module level: only the exception classes

    return (ra.ActorGone, ra.RemoteError)


class NodeMissing(Exception):
    pass


_WILDCARD = ("", "0.0.0.0", "::", "[::]")
_LOOPBACK = ("localhost", "::1", "[::1]")


def route_url(spec: LaunchSpec, node, gateway_node) -> str:
    """The URL the gateway (on ``gateway_node``) uses for ``spec``'s llama-server running on ``node``; raises
    NodeMissing when a loopback-only server on another machine cannot be reached."""
    if gateway_node is None or node.node_id == gateway_node.node_id or (node.ip and node.ip == gateway_node.ip):
        return spec.connect_url
    if spec.host in _WILDCARD:
        host = f"[{node.ip}]" if ":" in node.ip else node.ip
        return f"http://{host}:{spec.port}"
    if spec.host in _LOOPBACK or spec.host.startswith("127."):
        raise NodeMissing(f"worker {spec.name!r} listens on {spec.host} on node {node.name} ({node.ip}), which the "
                          f"gateway on node {gateway_node.name} ({gateway_node.ip}) cannot reach; let it listen on "
                          "0.0.0.0 or the node's address")
    return spec.url


def resolve_node(wanted: str | None, nodes: list, default_node_id: str):
    """The live Ray node for a spec's ``node``: None means the node ``up`` runs on; otherwise a node whose name
    (``ray start --node-name``), IP or hostname is ``wanted``; ``local`` also means the ``up`` node when no Ray
    node carries that name."""
    alive = [n for n in nodes if n.alive]
    if wanted is None:
        hit = [n for n in alive if n.node_id == default_node_id]
    else:
        hit = [n for n in alive if n.name == wanted] or [n for n in alive if wanted in (n.ip, n.hostname)] or \
              [n for n in alive if n.hostname.split(".")[0] == wanted]
        if not hit and wanted == "local":
            hit = [n for n in alive if n.node_id == default_node_id]
    if not hit:
        names = ", ".join(sorted(f"{n.name}" + (f" ({n.ip})" if n.ip != n.name else "") for n in alive)) or "none"
        raise NodeMissing(f"node {wanted or '(the up node)'!r} is not in the Ray cluster (alive nodes: {names}); "
                          f"start it with `ray start --address=<head> --node-name {wanted or '<name>'}`")
    if len(hit) > 1 and wanted is not None and len({n.name for n in hit}) == 1:
        raise NodeMissing(f"node name {wanted!r} matches {len(hit)} Ray nodes; give each node its own --node-name")
    return hit[0]


@dataclass
class WorkerSlot:
    spec: LaunchSpec
    phase: str = "pending"          # pending | running | backoff | failed | stopped
    handle: Any = None
    node_id: str = ""
    node_name: str = ""
    start_ref: Any = None
    poll_ref: Any = None
    created_at: float = 0.0
    status: dict = field(default_factory=dict)
    status_at: float = -1e18
    ever_ready: bool = False
    actor_failures: int = 0
    actor_restarts: int = 0
    next_create_at: float = 0.0
    error: str = ""
    reason: str = ""
    route_url: str = ""             # how the gateway reaches this worker's llama-server
    adopt_offered: bool = False     # the first actor was given `up`'s early llama-server (if there is one)


@dataclass
class GatewaySlot:
    phase: str = "pending"          # pending | starting | serving | backoff | failed | stopped
    handle: Any = None
    start_ref: Any = None
    push_ref: Any = None
    created_at: float = 0.0
    pushed: list | None = None
    pushed_at: float = -1e18
    acked: list | None = None       # the last table the gateway confirmed it routes by
    ever_up: bool = False
    failures: int = 0
    next_create_at: float = 0.0
    url: str = ""
    error: str = ""


class Controller:
    def __init__(self, deployment: Deployment, api: Any, driver_node_id: str, api_key: str | None = None,
                 clock: Callable[[], float] = time.monotonic, worker_cls: type | None = None,
                 gateway_cls: type | None = None, restarted: bool = False, upstream_key: str | None = None) -> None:
        self.dep = deployment
        self.policy = deployment.restart
        self.api = api
        self.driver_node_id = driver_node_id
        self.api_key = api_key
        self.upstream_key = upstream_key    # every llama-server's own key; only the gateway and workers know it
        self.clock = clock
        if worker_cls is None:
            from orchestrator.cluster.worker import WorkerActor as worker_cls
        if gateway_cls is None:
            from orchestrator.cluster.gateway import GatewayActor as gateway_cls
        self.worker_cls, self.gateway_cls = worker_cls, gateway_cls
        # a controller that Ray restarted after its process died: the workers served before, so their
        # replacements wait for the old ports and are restarted on failure instead of failing the deployment
        self.slots = [WorkerSlot(s, ever_ready=restarted) for s in deployment.specs]
        self.restarted = restarted
        self.gws = [GatewaySlot() for _ in range(deployment.gateway_processes)]
        self.phase = STARTING
        self.error = ""
        self.ready_once = False
        self.started_wall = time.time()
        self.tick_errors = 0
        self._gone = _gone_types()
        self._nodes: list | None = None
        from orchestrator.cluster.live_routing import LiveRouting
        self.live = LiveRouting.from_specs(deployment.specs, upstream_key)   # workers.live_routing: on

    # --- the tick ----------------------------------------------------------------------------------------------
    def update(self) -> str:
        if self.phase in (STOPPING, STOPPED):
            return self.phase
        now = self.clock()
        self._nodes = None
        for slot in self.slots:
            try:
                self._tick_worker(slot, now)
            except Exception as e:  # never let one worker's step stop the loop
                self.tick_errors += 1
                slot.error = f"controller error: {type(e).__name__}: {e}"
        for g in self.gws:
            try:
                self._tick_gateway(g, now)
            except Exception as e:
                self.tick_errors += 1
                g.error = f"controller error: {type(e).__name__}: {e}"
        self._update_phase()
        if self.live is not None:
            self.live.tick(self._live_urls())
        return self.phase

    def _live_urls(self) -> list[str]:
        return [s.route_url or s.spec.connect_url for s in self.slots if s.phase == "running"]

    def _nodes_now(self) -> list:
        if self._nodes is None:
            self._nodes = self.api.nodes()
        return self._nodes

    def _tick_worker(self, slot: WorkerSlot, now: float) -> None:
        if slot.phase in ("pending", "backoff"):
            if now < slot.next_create_at:
                return
            self._create_worker(slot, now)
            return
        if slot.phase != "running":
            return
        if slot.start_ref is not None:
            try:
                done, val = self.api.poll(slot.start_ref)
            except self._gone as e:
                self._actor_lost(slot, now, f"worker actor failed to start on node {slot.node_name}: {e}")
                return
            if not done:
                if now - slot.created_at > self.dep.limits.actor_s:
                    res = dict(slot.spec.resources) or "none"
                    self._actor_lost(slot, now, f"worker actor not running on node {slot.node_name} after "
                                                f"{self.dep.limits.actor_s:g}s (does the node have the resources {res}? "
                                                "ray.start_timeout sets how long it may take)")
                return
            slot.start_ref = None
            self._took_status(slot, val, now)
        if slot.poll_ref is not None:
            try:
                done, val = self.api.poll(slot.poll_ref)
            except self._gone as e:
                slot.poll_ref = None
                self._actor_lost(slot, now, f"worker actor died: {e}")
                return
            if not done:
                return
            slot.poll_ref = None
            self._took_status(slot, val, now)
        if slot.phase == "running":
            slot.poll_ref = self.api.submit(slot.handle, "status")

    def _create_worker(self, slot: WorkerSlot, now: float) -> None:
        try:
            node = resolve_node(slot.spec.node, self._nodes_now(), self.driver_node_id)
        except NodeMissing as e:
            self._actor_lost(slot, now, str(e), created=False)
            return
        slot.node_id, slot.node_name = node.node_id, node.name
        gateway_node = next((n for n in self._nodes_now() if n.node_id == self.driver_node_id), None)
        try:
            slot.route_url = route_url(slot.spec, node, gateway_node)
        except NodeMissing as e:
            self._actor_lost(slot, now, str(e), created=False)
            return
        # the llama-server `up` started before Ray (workers.early_start) goes to the first actor only: its keeper
        # stops it when that actor dies
        adopt = None if (slot.adopt_offered or self.restarted) else self.dep.early.get(slot.spec.name)
        slot.adopt_offered = True
        slot.handle = self.api.create_actor(
            self.worker_cls, slot.spec.to_dict(), self.policy.to_dict(), node.name, self.dep.log_dir,
            self.dep.namespace, slot.ever_ready, adopt, self.upstream_key, node_id=node.node_id,
            resources=dict(slot.spec.resources),
            max_concurrency=4)
        slot.start_ref = self.api.submit(slot.handle, "start")
        slot.poll_ref = None
        slot.created_at = now
        slot.phase = "running"

    def _took_status(self, slot: WorkerSlot, val: dict, now: float) -> None:
        slot.status, slot.status_at = dict(val), now
        state = val.get("state")
        if state == "ready":
            slot.ever_ready = True
            if slot.actor_failures and val.get("uptime_s", 0) >= self.policy.stable_s:
                slot.actor_failures = 0
        elif state == "failed":
            slot.phase = "failed"
            slot.reason = val.get("reason") or val.get("last_error") or "failed"

    def _actor_lost(self, slot: WorkerSlot, now: float, msg: str, created: bool = True) -> None:
        if slot.handle is not None:
            self.api.kill(slot.handle)
        slot.handle = slot.start_ref = slot.poll_ref = None
        slot.error = msg
        slot.actor_failures += 1
        if not slot.ever_ready and self.policy.fail_fast:
            slot.phase, slot.reason = "failed", msg
        elif slot.actor_failures > self.policy.max_restarts:
            slot.phase = "failed"
            slot.reason = f"gave up after {slot.actor_failures} lost worker actor(s); last: {msg}"
        else:
            slot.phase = "backoff"
            slot.next_create_at = now + self.policy.backoff(slot.actor_failures)
            if created:
                slot.actor_restarts += 1

    # --- routing -----------------------------------------------------------------------------------------------
    def replica_table(self, now: float | None = None) -> list[dict]:
        now = self.clock() if now is None else now
        rows = []
        for s in self.slots:
            st = s.status
            fresh = now - s.status_at <= STALE_S
            healthy = s.phase == "running" and st.get("state") == "ready" and fresh
            if healthy:
                detail = "healthy"
            elif s.phase in ("failed", "backoff", "pending"):
                detail = f"{s.phase}" + (f" ({s.reason or s.error})" if (s.reason or s.error) else "")
            elif not fresh and st:
                detail = "not answering"
            else:
                state = st.get("state", "starting")
                why = st.get("last_error") if state in ("backoff", "failed") else ""
                detail = state + (f" ({why})" if why else "")
            pid = st.get("pid") if s.phase == "running" and st.get("state") in ("starting", "ready") else None
            rows.append({"name": s.spec.name, "url": s.route_url or s.spec.connect_url, "model": s.spec.model_alias,
                         "healthy": healthy, "pid": pid,
                         "slots": s.spec.settings.parallel if s.spec.settings else None,
                         "detail": detail})
        return rows

    def _tick_gateway(self, g: GatewaySlot, now: float) -> None:
        if g.phase in ("pending", "backoff"):
            if now < g.next_create_at:
                return
            g.handle = self.api.create_actor(self.gateway_cls, node_id=self.driver_node_id)
            g.pushed = self.replica_table(now)
            g.start_ref = self.api.submit(g.handle, "start", self.dep.gateway_host, self.dep.gateway_port,
                                          self.api_key, g.pushed, len(self.gws) > 1, self.upstream_key,
                                          self.dep.gateway_cors)
            g.pushed_at, g.created_at, g.phase = now, now, "starting"
            return
        if g.phase == "starting":
            try:
                done, url = self.api.poll(g.start_ref)
            except self._gone as e:
                self._gateway_lost(g, now, f"gateway cannot serve on {self.dep.gateway_host}:{self.dep.gateway_port}: "
                                        f"{e}")
                return
            if not done:
                if now - g.created_at > self.dep.limits.actor_s:
                    self._gateway_lost(g, now, f"gateway actor not running after {self.dep.limits.actor_s:g}s "
                                            "(ray.start_timeout)")
                return
            g.start_ref, g.url, g.ever_up, g.phase, g.error = None, url, True, "serving", ""
            g.failures, g.acked = 0, g.pushed
            return
        if g.phase != "serving":
            return
        if g.push_ref is not None:
            try:
                done, _ = self.api.poll(g.push_ref)
            except self._gone as e:
                self._gateway_lost(g, now, f"gateway actor died: {e}")
                return
            if done:
                g.push_ref, g.acked = None, g.pushed
        table = self.replica_table(now)
        if g.push_ref is None and (table != g.pushed or now - g.pushed_at >= PUSH_EVERY_S):
            g.push_ref = self.api.submit(g.handle, "set_replicas", table)
            g.pushed, g.pushed_at = table, now

    def _gateway_lost(self, g: GatewaySlot, now: float, msg: str) -> None:
        if g.handle is not None:
            self.api.kill(g.handle)
        g.handle = g.start_ref = g.push_ref = None
        g.error = msg
        g.failures += 1
        if not g.ever_up:
            g.phase = "failed"
        elif g.failures > self.policy.max_restarts:
            g.phase = "failed"
            g.error = f"gave up after {g.failures} lost gateway actor(s); last: {msg}"
        else:
            g.phase = "backoff"
            g.next_create_at = now + self.policy.backoff(g.failures)

    # --- deployment phase --------------------------------------------------------------------------------------
    def _update_phase(self) -> None:
        if self.phase in (STOPPING, STOPPED):
            return
        fatal = [f"worker {s.spec.name}: {s.reason}" for s in self.slots if s.phase == "failed" and not s.ever_ready]
        fatal += list(dict.fromkeys(g.error for g in self.gws if g.phase == "failed" and not g.ever_up))
        all_ready = all(s.phase == "running" and s.status.get("state") == "ready" for s in self.slots)
        # ready means requests are served: the gateway has confirmed a table that routes to every worker
        routed = all(g.acked is not None and all(r["healthy"] for r in g.acked) for g in self.gws)
        serving = all(g.phase == "serving" for g in self.gws)
        if fatal and not self.ready_once:
            self.phase, self.error = FAILED, "; ".join(fatal)
        elif all_ready and serving and routed:
            self.phase, self.error, self.ready_once = READY, "", True
        elif self.ready_once:
            bad = [f"{s.spec.name}: {s.phase if s.phase != 'running' else s.status.get('state', '?')}"
                   for s in self.slots if not (s.phase == "running" and s.status.get("state") == "ready")]
            for i, g in enumerate(self.gws):
                if g.phase != "serving":
                    who = "gateway" if len(self.gws) == 1 else f"gateway {i}"
                    bad.append(f"{who}: {g.phase}" + (f" ({g.error})" if g.error else ""))
            self.phase, self.error = DEGRADED, "; ".join(bad)
        else:
            self.phase = STARTING

    # --- status and shutdown -----------------------------------------------------------------------------------
    def status(self) -> dict:
        now = self.clock()
        table = {r["name"]: r for r in self.replica_table(now)}
        workers = []
        for s in self.slots:
            st = dict(s.status)
            w = {
                "name": s.spec.name, "node": s.node_name or s.spec.node or "-",
                "url": s.route_url or s.spec.connect_url,
                "model": s.spec.model_alias, "binding": describe_binding(s.spec),
                "devices": describe_devices(s.spec), "argv": list(s.spec.argv),
                "env": dict(s.spec.env), **st,
            }
            w["phase"] = s.phase
            if s.phase != "running" or not st:
                w["state"] = s.phase if s.phase != "running" else "starting"
                w["pid"] = None if s.phase != "running" else st.get("pid")
            w["restarts"] = int(st.get("restarts", 0)) + s.actor_restarts
            w["actor_restarts"] = s.actor_restarts
            w["reason"] = s.reason or st.get("reason", "")
            w["last_error"] = st.get("last_error") or s.error
            w["routed"] = table[s.spec.name]["healthy"]
            w["status_age_s"] = round(now - s.status_at, 1) if s.status_at > -1e17 else None
            workers.append(w)
        g = next((g for g in self.gws if g.phase != "serving"), self.gws[0])   # the worst one speaks
        return {
            "namespace": self.dep.namespace, "phase": self.phase, "error": self.error,
            "started_at": self.started_wall, "tick_errors": self.tick_errors, "restarted": self.restarted,
            "plan": dict(self.dep.plan_json),
            "gateway": {"url": g.url or f"http://{self.dep.gateway_host}:{self.dep.gateway_port}",
                        "state": g.phase, "error": g.error, "healthy": sum(1 for r in table.values() if r["healthy"]),
                        "api_key": bool(self.api_key), "processes": len(self.gws),
                        "serving": sum(1 for x in self.gws if x.phase == "serving")},
            "workers": workers,
            "live_routing": self.live.status() if self.live is not None else None,
        }

    def shutdown(self, timeout: float | None = None) -> dict:
        """Stop every llama-server (through its worker actor), the gateway, then the actors themselves."""
        self.phase = STOPPING
        if self.live is not None:   # the workers' last routing, before they stop
            self.live.finish(self._live_urls())
        timeout = timeout if timeout is not None else self.policy.stop_timeout_s + 10
        refs = []
        for s in self.slots:
            if s.handle is not None:
                refs.append((s, self.api.submit(s.handle, "stop")))
        grefs = [self.api.submit(g.handle, "stop") for g in self.gws if g.handle is not None]
        deadline = self.clock() + timeout
        for s, ref in refs:
            try:
                s.status = dict(self.api.get(ref, timeout=max(0.5, deadline - self.clock())))
            except Exception as e:  # dead actor or timeout: its llama-server goes with it (parent-death signal)
                s.error = f"stop: {type(e).__name__}: {e}"
        for gref in grefs:
            try:
                self.api.get(gref, timeout=max(0.5, deadline - self.clock()))
            except Exception:
                pass
        for s in self.slots:
            if s.handle is not None:
                self.api.kill(s.handle)
                s.handle = None
            s.phase = "stopped"
        for g in self.gws:
            if g.handle is not None:
                self.api.kill(g.handle)
                g.handle = None
            g.phase, g.acked = "stopped", None
        self.phase = STOPPED
        return self.status()


class ControllerActor:
    """A :class:`Controller` as a named, detached Ray actor, ticked by its own thread. Ray restarts it (``up``
    creates it with ``max_restarts``) if its process dies; the workers it owned died with it, and the new one
    starts them again from the deployment it was created with."""

    def __init__(self, deployment: dict, driver_node_id: str, api_key: str | None,
                 upstream_key: str | None = None) -> None:
        from orchestrator.cluster.ray_api import RayApi

        api = RayApi()
        self.ctrl = Controller(Deployment.from_dict(deployment), api, driver_node_id, api_key,
                               restarted=api.was_restarted(), upstream_key=upstream_key)
        self._lock = threading.Lock()
        self._quit = threading.Event()
        self.loop_error = ""
        self._thread = threading.Thread(target=self._loop, name="controller", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._quit.is_set():
            phase = STARTING
            try:
                with self._lock:
                    phase = self.ctrl.update()
            except Exception:
                self.loop_error = traceback.format_exc(limit=3).strip().splitlines()[-1]
            self._quit.wait(STARTING_TICK_S if phase == STARTING else TICK_S)

    def status(self) -> dict:
        with self._lock:
            st = self.ctrl.status()
        st["loop_error"] = self.loop_error
        st["controller_pid"] = os.getpid()
        return st

    def shutdown(self) -> dict:
        self._quit.set()
        self._thread.join(timeout=10)
        with self._lock:
            return self.ctrl.shutdown()

    def ping(self) -> str:
        return self.ctrl.phase
