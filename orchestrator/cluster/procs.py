"""The seam between the supervisor and real processes.

:class:`ProcessHandle` and :class:`Launcher` are the two small interfaces the supervisor uses; unit tests give
it fakes. :class:`LocalLauncher` is the real one used by worker actors: it runs a :class:`LaunchSpec` through
:mod:`orchestrator.launch.process` (exactly its argv and env, its own process group, output in a log file;
stop = TERM to the leader, KILL to the group after the grace period, reaped; the failure reason read from the
log).

A worker actor that is killed outright (``kill -9``, OOM killer, a lost node) must not orphan llama-server: the
child is started through a tiny exec guard that sets ``PR_SET_PDEATHSIG`` (SIGTERM) and then ``exec``s the
spec's argv unchanged, so the pid, argv and environment of the running process are exactly the spec's. The
death signal fires when the *thread* that forked dies, so the supervisor spawns from one long-lived thread.
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import replace
from pathlib import Path
from typing import Mapping, Protocol

from orchestrator.errors import LaunchError
from orchestrator.launch.spec import LaunchSpec


class ProcessHandle(Protocol):
    """One started process (a whole process group)."""

    pid: int
    log_path: Path

    def poll(self) -> int | None:
        """The exit status (negative: killed by that signal) once it exited, else None. Never blocks."""

    def stop(self, timeout: float) -> int | None:
        """TERM (to the group leader: a wrapper forwards it), KILL to the group after ``timeout`` seconds, reap;
        returns the exit status."""

    def cause(self) -> str:
        """One line from this run's log that explains why it failed ('' when the log says nothing useful)."""


class Launcher(Protocol):
    def start(self, spec: LaunchSpec, log_path: Path) -> ProcessHandle:
        """Start ``spec``; raise :class:`LaunchError` when it cannot even be started (binary missing)."""


# --- the exec guard --------------------------------------------------------------------------------------------
# Runs as `python -I -S -c GUARD <parent pid> argv...`: asks the kernel to TERM it when its parent thread dies,
# exits at once if the parent is already gone, then becomes the spec's process (same pid) with execvp.
GUARD = (
    "import ctypes,os,sys\n"
    "ctypes.CDLL(None,use_errno=True).prctl(1,15,0,0,0)\n"
    "if os.getppid()!=int(sys.argv[1]):os._exit(143)\n"
    "try:os.execvp(sys.argv[2],sys.argv[2:])\n"
    "except OSError as e:sys.stderr.write('E cannot run %s: %s\\n'%(sys.argv[2],e.strerror));os._exit(127)\n"
)

# Variables that Ray sets in an actor's process (its own GPU assignment, OMP threads) and that must not leak into
# llama-server: the plan sets what it wants in spec.env explicitly.
RAY_INJECTED_ENV = ("CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES",
                    "ONEAPI_DEVICE_SELECTOR", "NEURON_RT_VISIBLE_CORES", "TPU_VISIBLE_CHIPS")


def started_since_boot(pid: int) -> float:
    """When process ``pid`` started, in seconds since boot (``starttime`` of ``/proc/PID/stat``).

    A process's identity across processes is its pid plus this. The wall-clock start time (psutil's
    ``create_time``) is boot time plus this, and the boot time moves whenever the wall clock is stepped (NTP, a
    VM resumed): two processes reading it a moment apart can disagree by seconds, and a live process would look
    like a reused pid. Raises psutil.NoSuchProcess when it is gone."""
    import psutil

    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        raise psutil.NoSuchProcess(int(pid)) from None
    except OSError:             # no procfs: psutil's wall time is the best there is
        return psutil.Process(int(pid)).create_time()
    fields_after_comm = stat[stat.rindex(b")") + 2:].split()   # comm may hold spaces and parentheses
    return int(fields_after_comm[19]) / os.sysconf("SC_CLK_TCK")


def same_start(pid: int, recorded: float | None) -> bool:
    """Process ``pid`` is the one that started at ``recorded`` (:func:`started_since_boot`), not a reused pid.
    ``recorded`` None: unknown, trusted. A recorded wall-clock time (older records) is compared to psutil's
    ``create_time`` with a second of slack. Raises psutil.NoSuchProcess when it is gone."""
    import psutil

    if recorded is None:
        return True
    recorded = float(recorded)
    if recorded > 1e9:          # seconds since the epoch, not since boot
        return abs(psutil.Process(int(pid)).create_time() - recorded) <= 1.0
    return abs(started_since_boot(pid) - recorded) <= 0.02


