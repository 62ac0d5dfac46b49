"""A deployment's life after the plan, where it meets Ray, the disk and the terminal: the steps ``up``'s phases
(``startup.py``, which only puts them in order and undoes them) are made of, then serving until stopped,
``status`` and ``down``.

- :class:`EarlyHead`: the embedded Ray head started in the background while the model is pulled and read;
- :func:`wait_ready`: until every worker is healthy and the gateway serves, or one fails (then with
  llama-server's own reason);
- :func:`serve_until_stopped` and :func:`stop_from_foreground`: a foreground ``up`` waits for Ctrl-C, SIGTERM,
  SIGHUP, its output pipe closing (or a ``down`` from elsewhere) and then runs ``down``: every way of stopping it
  runs the same clean stop, and a second signal while it stops never cuts that short
  (:class:`orchestrator.sigutil.StopSignals`).

Exit status of a foreground ``up`` (:attr:`UpResult.exit_code`): 0 when the stop was asked for (Ctrl-C,
SIGTERM, ``orchestrator down``); 129 (128 + SIGHUP) when the terminal hung up; 141 (128 + SIGPIPE) when the
pipe its output went into closed; 1 when the Ray head vanished or the stop itself failed. Interrupted while
starting, ``up`` undoes what it started and exits 128 + the signal's number (130 for Ctrl-C, 143 for SIGTERM).

``down`` asks the controller to stop every llama-server and the gateway, kills the actors, stops the embedded
head and KILLs anything of its process tree that is left, and removes the state file.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import stat
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from orchestrator.cluster import head as headmod
from orchestrator.cluster import state as statemod
from orchestrator.cluster.deployment import Deployment, StartLimits
from orchestrator.errors import ClusterError, ConfigError, LaunchError
from orchestrator.sigutil import StopSignals

CONTROLLER = "controller"
CONTROLLER_RESTARTS = 3     # Ray restarts a crashed controller; it starts the deployment again
POLL_S = 0.2


@dataclass
class UpResult:
    namespace: str
    gateway_url: str
    dashboard_url: str | None
    metrics_url: str | None
    ray_address: str
    status: dict
    seconds_to_ready: float
    stopped: bool = False          # foreground: the deployment was stopped before returning
    exit_code: int = 0             # foreground: see the module docstring


@dataclass
class DownResult:
    namespace: str
    workers: list[dict] = field(default_factory=list)
    head_stopped: bool = False
    killed: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def say_default(msg: str) -> None:
    try:
        print(msg, file=sys.stderr, flush=True)
    except (BrokenPipeError, OSError, ValueError):
        # the reader of our output is gone (`up | tee` after tee died): the stop still runs; later messages and
        # the interpreter's last flush go nowhere instead of raising
        _silence_stderr()


_OUTPUT_LOST = False     # a message of ours hit a closed pipe: the foreground stop treats it like a closed output


def _silence_stderr() -> None:
    global _OUTPUT_LOST
    _OUTPUT_LOST = True
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        os.close(devnull)
    except OSError:
        pass
    try:
        sys.stderr = open(os.devnull, "w")
    except OSError:
        pass


def api_key(dep: Deployment) -> str | None:
    if dep.api_key_env is None:
        return None
    key = os.environ.get(dep.api_key_env)
    if not key:
        raise ConfigError(f"gateway.api_key_env: the environment variable {dep.api_key_env} is not set (or empty)")
    return key


def _head_alive(st: statemod.ClusterState) -> bool:
    return bool(st.head_pid and headmod.head_tree(st.head_pid, st.head_started))


def check_not_running(namespace: str, own_early_head: bool = False) -> None:
    """ClusterError when a deployment of ``namespace`` runs already; a stale record (its head gone) is removed.
    ``own_early_head``: the record may be this process's own early head."""
    old = statemod.read(namespace)
    if old is None or (own_early_head and old.up_pid == os.getpid()):
        return
    if old.embedded and not _head_alive(old):
        statemod.remove(namespace)          # a stale record: its head is gone
        return
    raise ClusterError(f"deployment {namespace!r} is already running (gateway {old.gateway_url}); "
                       f"run `orchestrator down` first (state: {statemod.state_path(namespace)})")


