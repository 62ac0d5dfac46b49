"""Supervise one llama-server: start it, wait for /health, watch it, restart it with backoff, give up.

An explicit state machine stepped by :meth:`Supervisor.update`. Every side effect goes through the injected
``launcher`` (processes), ``probe`` (one ``/health`` request) and ``clock`` (monotonic seconds), so unit tests
step it with a fake clock and fake processes. The worker actor calls ``update()`` from one long-lived thread.

States::

    idle ──start()──► starting ──/health ok──► ready ──exit / hung──► backoff ──delay──► starting ...
                         │                       │                      │
                         └── exit / load timeout ┴── too many failures ─┴──► failed (reason kept)
    any ──stop()──► stopped
"""

from __future__ import annotations

import http.client
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable
from urllib.parse import urlsplit

from orchestrator.cluster.deployment import RestartPolicy
from orchestrator.cluster.procs import Launcher, ProcessHandle
from orchestrator.errors import LaunchError
from orchestrator.launch.spec import LaunchSpec

IDLE, STARTING, READY, BACKOFF, FAILED, STOPPED = "idle", "starting", "ready", "backoff", "failed", "stopped"
_KILLED_FROM_OUTSIDE = (1, 2, 9, 15)     # SIGHUP, SIGINT, SIGKILL, SIGTERM (SIGSEGV, SIGABRT ... are its own)


@dataclass(frozen=True)
class Health:
    ok: bool
    detail: str = ""        # why not ok: "HTTP 503 Loading model", "connection refused", "timed out"


Probe = Callable[[str, float], Health]
PortCheck = Callable[[str, int], "str | None"]


def port_busy(host: str, port: int) -> str | None:
    """None when nothing listens on ``host:port``, else who does."""
    from orchestrator.cluster.procs import listener_on

    who = listener_on(host, port)
    return f"{host}:{port} is already in use by {who}" if who else None


