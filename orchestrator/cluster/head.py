"""The embedded Ray head that ``up`` starts when the topology says ``ray.address: local``.

It is ``ray start --head --block`` in a session of its own, with every port chosen up front (so it never collides
with another Ray on the machine), the dashboard and the node on 127.0.0.1, its own temp dir, and Ray's drain
delay off (our actors are stopped before the head). ``--block`` keeps one process that owns all the others:
TERM to it stops the GCS, raylet, dashboard and every actor; :func:`stop_head` then KILLs whatever of the
recorded process tree is still there, so nothing is left.

Token authentication: like ``ray.init()``, the embedded head uses Ray's token auth unless ``RAY_AUTH_MODE`` says
otherwise; when no token exists one is generated at Ray's default place (``~/.ray/auth_token``) with Ray's own
``ray get-auth-token --generate``, so ``ray`` CLI tools and the dashboard log-in use it too.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Collection, Mapping

from orchestrator.cluster.procs import same_start, started_since_boot
from orchestrator.errors import ClusterError

# heads started by this process: reaped in stop_head so they do not linger as zombies while we live on
_STARTED: dict[int, subprocess.Popen] = {}


@dataclass(frozen=True)
class HeadInfo:
    pid: int
    started: float                  # seconds since boot (procs.started_since_boot): tells a reused pid apart
    address: str            # host:port of the GCS
    temp_dir: str
    log_path: str
    dashboard_url: str
    metrics_port: int
    auth_mode: str


RAY_WORKER_PORTS_END = 19999   # Ray's workers take ports from 10002 to this (ray start's defaults)


def _ephemeral_low() -> int:
    """The lowest port the kernel hands to outgoing connections (Linux: ip_local_port_range)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1", avoid: Collection[int] = (), rng: random.Random | None = None) -> int:
    """A port nothing uses now and not in ``avoid`` (the ports already given to the same head: none is bound yet,
    so only this list tells them apart), for a server Ray starts in a moment. Taken between Ray's worker ports and
    the kernel's ephemeral range when there is room: a port the kernel picks from that range can be handed to an
    outgoing connection between this check and the server's bind (seen: Ray's GCS refused with 'Address already
    in use')."""
    low = _ephemeral_low()
    if low > RAY_WORKER_PORTS_END + 2000:
        rng = rng or random.Random()
        for _ in range(64):
            port = rng.randrange(RAY_WORKER_PORTS_END + 1, low)
            if port not in avoid and port_problem(host, port) is None and not _connects(host, port):
                return port
    for _ in range(64):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port not in avoid:
            return port
    raise ClusterError(f"no free port on {host} for the Ray head")


def port_problem(host: str, port: int) -> str | None:
    """None when ``host:port`` can be listened on here, else the OS's reason."""
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(fam, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            return e.strerror or str(e)
    return None


def check_port(host: str, port: int, label: str) -> None:
    """ClusterError naming ``label`` and, when it listens here, the process that holds ``host:port``."""
    from orchestrator.cluster.procs import listener_on

    why = port_problem(host, port)
    if why:
        who = listener_on(host, port)
        raise ClusterError(f"{label}: cannot listen on {host}:{port}: {why}" + (f" (held by {who})" if who else ""))


def ensure_auth() -> str:
    """The auth mode for a new embedded head; generates the token when token auth is on and none exists."""
    from orchestrator.cluster.ray_api import token_available, token_path

    mode = os.environ.get("RAY_AUTH_MODE", "token").lower()
    if mode == "token" and not token_available():
        res = subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "get-auth-token", "--generate"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=120)
        if res.returncode != 0 or not token_available():
            raise ClusterError("ray: cannot create a Ray auth token with `ray get-auth-token --generate`: "
                               f"{(res.stderr or '').strip().splitlines()[-1:] or ['no output']}"
                               " (or set RAY_AUTH_MODE=disabled)")
    if mode == "token":
        _private_file(token_path())
    return mode


def _private_file(path: Path) -> None:
    """A secret of ours (Ray writes its token world-readable): owner only."""
    try:
        if path.is_file() and path.stat().st_uid == os.getuid() and path.stat().st_mode & 0o077:
            os.chmod(path, 0o600)
    except OSError:
        pass