def embedded_node_name(dep: Deployment) -> str:
    nodes = {s.node for s in dep.specs if s.node is not None}
    if len(nodes) > 1:
        raise ConfigError(f"ray.address: 'local' runs everything on this machine, but the workers name the nodes "
                          f"{', '.join(sorted(nodes))}; point ray.address at a Ray cluster that has them")
    return nodes.pop() if nodes else "local"


def deployment_log_dir(log_dir: str | None, namespace: str) -> Path:
    """Where the deployment's logs go: ``log_dir``, else <state_dir>/logs/<namespace>."""
    from orchestrator.paths import state_dir

    return Path(log_dir) if log_dir else state_dir() / "logs" / statemod.check_namespace(namespace)


class EarlyHead:
    """The embedded Ray head, started in a background thread once the plan is made (the head takes seconds to
    start; pulling and reading the model, the warm-up and the early llama-servers run meanwhile).
    :func:`start_early_head` makes one only when ``up`` will surely need it; ``up(..., early=...)`` takes it
    over, and :meth:`abandon` stops it when a later phase fails. It records itself in the state file as soon as
    the head runs, so ``down`` finds it whatever happens next."""

    def __init__(self, namespace: str, node_name: str, *, dashboard_host: str, dashboard_port: int,
                 metrics_port: int | None, log_dir: Path, gateway_url: str,
                 limits: StartLimits = StartLimits()) -> None:
        self.namespace = namespace
        self.t0 = time.monotonic()
        self.info: headmod.HeadInfo | None = None
        self.error: BaseException | None = None
        self.seconds = 0.0
        self.taken = False          # up() took it over (and stops it on failure itself)
        # waited on through an Event, not Thread.join: a join interrupted by Ctrl-C/SIGTERM leaves the thread
        # looking finished (CPython 3.11), and a head still starting would then never be stopped
        self._done = threading.Event()
        kw = dict(node_name=node_name, gcs_port=None, dashboard_host=dashboard_host, dashboard_port=dashboard_port,
                  metrics_port=metrics_port, log_dir=log_dir, timeout=limits.head_s, ray_env=limits.ray_env())
        self._thread = threading.Thread(target=self._run, args=(kw, gateway_url), name="ray-head", daemon=True)
        # started with the stop signals open: it starts the head, and a child inherits a blocked mask (a head
        # that cannot be TERMed); it ends once the head runs, before up ever lets go of Ray
        self._thread.start()

    def _run(self, kw: dict, gateway_url: str) -> None:
        def record(info: headmod.HeadInfo) -> None:
            statemod.write(statemod.ClusterState(
                namespace=self.namespace, ray_address=info.address, embedded=True, up_pid=os.getpid(),
                started_at=time.time(), head_pid=info.pid, head_started=info.started,
                head_temp_dir=info.temp_dir, head_log=info.log_path, dashboard_url=info.dashboard_url,
                metrics_url=f"http://127.0.0.1:{info.metrics_port}/metrics", auth_mode=info.auth_mode,
                gateway_url=gateway_url))

        try:
            # recorded as soon as the head's process exists: a `down` after this process died finds it
            self.info = headmod.start_head(**kw, on_spawn=record)
        except BaseException as e:  # handed to up(), which raises it
            self.error = e
        finally:
            self.seconds = time.monotonic() - self.t0
            self._done.set()

    def _wait(self) -> None:
        while not self._done.wait(0.1):
            pass

    def result(self) -> headmod.HeadInfo:
        self._wait()
        if self.error is not None:
            raise self.error
        assert self.info is not None
        return self.info

    def abandon(self) -> None:
        """Planning failed (or was interrupted): stop the head and forget it."""
        self._wait()
        if self.info is not None:
            headmod.stop_head(self.info.pid, self.info.started, self.info.temp_dir)
            try:
                st = statemod.read(self.namespace)
            except statemod.StateError:
                st = None
            if st is not None and st.up_pid == os.getpid():
                statemod.remove(self.namespace)
            self.info = None


