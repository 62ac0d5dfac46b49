"""The worker actor: one per planned worker, on the Ray node its spec names, supervising one llama-server.

A plain class; :class:`orchestrator.cluster.ray_api.RayApi` turns it into a Ray actor. All process work
(spawn, probe, restart, stop) happens on one long-lived thread (``_loop``) so the llama-server's parent-death
signal stays armed for the actor's whole life; the Ray methods only flip flags and read snapshots.
"""

from __future__ import annotations

import functools
import re
import os
import socket
import threading
import time
import traceback
from pathlib import Path
from typing import Callable

from orchestrator.cluster.deployment import RestartPolicy
from orchestrator.cluster.metrics import MetricsSink, NodeClaim, WorkerSampler, fetch_text
from orchestrator.cluster.procs import RAY_INJECTED_ENV, Launcher, LocalLauncher, server_env
from orchestrator.cluster.supervisor import FAILED, STARTING, STOPPED, Supervisor, port_busy
from orchestrator.cluster.view import describe_binding, describe_devices
from orchestrator.launch.spec import LaunchSpec

TICK_S = 0.25
STARTING_TICK_S = 0.1   # while llama-server loads: /health is probed this often, so ready shows sooner
SAMPLE_S = 2.0


def default_log_dir(namespace: str) -> Path:
    from orchestrator.paths import state_dir

    return state_dir() / "logs" / namespace


class WorkerActor:
    def __init__(self, spec: dict, policy: dict, node_name: str, log_dir: str | None, namespace: str,
                 resumed: bool = False, adopt: dict | None = None, upstream_key: str | None = None,
                 sink: MetricsSink | None = None,
                 launcher: Launcher | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.spec = LaunchSpec.from_dict(spec)
        self.policy = RestartPolicy.from_dict(policy)
        self.node_name = node_name
        self.resumed = resumed
        self.adopt = adopt              # handed over by `up`: a llama-server it started early (keeper.py)
        self.adopt_note = ""
        log_path = Path(log_dir) if log_dir else default_log_dir(namespace)
        self.log_path = log_path / f"{self.spec.name}.log"
        self.sup = Supervisor(self.spec, self.policy,
                              launcher or LocalLauncher(drop_env=RAY_INJECTED_ENV, extra_env=server_env(upstream_key)),
                              self.log_path, clock=clock)
        if resumed:  # a re-created actor: the worker served before, so failures are restarted, not fatal
            self.sup.ever_ready = True
        if sink is None:
            from orchestrator.cluster.ray_api import RayApi

            sink = RayApi().metrics_sink()
        # the node's own metrics come from one worker per node: the one holding this lock in the node's folder
        node_file = re.sub(r"[^\w.-]", "_", node_name)
        claim = NodeClaim(log_path / f".node-metrics-{node_file}.lock")
        self.sampler = WorkerSampler(self.spec.name, node_name, self.spec.connect_url,
                                     self.spec.env.get("CUDA_VISIBLE_DEVICES"), sink, node_claim=claim)
        if upstream_key:     # /metrics wants the deployment's key (only /health is open)
            self.sampler.fetch = functools.partial(fetch_text, headers={"Authorization": f"Bearer {upstream_key}"})
        self._lock = threading.Lock()
        self._want_start = False
        self._quit = threading.Event()
        self._loop_error = ""
        self._thread: threading.Thread | None = None
        self._next_sample = 0.0
        self.clock = clock

    # --- Ray methods ---------------------------------------------------------------------------------------------
    def start(self) -> dict:
        """Begin supervision (returns at once; the loop thread spawns llama-server)."""
        with self._lock:
            self._want_start = True
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=f"supervise-{self.spec.name}", daemon=True)
                self._thread.start()
        return self.status()

    def status(self) -> dict:
        with self._lock:
            snap = self.sup.snapshot()
            if self._want_start and snap["state"] == "idle":
                snap["state"] = "starting"
        snap.update({
            "node": self.node_name, "hostname": socket.gethostname(), "actor_pid": os.getpid(),
            "binding": describe_binding(self.spec), "devices": describe_devices(self.spec),
            "metrics": dict(self.sampler.last), "loop_error": self._loop_error, "adopt_note": self.adopt_note,
        })
        return snap

    def stop(self) -> dict:
        """Stop llama-server (TERM to its process group, KILL after the timeout) and the loop."""
        self._quit.set()
        with self._lock:
            self.sup.stop()
        if self._thread is not None:
            self._thread.join(timeout=self.policy.stop_timeout_s + 5)
        return self.status()

    def ping(self) -> int:
        return os.getpid()

    # --- the loop ----------------------------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._quit.is_set():
            try:
                self.step()
            except Exception:  # never let one failed step end supervision
                self._loop_error = traceback.format_exc(limit=3).strip().splitlines()[-1]
            self._quit.wait(STARTING_TICK_S if self.sup.state == STARTING else TICK_S)

    def step(self) -> None:
        with self._lock:
            if self._quit.is_set() or self.sup.state == STOPPED:
                return
            if self._want_start:
                self._want_start = False
                self._first_start()
            else:
                self.sup.update()
            state = self.sup.snapshot()
        now = self.clock()
        if now >= self._next_sample:
            self._next_sample = now + SAMPLE_S
            self.sampler.sample(state, now)

    def _first_start(self) -> None:
        if self.adopt is not None:
            from orchestrator.cluster.keeper import AdoptedHandle

            handover, self.adopt = self.adopt, None
            handle, why = AdoptedHandle.adopt(handover, self.spec, grace=self.policy.stop_timeout_s)
            if handle is not None:
                since = max(0.0, time.monotonic() - handle.started_monotonic)
                self.sup.adopt(handle, self.clock() - since, handle.started_wall)
                return
            self.adopt_note = f"did not adopt the llama-server `up` started early ({why}); started its own"
        busy = port_busy(self.spec.host, self.spec.port)
        if busy and self.resumed:  # the previous actor's llama-server may still be going down
            deadline = time.monotonic() + self.policy.port_wait_s
            while busy and time.monotonic() < deadline and not self._quit.is_set():
                time.sleep(0.25)
                busy = port_busy(self.spec.host, self.spec.port)
        if busy:
            self.sup.state = FAILED
            self.sup.last_error = busy
            self.sup.reason = f"failed to start: {busy} on node {self.node_name}"
            return
        self.sup.start()