_LOG_ERR = re.compile(r"(error|exception|failed|already in use|address in use|refused)", re.IGNORECASE)


def _log_cause(path: Path) -> str:
    try:
        lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    errs = [ln for ln in lines if _LOG_ERR.search(ln) and not ln.startswith(("File ", "Traceback"))]
    return (errs[-1] if errs else (lines[-1] if lines else ""))[:300]


def start_head(*, node_name: str, gcs_port: int | None, dashboard_host: str, dashboard_port: int,
               metrics_port: int | None, log_dir: Path, timeout: float = 120.0,
               on_spawn: Callable[[HeadInfo], None] | None = None,
               ray_env: Mapping[str, str] | None = None) -> HeadInfo:
    """Start the head and wait until its GCS answers; ClusterError with Ray's own reason when it does not.
    ``on_spawn`` is called with the head's identity as soon as its process exists (to record it, so that a
    ``down`` finds it even if the caller dies while the head is still starting). ``ray_env``: Ray's own start-up
    waits (StartLimits.ray_env); a variable the user set already is left as it is."""

    host = "127.0.0.1"
    taken = {dashboard_port, *(p for p in (gcs_port, metrics_port) if p)}

    def pick() -> int:                  # Ray refuses one port given to two of its components
        port = free_port(host, taken)
        taken.add(port)
        return port

    gcs_port = gcs_port or pick()
    metrics_port = metrics_port or pick()
    check_port(host, gcs_port, "ray.port")
    check_port(dashboard_host, dashboard_port, "ray.dashboard_port")
    check_port(host, metrics_port, "ray.metrics_export_port")
    mode = ensure_auth()
    # Ray's socket paths must stay short (AF_UNIX limit): a short temp dir in /tmp, not under the state dir.
    # Ray makes its temp dir world-writable (again and again, as its processes start): it goes inside a folder of
    # ours that stays owner-only, so nobody else reaches Ray's sockets, logs or session files
    temp_dir = os.path.join(tempfile.mkdtemp(prefix="orch-ray-", dir="/tmp"), "r")
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / "ray-head.log"
    argv = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block",
            "--node-ip-address", host, "--port", str(gcs_port), "--node-name", node_name,
            "--temp-dir", temp_dir, "--disable-usage-stats",
            "--include-dashboard", "true", "--dashboard-host", dashboard_host, "--dashboard-port", str(dashboard_port),
            "--metrics-export-port", str(metrics_port),
            "--ray-client-server-port", str(pick()), "--dashboard-agent-listen-port", str(pick()),
            "--dashboard-agent-grpc-port", str(pick()), "--runtime-env-agent-port", str(pick()),
            "--node-manager-port", str(pick()), "--object-manager-port", str(pick())]
    # Ray workers (our actors) must import this very orchestrator, installed or not
    from orchestrator.paths import pythonpath_with_package

    env = dict(os.environ, PYTHONPATH=pythonpath_with_package(), RAY_AUTH_MODE=mode, RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0",
               RAY_metrics_report_interval_ms=os.environ.get("RAY_metrics_report_interval_ms", "5000"))
    for k, v in (ray_env or {}).items():
        env.setdefault(k, v)
    with open(log_path, "wb") as log:  # one head per namespace: this run's log only
        p = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True, close_fds=True)
    _STARTED[p.pid] = p
    info = HeadInfo(pid=p.pid, started=started_since_boot(p.pid), address=f"{host}:{gcs_port}", temp_dir=temp_dir,
                    log_path=str(log_path), dashboard_url=f"http://{dashboard_host}:{dashboard_port}",
                    metrics_port=metrics_port, auth_mode=mode)
    if on_spawn is not None:
        try:
            on_spawn(info)
        except BaseException:
            stop_head(info.pid, info.started, temp_dir)
            raise
    deadline = time.monotonic() + timeout
    try:
        while True:
            code = p.poll()
            if code is not None:
                raise ClusterError(f"ray: the embedded Ray head exited ({code}) while starting: "
                                   f"{_log_cause(log_path)} (log: {log_path})")
            if _started(log_path) and _connects(host, gcs_port):
                return info
            if time.monotonic() > deadline:
                where = _component_cause(temp_dir)
                raise ClusterError(f"ray: the embedded Ray head did not start within {timeout:g}s "
                                   f"({where + '; ' if where else ''}log: {log_path}); "
                                   "a slow machine may need a longer ray.start_timeout")
            time.sleep(0.25)
    except BaseException:       # failed, or Ctrl-C while it starts: nothing of it stays
        stop_head(info.pid, info.started, temp_dir)
        raise