def start_early_head(namespace: str, *, nodes: list[tuple[str, str | None]], gateway_host: str, gateway_port: int,
                     dashboard_host: str, dashboard_port: int, metrics_port: int | None,
                     log_dir: str | None, limits: StartLimits = StartLimits()) -> EarlyHead | None:
    """Start the embedded head in the background when ``up`` will need exactly this one: a single node on this
    machine, no deployment of that name running, the gateway port free. Otherwise None (``up`` then starts
    the head itself, or says why it cannot)."""
    if len(nodes) != 1 or nodes[0][1] not in (None, "127.0.0.1", "localhost"):
        return None
    old = statemod.read(namespace)
    if old is not None and not (old.embedded and not _head_alive(old)):
        return None
    if headmod.port_problem(gateway_host, gateway_port):
        return None
    return EarlyHead(namespace, "local", dashboard_host=dashboard_host, dashboard_port=dashboard_port,
                     metrics_port=metrics_port, log_dir=deployment_log_dir(log_dir, namespace),
                     gateway_url=f"http://{gateway_host}:{gateway_port}", limits=limits)


def breakdown(status: dict, head_s: float | None, t0_wall: float) -> str:
    """Where `up`'s time went: ``Ray head 5.1s; llama-server w0 spawned at +7.0s, loaded in 5.9s``."""
    loads = []
    for w in status.get("workers", []):
        if w.get("load_s") is None:
            continue
        if w.get("adopted") and w.get("spawned_wall"):    # started by up before Ray: ready is seen once adopted
            spawned = w["spawned_wall"] - t0_wall
            loads.append(f"{w['name']} spawned by up at +{spawned:.1f}s, adopted healthy at "
                         f"+{spawned + w['load_s']:.1f}s")
            continue
        at = f"spawned at +{w['spawned_wall'] - t0_wall:.1f}s, " if w.get("spawned_wall") else ""
        loads.append(f"{w['name']} {at}loaded in {w['load_s']:.1f}s")
    return "; ".join(([f"Ray head {head_s:.1f}s"] if head_s is not None else [])
                     + ([f"llama-server {', '.join(loads)}"] if loads else []))


def wait_ready(api: Any, ctrl: Any, dep: Deployment, timeout: float | None, say: Callable[[str], None]) -> dict:
    from orchestrator.cluster.ray_api import ActorGone, RemoteError

    timeout = timeout if timeout is not None else dep.restart.load_timeout_s + 120
    deadline = time.monotonic() + timeout
    last_note = ""
    status: dict = {}
    while True:
        try:
            status = api.call(ctrl, "status", timeout=30)
        except (ActorGone, RemoteError) as e:
            raise ClusterError(f"the controller actor failed: {e}") from None
        except TimeoutError:
            status = status or {}
        phase = status.get("phase")
        if phase == "ready":
            return status
        if phase == "failed":
            err = status.get("error") or "failed"
            if any(w.get("state") == "failed" for w in status.get("workers", [])):
                raise LaunchError(err)
            raise ClusterError(err)
        note = ", ".join(f"{w['name']}: {w.get('state')}" for w in status.get("workers", []))
        if note and note != last_note:
            say(f"  {note}")
            last_note = note
        if time.monotonic() > deadline:
            raise LaunchError(f"not ready after {timeout:g}s ({note or 'no status'})")
        time.sleep(POLL_S)


