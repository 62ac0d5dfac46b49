"""Run a :class:`LaunchSpec` as a real process, wait until it serves, stop it without leaving anything behind.

Used by the Ray worker actor and by the benchmarks:

    proc = start(spec, log_path)          # own process group, output appended to log_path
    proc.wait_healthy(timeout=600)        # GET /health == 200, or LaunchError with llama-server's reason
    ...
    proc.stop()                           # SIGTERM, grace period, SIGKILL to the group, reaped

or ``with launch(spec, log_path, timeout=600) as proc: ...``.

Stopping sends SIGTERM to the group *leader* first, not to the whole group: the leader is either llama-server
itself (numactl execs it) or ``disable-numa-balancing.sh``, which forwards the signal to its child. A signal to
the whole group would reach llama-server twice, and llama-server treats a second SIGTERM/SIGINT as "exit(1)
now". Whatever is still in the group after the grace period gets SIGKILL.
"""

from __future__ import annotations

import errno
import http.client
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Sequence
from urllib.parse import urlsplit

from orchestrator.errors import LaunchError
from orchestrator.launch.spec import LaunchSpec
from orchestrator.launch.wrappers import BALANCING_SCRIPT, localize_argv

HEALTH_PATH = "/health"
LOG_TAIL_BYTES = 256 * 1024

# --- reading the reason out of a log -------------------------------------------------------------------

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
# llama.cpp's log prefix: "0.00.006.333 E " (time, level letter) — present with timestamps on, as in servers
_PREFIX = re.compile(r"^\s*(?:\d+\.\d+\.\d+\.\d+\s+)?([EWIDT])\s+(?=\S)")
_KEYWORDS = re.compile(
    r"error|failed|failure|unable|cannot|can't|couldn't|could not|out of memory|\boom\b|invalid|exception|"
    r"terminate called|what\(\)|abort|no such file|not found|denied|unknown argument|segmentation fault|"
    r"bad alloc|bad_alloc|panic|fatal", re.IGNORECASE)
# lines that only repeat that something failed, without saying what
_GENERIC = re.compile(
    r"failed to load model\s*$|cleaning up before exit|encountered an error while trying to fit params|"
    r"failed to load model, '|failed to load model '", re.IGNORECASE)


def _level_and_text(line: str) -> tuple[str | None, str]:
    line = _ANSI.sub("", line).strip()
    m = _PREFIX.match(line)
    if m:
        return m.group(1), " ".join(line[m.end():].split())
    return None, " ".join(line.split())


def log_cause(path: str | os.PathLike, offset: int = 0, *, max_lines: int = 3, max_chars: int = 600) -> str:
    """The most telling lines of a failed run's log (from byte ``offset``), joined on one line.

    Error lines (llama.cpp's ``E`` level, or lines that say error/failed/out of memory/...) are kept in order,
    without repeats; lines that only say "failed to load model" are dropped when a more precise one exists.
    The first precise ones and the very last error line are returned; without any error line, the last
    non-empty lines. Empty string when the log is empty or unreadable.
    """
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            end = f.tell()
            start = max(offset, end - LOG_TAIL_BYTES)
            f.seek(start)
            data = f.read()
    except OSError:
        return ""
    lines = data.decode("utf-8", "replace").splitlines()
    if start > offset and lines:
        lines = lines[1:]                                   # the first line is cut
    texts: list[str] = []
    errors: list[str] = []
    seen: set[str] = set()
    for raw in lines:
        level, text = _level_and_text(raw)
        if not text or text.startswith("# orchestrator:"):
            continue
        texts.append(text)
        is_error = level == "E" or (level in (None, "W") and _KEYWORDS.search(text) is not None)
        if is_error and text not in seen:
            seen.add(text)
            errors.append(text)
    if errors:
        precise = [t for t in errors if not _GENERIC.search(t)]
        chosen = precise[: max_lines - 1] if precise else []
        if errors[-1] not in chosen:
            chosen.append(errors[-1])
        chosen = chosen[:max_lines]
    else:
        chosen = texts[-max_lines:]
    out = " | ".join(chosen)
    return out if len(out) <= max_chars else out[: max_chars - 3] + "..."


# --- process groups ------------------------------------------------------------------------------------