RAY_COMPONENT_LOGS = ("gcs_server.err", "gcs_server.out", "raylet.err", "raylet.out")


def _component_cause(temp_dir: str) -> str:
    """Where a head that did not start stopped, from Ray's own logs before its temp dir goes: the last error (or
    last line) of the component log written last, named; "" when there is none."""
    logs = Path(temp_dir) / "session_latest" / "logs"
    found = []
    for name in RAY_COMPONENT_LOGS:
        try:
            found.append(((logs / name).stat().st_mtime, name))
        except OSError:
            pass
    for _mtime, name in sorted(found, reverse=True):
        if cause := _log_cause(logs / name):
            return f"{name}: {cause}"
    return "no GCS or raylet log yet" if not found else ""


def _started(log_path: Path) -> bool:
    try:
        text = log_path.read_bytes()
    except OSError:
        return False
    return b"Ray runtime started" in text and b"--block" in text[text.rfind(b"Ray runtime started"):]


def _connects(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


def head_tree(pid: int, started: float | None):
    """The head process and all its descendants (psutil.Process list); empty when it is gone or the pid was
    reused by another process."""
    import psutil

    try:
        p = psutil.Process(pid)
        if not same_start(pid, started):
            return []
        if p.status() == psutil.STATUS_ZOMBIE:
            return []
        return [p] + p.children(recursive=True)
    except psutil.Error:
        return []


def _wait_gone(procs: list, timeout: float) -> list:
    """Wait until every process has exited (a zombie has: only its parent's bookkeeping is left); returns the
    ones still running after ``timeout``."""
    import psutil

    deadline = time.monotonic() + timeout
    while True:
        for pid, popen in list(_STARTED.items()):
            if popen.poll() is not None:
                del _STARTED[pid]
        alive = []
        for p in procs:
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
            except psutil.Error:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


def stop_head(pid: int, started: float | None, temp_dir: str | None = None, timeout: float = 30.0) -> list[str]:
    """TERM the head (it stops all its processes), KILL what is left of its tree; returns what had to be
    killed. Ray's own processes carry the temp dir on their command line: those are collected too."""
    import psutil

    procs = {p.pid: p for p in head_tree(pid, started)}
    if temp_dir:
        for p in psutil.process_iter(["cmdline"]):
            try:
                if any(temp_dir in a for a in (p.info["cmdline"] or [])):
                    procs.setdefault(p.pid, p)
                    for c in p.children(recursive=True):
                        procs.setdefault(c.pid, c)
            except psutil.Error:
                continue
    if not procs:
        _remove_temp_dir(temp_dir)       # the head died by itself (its raylet killed): its files still go
        return []
    try:
        if pid in procs:
            os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    alive = _wait_gone(list(procs.values()), timeout)
    killed = []
    for p in alive:
        try:
            killed.append(f"{p.pid} ({p.name()})")
            p.kill()
        except psutil.Error:
            pass
    _wait_gone(alive, 5)
    _remove_temp_dir(temp_dir)
    return killed


def _remove_temp_dir(temp_dir: str | None) -> None:
    if not temp_dir:
        return
    parent = os.path.dirname(temp_dir)
    if os.path.basename(parent).startswith("orch-ray-"):
        shutil.rmtree(parent, ignore_errors=True)
    elif os.path.basename(temp_dir).startswith("orch-ray-"):     # recorded before the private parent
        shutil.rmtree(temp_dir, ignore_errors=True)