def stop_controller(api: Any, ctrl: Any, namespace: str, stop_timeout_s: float = 10.0) -> tuple[list[dict], list[str]]:
    """Ask the controller (``ctrl``, else the one named in ``namespace``) to stop its workers and the gateway,
    then kill it; returns the workers' last records and what went wrong."""
    workers: list[dict] = []
    problems: list[str] = []
    if ctrl is None:
        ctrl = api.get_actor(CONTROLLER, namespace)
    if ctrl is not None:
        try:
            final = api.call(ctrl, "shutdown", timeout=stop_timeout_s + 30)
            workers = final.get("workers", [])
        except Exception as e:  # a dead controller took its workers with it (fate sharing)
            problems.append(f"controller shutdown: {type(e).__name__}: {e}")
        api.kill(ctrl)
    return workers, problems


def _teardown(api: Any, st: statemod.ClusterState | None, namespace: str) -> DownResult:
    """Stop what ``st`` records: the controller (which stops workers and gateway), then the embedded head."""
    res = DownResult(namespace)
    if api is not None:
        res.workers, res.problems = stop_controller(api, None, namespace)
        api.disconnect()
    if st is not None and st.embedded and st.head_pid:
        res.killed = headmod.stop_head(st.head_pid, st.head_started, st.head_temp_dir)
        res.head_stopped = True
    return res


def serve_until_stopped(ns: str, say: Callable[[str], None], sigs: StopSignals) -> tuple[int, bool]:
    """Serve until a signal, a closed output pipe, a vanished Ray head or a ``down`` from elsewhere. Returns the
    exit status so far (see the module docstring) and whether a ``down`` from elsewhere stopped the deployment
    already; otherwise :func:`stop_from_foreground` is what stops it."""
    say("serving; Ctrl-C stops everything")
    try:
        while True:
            time.sleep(1.0)
            try:
                st = statemod.read(ns)
            except statemod.StateError:
                continue                      # someone broke the record; this up still knows what it runs
            if st is None or st.up_pid != os.getpid():
                say("stopped by `orchestrator down`")
                return 0, True
            if _down_running(st) and _stopped_elsewhere(ns, st, say):
                return 0, True
            if st.embedded and not _head_alive(st):
                try:
                    again = statemod.read(ns)
                except statemod.StateError:
                    again = st
                if again is None or _down_running(again):     # a `down` began between the two looks
                    continue
                sigs.absorb()
                say("the Ray head is gone: cleaning up")
                return 1, False
            if _OUTPUT_LOST or output_closed():
                sigs.absorb()
                _silence_stderr()
                return 128 + signal.SIGPIPE, False
    except KeyboardInterrupt:
        return 0, False


def stop_from_foreground(ns: str, say: Callable[[str], None], sigs: StopSignals, code: int = 0,
                          mine: statemod.ClusterState | None = None) -> int:
    """The clean stop of a foreground ``up``; returns its exit status: ``code`` when the stop came from inside,
    else by the signal that asked for it (0 for Ctrl-C and SIGTERM, 129 for a hang-up), 1 when it failed."""
    sigs.absorb()                         # every further signal is only counted: nothing cuts the stop short
    if sigs.first == signal.SIGHUP:
        code = 128 + signal.SIGHUP        # the terminal went away: nobody asked for the stop
    try:
        gone = statemod.read(ns) is None
    except statemod.StateError:
        gone = False
    if gone:
        say("already stopped by `orchestrator down`")
        return code
    say("stopping workers, gateway and Ray ...")
    try:
        res = down(ns, say=say, recorded=mine)
    except Exception as e:   # noqa: BLE001 -- said in one line; the exit status tells a script
        say(f"the stop failed: {type(e).__name__}: {e}")
        return code or 1
    say(f"stopped ({len(res.workers)} worker(s)" + (", Ray head" if res.head_stopped else "") + ")"
        + (f"; {sigs.count - 1} further signal(s) waited for it" if sigs.count > 1 else ""))
    return code