def probe_health(url: str, timeout: float) -> Health:
    """One GET ``{url}/health``: ok on HTTP 200."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=timeout)
    try:
        conn.request("GET", "/health")
        resp = conn.getresponse()
        body = resp.read(512).decode("utf-8", "replace")
        if resp.status == 200:
            return Health(True)
        return Health(False, f"HTTP {resp.status} {body.strip()[:120]}")
    except (OSError, http.client.HTTPException) as e:
        return Health(False, type(e).__name__ if not str(e) else str(e))
    finally:
        conn.close()


def describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        import signal

        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with status {code}"


class Supervisor:
    def __init__(self, spec: LaunchSpec, policy: RestartPolicy, launcher: Launcher, log_path: Path,
                 probe: Probe = probe_health, clock: Callable[[], float] = time.monotonic,
                 port_check: PortCheck = port_busy) -> None:
        self.spec = spec
        self.policy = policy
        self.launcher = launcher
        self.log_path = log_path
        self.probe = probe
        self.clock = clock
        self.port_check = port_check
        self.port_wait_since: float | None = None
        self.state = IDLE
        self.proc: ProcessHandle | None = None
        self.restarts = 0               # restarts done (all time)
        self.failures = 0               # consecutive failed runs (reset after stable_s healthy)
        self.ever_ready = False
        self.last_error = ""
        self.reason = ""                # why it is failed (state FAILED)
        self.started_at = 0.0           # this run's spawn time
        self.started_wall = 0.0         # the same, as wall-clock time (for `up`'s breakdown of where time went)
        self.ready_at = 0.0
        self.last_ok = 0.0              # last healthy /health
        self.last_probe = -1e18
        self.next_start_at = 0.0
        self.health_detail = ""
        self.last_exit: int | None = None
        self.adopted = False            # the running server was started before the actor (workers.early_start)

    # --- commands ------------------------------------------------------------------------------------------------
    def start(self) -> None:
        if self.state in (IDLE, STOPPED):
            self.failures = 0
            self._spawn()

    def adopt(self, proc: ProcessHandle, started_at: float, started_wall: float) -> None:
        """Supervise a server that was started for this worker before it existed (see
        :mod:`orchestrator.cluster.keeper`): as if :meth:`start` had spawned it at ``started_at``."""
        if self.state in (IDLE, STOPPED):
            self.failures = 0
            self.proc, self.state, self.adopted = proc, STARTING, True
            self.started_at, self.started_wall = started_at, started_wall
            self.last_probe = -1e18
            self.health_detail = "starting"

    def stop(self) -> int | None:
        code = self._kill()
        self.state = STOPPED
        return code

    # --- the tick ------------------------------------------------------------------------------------------------
    def update(self) -> str:
        now = self.clock()
        if self.state == STARTING:
            self._tick_starting(now)
        elif self.state == READY:
            self._tick_ready(now)
        elif self.state == BACKOFF and now >= self.next_start_at:
            busy = self.port_check(self.spec.host, self.spec.port)
            if busy and self.ever_ready:
                # the old server's port can stay taken for a while (connections of clients that have not closed
                # their end yet): wait for it rather than burn restarts on it
                if self.port_wait_since is None:
                    self.port_wait_since = now
                if now - self.port_wait_since < self.policy.port_wait_s:
                    self.health_detail = f"waiting for the port: {busy}"
                    self.next_start_at = now + 0.5
                    return self.state
            self.port_wait_since = None
            self.restarts += 1
            self._spawn()
        return self.state

    def _tick_starting(self, now: float) -> None:
        assert self.proc is not None
        code = self.proc.poll()
        if code is not None:
            self._failed_run(f"{describe_exit(code)} while loading", exit_code=code)
            return
        h = self.probe(self.spec.connect_url, self.policy.probe_timeout_s)
        self.last_probe = now
        self.health_detail = h.detail
        if h.ok:
            # it may have died between poll and probe: an answer means it is up
            self.state, self.ready_at, self.last_ok, self.ever_ready = READY, now, now, True
            self.health_detail = ""
        elif now - self.started_at > self.policy.load_timeout_s:
            self._failed_run(f"not healthy {self.policy.load_timeout_s:g}s after start (last /health: {h.detail})")

    def _tick_ready(self, now: float) -> None:
        assert self.proc is not None
        code = self.proc.poll()
        if code is not None:
            self._failed_run(describe_exit(code), exit_code=code)
            return
        if self.failures and now - self.ready_at >= self.policy.stable_s:
            self.failures = 0
        if now - self.last_probe < self.policy.health_interval_s:
            return
        h = self.probe(self.spec.connect_url, self.policy.probe_timeout_s)
        self.last_probe = self.clock()
        if h.ok:
            self.last_ok, self.health_detail = self.last_probe, ""
            return
        self.health_detail = h.detail
        if self.last_probe - self.last_ok >= self.policy.health_timeout_s:
            self._failed_run(f"hung: /health failing for {self.last_probe - self.last_ok:.0f}s ({h.detail})")

    # --- internals -----------------------------------------------------------------------------------------------
    def _spawn(self) -> None:
        self.proc = None
        self.adopted = False
        busy = self.port_check(self.spec.host, self.spec.port)
        if busy:                      # another server there would answer /health for ours
            self._failed_run(busy, spawn_error=True)
            return
        try:
            self.proc = self.launcher.start(self.spec, self.log_path)
        except LaunchError as e:
            msg = str(e)
            for prefix in (f"worker {self.spec.name!r}: ", f"worker {self.spec.name}: "):
                msg = msg.removeprefix(prefix)          # the reason is shown under the worker's name already
            self._failed_run(msg, spawn_error=True)
            return
        except OSError as e:  # the launcher should wrap these; never let one kill the loop
            self._failed_run(f"cannot start: {e}", spawn_error=True)
            return
        self.state = STARTING
        self.started_at = self.clock()
        self.started_wall = time.time()
        self.last_probe = -1e18
        self.health_detail = "starting"

    def _kill(self) -> int | None:
        code = None
        if self.proc is not None:
            code = self.proc.stop(self.policy.stop_timeout_s)
            self.last_exit = code
        return code

    def _failed_run(self, what: str, exit_code: int | None = None, spawn_error: bool = False) -> None:
        cause = ""
        if self.proc is not None:
            if exit_code is None:
                self._kill()             # hung or load timeout: it is still running
            else:
                self.proc.stop(self.policy.stop_timeout_s)   # reap, and clear what its group left
                self.last_exit = exit_code
            # killed from outside (kill -9, OOM killer, TERM): its log only says what it was doing then
            if exit_code is None or exit_code >= 0 or -exit_code not in _KILLED_FROM_OUTSIDE:
                cause = self.proc.cause()
        self.last_error = what if spawn_error or not cause else f"{what}: {cause}"
        self.failures += 1
        if not self.ever_ready and self.policy.fail_fast:
            self.state = FAILED
            self.reason = f"failed to start: {self.last_error}"
        elif self.failures > self.policy.max_restarts:
            self.state = FAILED
            self.reason = (f"gave up after {self.restarts} restart(s), {self.failures} failed run(s) in a row; "
                           f"last: {self.last_error}")
        else:
            self.state = BACKOFF
            self.next_start_at = self.clock() + self.policy.backoff(self.failures)

    # --- what status shows -----------------------------------------------------------------------------------------
    def snapshot(self) -> dict:
        now = self.clock()
        running = self.proc is not None and self.state in (STARTING, READY)
        return {
            "name": self.spec.name,
            "state": self.state,
            "healthy": self.state == READY,
            "pid": self.proc.pid if running and self.proc is not None else None,
            "url": self.spec.connect_url,
            "restarts": self.restarts,
            "failures": self.failures,
            "last_error": self.last_error,
            "reason": self.reason,
            "health_detail": self.health_detail,
            "uptime_s": round(now - self.ready_at, 1) if self.state == READY else 0.0,
            "load_s": round(self.ready_at - self.started_at, 2) if self.state == READY else None,
            "spawned_wall": self.started_wall or None,
            "adopted": self.adopted and running,
            "retry_in_s": round(max(0.0, self.next_start_at - now), 1) if self.state == BACKOFF else None,
            "log": str(self.log_path),
        }