def server_env(key: str | None) -> dict[str, str]:
    """What every llama-server of a deployment gets on top of its spec: the deployment's own key (it then answers
    only requests that carry it, which the gateway adds; ``/health`` stays open for the probes) and CORS for
    localhost origins only (its default echoes any ``Origin``). Through the environment, not the command line that
    ``ps`` shows everyone; a build that does not read these variables runs as before."""
    env = {"LLAMA_ARG_CORS_ORIGINS": "localhost"}
    if key:
        env["LLAMA_API_KEY"] = key
    return env


_ANY = ("0.0.0.0", "::", "")


def listener_on(host: str, port: int) -> str | None:
    """Who listens on ``host:port`` here ('pid 4242 (llama-server)', 'another process'), None when nobody does.

    Only a socket in LISTEN counts. A bind test would also trip over what a crashed server leaves behind
    (its connections in TIME-WAIT / FIN-WAIT-2 for a minute), which does not stop llama-server from binding
    again (it sets SO_REUSEADDR, ik_llama.cpp's SO_REUSEPORT) but would stop us from restarting it.
    """
    import psutil

    want = {host.strip("[]")}
    for c in psutil.net_connections(kind="tcp"):
        if c.status != psutil.CONN_LISTEN or not c.laddr or c.laddr.port != port:
            continue
        if c.laddr.ip in _ANY or host.strip("[]") in _ANY or c.laddr.ip in want or \
                (c.laddr.ip == "::ffff:" + host):
            if c.pid:
                try:
                    return f"pid {c.pid} ({psutil.Process(c.pid).name()})"
                except psutil.Error:
                    return f"pid {c.pid}"
            return "another process"
    return None


def resolve_executable(argv0: str, env: Mapping[str, str]) -> str | None:
    if os.sep in argv0:
        return argv0 if os.path.isfile(argv0) and os.access(argv0, os.X_OK) else None
    return shutil.which(argv0, path=env.get("PATH", os.defpath))


class _Handle:
    """:class:`ProcessHandle` over :class:`orchestrator.launch.process.WorkerProcess`."""

    def __init__(self, wp) -> None:
        self.wp = wp
        self.pid = wp.pid
        self.log_path = wp.log_path

    def poll(self) -> int | None:
        return self.wp.poll()

    def stop(self, timeout: float) -> int | None:
        return self.wp.stop(grace=timeout)

    def cause(self) -> str:
        return self.wp.failure_cause()


class LocalLauncher:
    """Starts specs on this machine with :func:`orchestrator.launch.process.start` (own process group, log
    file, TERM to the leader then KILL to the group, llama-server's reason from the log). ``drop_env`` names
    inherited variables removed before ``spec.env`` is applied (worker actors drop the ones Ray injects);
    ``guard`` puts the parent-death exec guard in front of the argv; ``extra_env`` is set on top of the spec's
    environment (the deployment's key for llama-server: in the environment, not on a command line ``ps`` shows)."""

    def __init__(self, drop_env: tuple[str, ...] = (), guard: bool = True,
                 extra_env: Mapping[str, str] | None = None) -> None:
        self.drop_env = drop_env
        self.guard = guard
        self.extra_env = dict(extra_env or {})   # added after spec.env: the deployment's llama-server key

    def start(self, spec: LaunchSpec, log_path: Path) -> _Handle:
        from orchestrator.launch.process import start
        from orchestrator.launch.wrappers import localize_argv

        argv = localize_argv(spec.argv)
        env = {k: v for k, v in os.environ.items() if k not in self.drop_env}
        env.update(spec.env)
        env.update(self.extra_env)
        if resolve_executable(argv[0], env) is None:
            raise LaunchError(f"worker {spec.name!r}: cannot run {argv[0]!r}: not found or not executable")
        run = replace(spec, argv=(sys.executable, "-I", "-S", "-c", GUARD, str(os.getpid()), *argv)) \
            if self.guard else spec
        if self.extra_env:
            run = replace(run, env={**run.env, **self.extra_env})
        # the supervisor checks for a listener itself (listener_on): a bind test refuses a restart while the
        # crashed server's connections linger
        # cwd: the log's folder, where ik_llama.cpp's server also drops its llama.log (the plan's paths are absolute)
        wp = start(run, log_path, drop_env=self.drop_env, check_port=False, cwd=log_path.parent)
        wp.argv = tuple(argv)      # what runs after the guard's exec: names in messages, the balancing clean-up
        return _Handle(wp)