def output_closed() -> bool:
    """True when stdout or stderr is a pipe (or socket) whose reader went away: `up ... | tee log` after tee
    died. Terminals and files never count."""
    for fd in (1, 2):
        try:
            mode = os.fstat(fd).st_mode
        except OSError:
            continue
        if not (stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)):
            continue
        p = select.poll()
        p.register(fd, 0)                  # POLLERR and POLLHUP are always reported
        try:
            events = p.poll(0)
        except OSError:
            continue
        if any(ev & (select.POLLERR | select.POLLHUP) for _, ev in events):
            return True
    return False


def down(namespace: str = "orchestrator", *, say: Callable[[str], None] = say_default, force: bool = False,
         recorded: statemod.ClusterState | None = None) -> DownResult:
    """Stop the deployment recorded for ``namespace``: workers, gateway, controller, and the embedded Ray head.

    A state file that cannot be read is an error naming it; with ``force`` the deployment is stopped from what
    ``up`` recorded beside it (the Ray record and the keepers' files) and the broken file is removed.
    ``recorded``: the state the caller (a foreground ``up``) holds itself, used when the file is broken."""
    from orchestrator.cluster.ray_api import RayApi

    try:
        st = statemod.read(namespace)
    except statemod.StateError as e:
        if not (force or recorded is not None):
            raise
        say(f"warning: {e}")
        st = recorded
    if st is None:
        if force:
            return _force_down(namespace, say)
        raise ClusterError(f"no deployment {namespace!r} is running (no state file at "
                           f"{statemod.state_path(namespace)})")
    if st.up_pid != os.getpid():
        _mark_stopping(st)
    api = None
    problems = []
    reachable = not st.embedded or _head_alive(st)
    if reachable:
        try:
            api = RayApi.connect(st.ray_address, namespace)
        except ClusterError as e:
            problems.append(str(e))
    res = _teardown(api, st, namespace)
    res.killed += _stop_keepers(namespace)
    shutil.rmtree(statemod.run_dir(namespace), ignore_errors=True)   # the keepers' hand-over files, the Ray record
    res.problems = problems + res.problems
    statemod.remove(namespace)
    for p in res.problems:
        say(f"warning: {p}")
    if res.killed:
        say(f"killed leftover processes: {', '.join(res.killed)}")
    return res


def _mark_stopping(st: statemod.ClusterState) -> None:
    """Tell a foreground ``up`` serving this deployment that this ``down`` stops it: it then sees its head go
    as the stop it is, not as a crash."""
    st.phase, st.stopping_pid = "stopping", os.getpid()
    try:
        statemod.write(st)
    except OSError:
        pass                # the stop goes on; that `up` then says its head is gone


def _down_running(st: statemod.ClusterState) -> bool:
    """Another process's ``down`` is stopping the deployment ``st`` records, and still runs."""
    import psutil

    return st.phase == "stopping" and bool(st.stopping_pid) and st.stopping_pid != os.getpid() and \
        psutil.pid_exists(st.stopping_pid)


def _stopped_elsewhere(ns: str, st: statemod.ClusterState, say: Callable[[str], None]) -> bool:
    """A ``down`` from elsewhere is stopping this deployment: wait while it runs; True once the record is gone
    (that ``down`` finished), False when it died before finishing."""
    while st is not None and _down_running(st):
        time.sleep(POLL_S)
        try:
            st = statemod.read(ns)
        except statemod.StateError:
            continue
    try:
        st = statemod.read(ns)          # as it is now: that `down` may have finished just as it exited
    except statemod.StateError:
        pass
    if st is None or st.up_pid != os.getpid():
        say("stopped by `orchestrator down`")
        return True
    return False