def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes whose process group is ``pgid``, from /proc."""
    out = []
    try:
        names = os.listdir("/proc")
    except OSError:  # pragma: no cover - Linux always has /proc
        return out
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read().decode("ascii", "replace")
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        # fields: state ppid pgrp ...
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] not in ("Z", "X"):
            out.append(int(name))
    return sorted(out)


def killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _describe_status(rc: int) -> str:
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    if rc > 128:
        try:
            return f"status {rc} ({signal.Signals(rc - 128).name})"
        except ValueError:
            pass
    return f"status {rc}"


def check_port_free(host: str, port: int) -> None:
    """LaunchError when nothing can listen on ``host:port`` here (taken, or not a local address)."""
    bind_host = {"": "0.0.0.0", "[::]": "::"}.get(host, host.strip("[]"))
    try:
        infos = socket.getaddrinfo(bind_host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise LaunchError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    family, socktype, proto, _canon, addr = infos[0]
    with socket.socket(family, socktype, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise LaunchError(f"port {port} on {host} is already in use (choose another port or stop "
                                  f"what listens there)") from None
            raise LaunchError(f"cannot listen on {host}:{port}: {e.strerror}") from None


# --- the process ---------------------------------------------------------------------------------------

class WorkerProcess:
    """One started :class:`LaunchSpec`: a process group led by ``argv[0]``, its output in ``log_path``."""

    def __init__(self, spec: LaunchSpec, popen: subprocess.Popen, log_path: Path, log_offset: int,
                 argv: Sequence[str] | None = None):
        self.spec = spec
        self.argv = tuple(argv if argv is not None else spec.argv)   # what was run (wrapper paths localized)
        self.log_path = log_path
        self.log_offset = log_offset                        # where this run's output starts in the log
        self._popen = popen
        self.started_at = time.monotonic()
        u = urlsplit(spec.connect_url)
        self._host, self._port = u.hostname or "127.0.0.1", u.port or spec.port

    # -- state --------------------------------------------------------------------------------------------

    @property
    def pid(self) -> int:
        return self._popen.pid

    @property
    def pgid(self) -> int:
        return self._popen.pid                              # start_new_session: the leader's pid

    @property
    def returncode(self) -> int | None:
        return self._popen.returncode

    def poll(self) -> int | None:
        return self._popen.poll()

    def running(self) -> bool:
        return self._popen.poll() is None

    def members(self) -> list[int]:
        """Live pids in the worker's process group (wrapper, llama-server, anything they started)."""
        return group_members(self.pgid)

    def failure_cause(self) -> str:
        """The telling lines of this run's part of the log (see :func:`log_cause`)."""
        return log_cause(self.log_path, self.log_offset)

    cause = failure_cause                                   # the name cluster's ProcessHandle protocol uses

    # -- health -------------------------------------------------------------------------------------------

    def health(self, timeout: float = 2.0) -> int | None:
        """HTTP status of ``GET /health`` (200 ready, 503 loading), or None when nothing answers."""
        conn = http.client.HTTPConnection(self._host, self._port, timeout=timeout)
        try:
            conn.request("GET", HEALTH_PATH)
            resp = conn.getresponse()
            resp.read()
            return resp.status
        except (OSError, http.client.HTTPException):
            return None
        finally:
            conn.close()

    def healthy(self, timeout: float = 2.0) -> bool:
        return self.running() and self.health(timeout) == 200

    def wait_healthy(self, timeout: float, *, interval: float = 0.1, grace: float = 5.0) -> float:
        """Wait until ``GET /health`` answers 200; returns the seconds since start.

        Raises :class:`LaunchError` (after stopping what is left of the group) when the process exits first —
        with the reason from its log — or when ``timeout`` seconds pass.
        """
        deadline = time.monotonic() + timeout
        last: int | None = None
        name = self.spec.name
        while True:
            rc = self.poll()
            if rc is not None:
                cause = self.failure_cause() or "(nothing in the log)"
                self.stop(grace=grace)
                raise LaunchError(f"worker {name}: {Path(self._server_name()).name} exited with "
                                  f"{_describe_status(rc)} before it was ready: {cause} (log: {self.log_path})")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            last = self.health(timeout=min(2.0, max(0.1, remaining)))
            if last == 200 and self.poll() is None:
                return time.monotonic() - self.started_at
            time.sleep(min(interval, max(0.0, deadline - time.monotonic())))
            interval = min(interval * 1.5, 1.0)
        cause = self.failure_cause()
        self.stop(grace=grace)
        got = "no answer" if last is None else f"last answer {last}"
        raise LaunchError(f"worker {name}: {self.spec.connect_url}{HEALTH_PATH} did not answer 200 within "
                          f"{timeout:g} s ({got}); stopped it. Last log lines: {cause or '(none)'} "
                          f"(log: {self.log_path})")

    def _server_name(self) -> str:
        """The server binary's name in argv (after the wrappers), for messages."""
        argv = list(self.argv)
        if argv and Path(argv[0]).name == BALANCING_SCRIPT:
            argv = argv[1:]
        if argv and Path(argv[0]).name == "numactl" and "--" in argv:
            argv = argv[argv.index("--") + 1:]
        return argv[0] if argv else "process"

    # -- stopping -----------------------------------------------------------------------------------------

    def stop(self, grace: float = 10.0) -> int | None:
        """SIGTERM to the leader, up to ``grace`` s to exit, then SIGKILL to the group; reaped. Idempotent.

        Returns the leader's exit status (negative = killed by that signal).
        """
        killed = False
        if self._popen.poll() is None:
            try:
                os.kill(self.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self._popen.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                killpg(self.pgid, signal.SIGKILL)
                killed = True
                self._popen.wait()
        left = group_members(self.pgid)
        if left:                                          # the leader is gone, something it started is not
            killpg(self.pgid, signal.SIGTERM)
            deadline = time.monotonic() + min(grace, 5.0)
            while left and time.monotonic() < deadline:
                time.sleep(0.05)
                left = group_members(self.pgid)
            if left:
                killpg(self.pgid, signal.SIGKILL)
                killed = True
                deadline = time.monotonic() + 10.0
                while group_members(self.pgid) and time.monotonic() < deadline:
                    time.sleep(0.05)
        if killed or (self._popen.returncode or 0) < 0:
            self._restore_balancing()                     # the leader died without running its exit handler
        return self._popen.returncode

    def _restore_balancing(self) -> None:
        """A balancing wrapper killed with SIGKILL could not restore: let its --cleanup do it (it restores
        only when no other live worker still needs balancing off)."""
        script = self.argv[0] if self.argv else ""
        if Path(script).name != BALANCING_SCRIPT:
            return
        env = {**os.environ, **self.spec.env}
        try:
            with open(self.log_path, "ab") as log:
                subprocess.run([script, "--cleanup"], env=env, stdin=subprocess.DEVNULL, stdout=log,
                               stderr=subprocess.STDOUT, timeout=30, check=False)
        except (OSError, subprocess.SubprocessError):
            pass

    def __enter__(self) -> "WorkerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.running() else f"exited {self.returncode}"
        return f"WorkerProcess({self.spec.name!r}, pid={self.pid}, {state}, log={str(self.log_path)!r})"


def start(spec: LaunchSpec, log_path: str | os.PathLike, *, cwd: str | os.PathLike | None = None,
          check_port: bool = True, drop_env: Sequence[str] = ()) -> WorkerProcess:
    """Start ``spec`` in its own process group; stdout and stderr are appended to ``log_path``.

    The environment is this process's, minus the names in ``drop_env`` (say, what Ray injects into an actor:
    ``CUDA_VISIBLE_DEVICES``, ``OMP_NUM_THREADS``), with ``spec.env`` on top; stdin is /dev/null. With
    ``check_port``, a port that is already taken is a :class:`LaunchError` before anything runs (a server already
    answering there would otherwise look like ours).
    """
    argv: Sequence[str] = localize_argv(spec.argv)
    if not argv:
        raise LaunchError(f"worker {spec.name}: empty argv")
    if check_port:
        try:
            check_port_free(spec.host, spec.port)
        except LaunchError as e:
            raise LaunchError(f"worker {spec.name}: {e}") from None
    log_path = Path(log_path)
    env = {k: v for k, v in os.environ.items() if k not in drop_env}
    env.update({str(k): str(v) for k, v in spec.env.items()})
    try:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(log_path, "ab", buffering=0)
    except OSError as e:
        raise LaunchError(f"worker {spec.name}: cannot write its log {log_path}: {e.strerror}") from None
    with log:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        log.write(f"# orchestrator: {stamp} starting worker {spec.name}: {spec.shell_line()}\n".encode())
        offset = log.tell()
        try:
            popen = subprocess.Popen(list(argv), env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=log,
                                     stderr=subprocess.STDOUT, start_new_session=True, close_fds=True)
        except FileNotFoundError:
            raise LaunchError(f"worker {spec.name}: cannot run {argv[0]}: no such file "
                              f"(is it installed and on PATH?)") from None
        except PermissionError:
            raise LaunchError(f"worker {spec.name}: cannot run {argv[0]}: permission denied "
                              f"(not executable?)") from None
        except OSError as e:
            raise LaunchError(f"worker {spec.name}: cannot run {argv[0]}: {e.strerror}") from None
    return WorkerProcess(spec, popen, log_path, offset, argv)


def launch(spec: LaunchSpec, log_path: str | os.PathLike, *, timeout: float, grace: float = 10.0,
           cwd: str | os.PathLike | None = None, drop_env: Sequence[str] = ()) -> WorkerProcess:
    """:func:`start` then :meth:`WorkerProcess.wait_healthy`; on any failure nothing is left running."""
    proc = start(spec, log_path, cwd=cwd, drop_env=drop_env)
    try:
        proc.wait_healthy(timeout, grace=grace)
    except BaseException:
        proc.stop(grace=grace)
        raise
    return proc
