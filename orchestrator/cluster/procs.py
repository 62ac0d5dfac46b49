"""The seam between the supervisor and real processes.

:class:`ProcessHandle` and :class:`Launcher` are the two small interfaces the supervisor uses; unit tests give
it fakes. :class:`LocalLauncher` is the real one used by worker actors: it starts a :class:`LaunchSpec` with
exactly its argv and env in a new session (its own process group) with stdout/stderr in a log file, and stops it
with TERM to the whole group, then KILL, and reaps it.

A worker actor that is killed outright (``kill -9``, OOM killer, a lost node) must not orphan llama-server: the
child is started through a tiny exec guard that sets ``PR_SET_PDEATHSIG`` (SIGTERM) and then ``exec``s the
spec's argv unchanged, so the pid, argv and environment of the running process are exactly the spec's. The
death signal fires when the *thread* that forked dies, so the supervisor spawns from one long-lived thread.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
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
        """TERM the process group, KILL it after ``timeout`` seconds, reap it; returns the exit status."""

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


def child_env(spec_env: Mapping[str, str], base: Mapping[str, str] | None = None,
              drop: tuple[str, ...] = ()) -> dict[str, str]:
    """The environment llama-server gets: ``base`` (this process's) minus ``drop``, plus the spec's variables."""
    env = dict(os.environ if base is None else base)
    for k in drop:
        env.pop(k, None)
    env.update(spec_env)
    return env


def resolve_executable(argv0: str, env: Mapping[str, str]) -> str | None:
    if os.sep in argv0:
        return argv0 if os.path.isfile(argv0) and os.access(argv0, os.X_OK) else None
    return shutil.which(argv0, path=env.get("PATH", os.defpath))


_ERR_LINE = re.compile(r"(^|\s)E\s|error|failed|couldn't|cannot|unable|out of memory|no such file|abort",
                       re.IGNORECASE)
# the most telling lines first: what the user must fix
_PRIORITY = ("no such file", "out of memory", "cudamalloc", "unable to allocate", "failed to allocate",
             "couldn't bind", "address already in use", "permission denied", "invalid", "unknown argument",
             "error:", "failed to open", "error loading model", "cannot run")
_TS = re.compile(r"^\s*\d+\.\d+\.\d+\.\d+\s+[A-Z]\s+")   # llama.cpp's "0.00.005.659 E " prefix


def cause_from_log(text: str) -> str:
    """The line (or two) of a llama-server log that says why it failed: the most specific error line, plus the
    final 'exiting due to ...' line when that adds something; '' when no line reports an error."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errs = [ln for ln in lines if _ERR_LINE.search(ln)]
    if not errs:
        return ""
    best = None
    for key in _PRIORITY:
        best = next((ln for ln in errs if key in ln.lower()), None)
        if best:
            break
    best = best or errs[0]
    last = errs[-1]
    out = [_TS.sub("", best)]
    if last != best and ("exiting" in last.lower() or "abort" in last.lower()):
        out.append(_TS.sub("", last))
    return " | ".join(s[:300] for s in out)


class LocalProcess:
    """A running spec: a Popen in its own session, its log file and where this run's log starts."""

    def __init__(self, popen: subprocess.Popen, log_path: Path, log_offset: int) -> None:
        self._p = popen
        self.pid = popen.pid
        self.log_path = log_path
        self._log_offset = log_offset

    def poll(self) -> int | None:
        return self._p.poll()

    def _signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def stop(self, timeout: float) -> int | None:
        if self._p.poll() is None:
            self._signal_group(signal.SIGTERM)
            try:
                self._p.wait(timeout)
            except subprocess.TimeoutExpired:
                self._signal_group(signal.SIGKILL)
                self._p.wait()
        # the leader is reaped; members it left in its group (a wrapper's children) get KILL too
        self._signal_group(signal.SIGKILL)
        return self._p.returncode

    def cause(self) -> str:
        try:
            with open(self.log_path, "rb") as f:
                size = f.seek(0, os.SEEK_END)
                start = max(self._log_offset, size - 65536)
                f.seek(start)
                text = f.read().decode("utf-8", "replace")
        except OSError:
            return ""
        return cause_from_log(text)


class LocalLauncher:
    """Starts specs on this machine. ``drop_env`` names inherited variables removed before ``spec.env`` is
    applied (worker actors drop the ones Ray injects)."""

    def __init__(self, drop_env: tuple[str, ...] = (), guard: bool = True) -> None:
        self.drop_env = drop_env
        self.guard = guard

    def start(self, spec: LaunchSpec, log_path: Path) -> LocalProcess:
        env = child_env(spec.env, drop=self.drop_env)
        exe = resolve_executable(spec.argv[0], env)
        if exe is None:
            raise LaunchError(f"worker {spec.name!r}: cannot run {spec.argv[0]!r}: not found or not executable")
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            offset = log.tell()
            log.write(f"=== orchestrator: start {time.strftime('%Y-%m-%d %H:%M:%S')} pid-parent={os.getpid()}: "
                      f"{spec.shell_line()}\n".encode())
            log.flush()
            argv = list(spec.argv)
            if self.guard:
                argv = [sys.executable, "-I", "-S", "-c", GUARD, str(os.getpid()), *argv]
            try:
                p = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True, close_fds=True)
            except OSError as e:
                raise LaunchError(f"worker {spec.name!r}: cannot start {spec.argv[0]!r}: {e.strerror}") from None
        return LocalProcess(p, log_path, offset)