def _force_down(namespace: str, say: Callable[[str], None]) -> DownResult:
    """``down --force`` without a usable state file: stop what the Ray record and the keepers' files name."""
    from orchestrator.cluster.ray_api import RayApi

    rec = statemod.read_ray_record(namespace) or {}
    res = DownResult(namespace)
    if rec.get("embedded") and rec.get("head_pid"):
        st = statemod.ClusterState(namespace=namespace, ray_address=str(rec.get("ray_address") or ""), embedded=True,
                                   up_pid=int(rec.get("up_pid") or 0), started_at=0.0, head_pid=int(rec["head_pid"]),
                                   head_started=rec.get("head_started", rec.get("head_create_time")), head_temp_dir=rec.get("head_temp_dir"))
        api = None
        if _head_alive(st):
            try:
                api = RayApi.connect(st.ray_address, namespace)
            except ClusterError as e:
                res.problems.append(str(e))
        res = _teardown(api, st, namespace)
    elif rec.get("ray_address"):
        try:
            res = _teardown(RayApi.connect(str(rec["ray_address"]), namespace), None, namespace)
        except ClusterError as e:
            res.problems.append(str(e))
    res.namespace = namespace
    res.killed += _stop_keepers(namespace)
    shutil.rmtree(statemod.run_dir(namespace), ignore_errors=True)
    try:
        statemod.state_path(namespace).unlink()
    except FileNotFoundError:
        pass
    except OSError as e:
        res.problems.append(f"cannot remove {statemod.state_path(namespace)}: {e.strerror}")
    for p in res.problems:
        say(f"warning: {p}")
    if res.killed:
        say(f"killed leftover processes: {', '.join(res.killed)}")
    return res


def _stop_keepers(namespace: str) -> list[str]:
    """Stop the keepers (and their llama-servers) of ``namespace`` that are still running; normally none are
    left by then (a keeper stops with its owner), this is for a ``down`` after things went wrong."""
    from orchestrator.cluster.keeper import alive, read_json
    from orchestrator.launch.process import killpg

    out = []
    d = statemod.run_dir(namespace)
    for f in sorted(d.glob("*.keeper.json")) if d.is_dir() else []:
        rec = read_json(f) or {}
        keeper = rec.get("keeper")
        if rec.get("exit") is not None or not alive(keeper):
            continue
        try:
            os.kill(int(keeper["pid"]), signal.SIGTERM)
        except (ProcessLookupError, KeyError, TypeError, ValueError):
            continue
        deadline = time.monotonic() + float(rec.get("grace") or 10) + 5
        while alive(keeper) and time.monotonic() < deadline:
            time.sleep(0.1)
        if alive(keeper):
            try:
                os.kill(int(keeper["pid"]), signal.SIGKILL)
            except ProcessLookupError:
                pass
            if rec.get("pid"):
                killpg(int(rec["pid"]), signal.SIGKILL)
            out.append(f"{keeper['pid']} (keeper of {rec.get('name', '?')})")
    return out


def status(namespace: str = "orchestrator") -> dict:
    """The controller's view of the deployment plus what the state file records."""
    from orchestrator.cluster.ray_api import ActorGone, RayApi, RemoteError

    st = statemod.read(namespace)
    if st is None:
        raise ClusterError(f"no deployment {namespace!r} is running (no state file at "
                           f"{statemod.state_path(namespace)})")
    if st.embedded and not _head_alive(st):
        raise ClusterError(f"deployment {namespace!r}: its Ray head (pid {st.head_pid}) is gone; "
                           "run `orchestrator down` to clean up")
    api = RayApi.connect(st.ray_address, namespace)
    try:
        ctrl = api.get_actor(CONTROLLER, namespace)
        if ctrl is None:
            raise ClusterError(f"deployment {namespace!r}: no controller on the Ray cluster at {st.ray_address}; "
                               "run `orchestrator down` to clean up")
        try:
            out = api.call(ctrl, "status", timeout=30)
        except (ActorGone, RemoteError, TimeoutError) as e:
            raise ClusterError(f"deployment {namespace!r}: the controller does not answer: {e}") from None
    finally:
        api.disconnect()
    out.update({"ray_address": st.ray_address, "embedded": st.embedded, "dashboard_url": st.dashboard_url,
                "metrics_url": st.metrics_url, "up_pid": st.up_pid, "state_file": str(statemod.state_path(namespace))})
    return out
