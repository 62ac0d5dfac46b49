"""Start llama-server before its worker actor exists, and hand it over when the actor does.

``up`` on one machine spends seconds on Ray (the head, then the controller and worker actors) before a worker
actor could start llama-server, and a big model then loads for seconds more. With ``workers.early_start``, ``up``
starts each local llama-server as soon as the plan is made, so the load overlaps Ray's start, and the worker actor
*adopts* the running server instead of starting one.

A process cannot change its parent, and only a parent can read a child's exit status or give it a parent-death
signal. So a small keeper process sits in between::

    up ──► keeper (own session) ──► [exec guard] llama-server (own session; TERM when the keeper dies)

The keeper watches one *owner* process: first ``up``, then the worker actor that adopted the server (the actor
writes its pid into the owner file). When the owner dies (``up`` killed before the hand-over, the actor killed
after it) the keeper stops llama-server, as the parent-death signal of an actor-started server would. When
llama-server exits, the keeper writes its exit status into the state file and exits. SIGTERM, SIGINT or SIGHUP to
the keeper: stop llama-server (TERM to the leader, KILL to its group after the grace period), record, exit.

:class:`EarlyServer` is ``up``'s side (start the keeper, stop it if nobody adopted it); :class:`AdoptedHandle` is
the worker actor's side, a :class:`orchestrator.cluster.procs.ProcessHandle` like the one of a server it started.
Run as ``python -m orchestrator.cluster.keeper SPEC_JSON LOG STATE OWNER GRACE``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from orchestrator.cluster.procs import server_env
from orchestrator.launch.spec import LaunchSpec
from orchestrator.paths import pythonpath_with_package
from orchestrator.sigutil import start_thread_unsignalled, stop_signals_set

POLL_S = 0.25         # owner and server checks: about 0.3% of a core


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def read_json(path: str | os.PathLike) -> dict | None:
    try:
        with open(path) as f:
            d = json.load(f)
        return d if isinstance(d, dict) else None
    except (OSError, ValueError):
        return None


def process_identity(pid: int) -> dict:
    """``{"pid", "started"}`` of a running process (when it started, in seconds since boot, tells a reused pid
    apart; see orchestrator.cluster.procs.started_since_boot)."""
    from orchestrator.cluster.procs import started_since_boot

    return {"pid": pid, "started": started_since_boot(pid)}


def alive(ident: dict | None) -> bool:
    """The process ``ident`` names still runs (same pid, same start, not a zombie)."""
    import psutil

    from orchestrator.cluster.procs import same_start

    if not ident:
        return False
    try:
        pid = int(ident["pid"])
        if not same_start(pid, ident.get("started", ident.get("create_time"))):
            return False
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except (psutil.Error, KeyError, TypeError, ValueError):
        return False


# --- the keeper process ------------------------------------------------------------------------------------------

def keep(spec: LaunchSpec, log_path: Path, state_path: Path, owner_path: Path, grace: float) -> int:
    from orchestrator.cluster.procs import RAY_INJECTED_ENV, LocalLauncher
    from orchestrator.errors import LaunchError

    stop = threading.Event()
    stop_signals_set(stop)
    state = {"keeper": process_identity(os.getpid()), "name": spec.name, "argv": list(spec.argv),
             "log": str(log_path), "grace": grace}
    try:    # exactly as a worker actor starts it; the exec guard TERMs it when this keeper dies
        wp = LocalLauncher(drop_env=RAY_INJECTED_ENV).start(spec, log_path).wp
    except LaunchError as e:
        _write_json(state_path, {**state, "error": str(e)})
        return 1
    state.update({"pid": wp.pid, "log_offset": wp.log_offset, "started_wall": time.time(),
                  "started_monotonic": time.monotonic(), "exit": None})
    _write_json(state_path, state)
    why = ""
    while True:
        if stop.is_set():
            why = "stopped"
            break
        if wp.poll() is not None:
            why = "exited"
            break
        owner = read_json(owner_path)       # read first: the owner may have just been handed over
        if not alive(owner):
            why = f"owner pid {owner.get('pid') if owner else '?'} gone"
            break
        stop.wait(POLL_S)
    code = wp.stop(grace=grace)             # reaps, and clears what its group left behind
    _write_json(state_path, {**state, "exit": code, "why": why})
    return 0


def main(argv: list[str] | None = None) -> int:
    a = sys.argv[1:] if argv is None else argv
    if len(a) != 5:
        print("usage: python -m orchestrator.cluster.keeper SPEC_JSON LOG STATE OWNER GRACE", file=sys.stderr)
        return 2
    spec = LaunchSpec.from_dict(json.loads(a[0]))
    return keep(spec, Path(a[1]), Path(a[2]), Path(a[3]), float(a[4]))


# --- up's side -------------------------------------------------------------------------------------------------

class EarlyServer:
    """One llama-server started by ``up`` through a keeper, waiting for its worker actor."""

    def __init__(self, spec: LaunchSpec, log_path: Path, run_dir: Path, grace: float,
                 server_key: str | None = None) -> None:
        self.spec = spec
        self.server_key = server_key        # the deployment's llama-server key (procs.server_env)
        self.log_path = log_path
        self.state_path = run_dir / f"{spec.name}.keeper.json"
        self.owner_path = run_dir / f"{spec.name}.owner.json"
        self.grace = grace
        self.owner_pid = os.getpid()
        self.popen: subprocess.Popen | None = None

    def start(self, owner_pid: int | None = None) -> "EarlyServer":
        """Start the keeper; the owner is this process (``up``) unless ``owner_pid`` names another."""
        self.state_path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        for p in (self.state_path, self.owner_path):
            p.unlink(missing_ok=True)
        self.owner_pid = owner_pid or os.getpid()
        _write_json(self.owner_path, process_identity(self.owner_pid))
        with open(self.log_path, "ab") as log:   # the keeper's own errors (a traceback) land in the worker's log
            self.popen = subprocess.Popen(
                [sys.executable, "-m", "orchestrator.cluster.keeper", json.dumps(self.spec.to_dict()),
                 str(self.log_path), str(self.state_path), str(self.owner_path), str(self.grace)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                close_fds=True, env={**os.environ, **server_env(self.server_key),
                                     "PYTHONPATH": pythonpath_with_package()})
        # reap the keeper as soon as it exits (this process is its parent while `up` runs in the foreground)
        # with up's stop signals blocked: they go to up's main thread only
        start_thread_unsignalled(threading.Thread(target=self.popen.wait, name=f"reap-{self.spec.name}",
                                                  daemon=True))
        return self

    def handover(self) -> dict:
        """What the worker actor needs to adopt the server."""
        return {"state": str(self.state_path), "owner": str(self.owner_path)}

    def adopted(self) -> bool:
        owner = read_json(self.owner_path)
        return bool(owner) and owner.get("pid") != self.owner_pid

    def stop(self, timeout: float | None = None) -> None:
        """Stop the keeper (which stops llama-server) and wait for it; for a server nobody adopted."""
        if self.popen is None or self.popen.poll() is not None:
            return
        try:
            self.popen.send_signal(signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            self.popen.wait(timeout=(timeout if timeout is not None else self.grace) + 10)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()
            st = read_json(self.state_path) or {}
            if st.get("pid"):
                from orchestrator.launch.process import killpg

                killpg(int(st["pid"]), signal.SIGKILL)


# --- the worker actor's side ---------------------------------------------------------------------------------

class AdoptedHandle:
    """:class:`orchestrator.cluster.procs.ProcessHandle` over a server a keeper holds."""

    def __init__(self, state_path: Path, state: dict) -> None:
        self.state_path = state_path
        self.keeper = state["keeper"]
        self.pid = int(state["pid"])
        self.log_path = Path(state["log"])
        self.log_offset = int(state.get("log_offset", 0))
        self.started_wall = float(state.get("started_wall") or time.time())
        self.started_monotonic = float(state.get("started_monotonic") or time.monotonic())
        self._exit: int | None = None

    @classmethod
    def adopt(cls, handover: dict, spec: LaunchSpec, grace: float = 10.0,
              wait_s: float = 10.0) -> tuple["AdoptedHandle | None", str]:
        """Take over the server of ``handover`` (from :meth:`EarlyServer.handover`): (handle, "") or (None, why
        not; a server that is not ``spec``'s is stopped). The keeper's state file may lag its start by a moment:
        wait up to ``wait_s`` for it."""
        state_path, owner_path = Path(handover["state"]), Path(handover["owner"])
        deadline = time.monotonic() + wait_s
        while True:
            st = read_json(state_path)
            if st is not None or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        if st is None:
            return None, f"no keeper state at {state_path}"
        if st.get("error"):
            return None, st["error"]
        if st.get("name") != spec.name or tuple(st.get("argv", ())) != tuple(spec.argv):
            if st.get("exit") is None:
                cls(state_path, st).stop(grace)     # not ours to run: it would hold the port
            return None, "the early llama-server runs another argv"
        _write_json(owner_path, process_identity(os.getpid()))
        h = cls(state_path, st)
        if not alive(h.keeper) and (read_json(state_path) or {}).get("exit") is None:
            return None, "its keeper is gone"
        return h, ""

    def _state(self) -> dict:
        return read_json(self.state_path) or {}

    def poll(self) -> int | None:
        if self._exit is not None:
            return self._exit
        st = self._state()
        if st.get("exit") is not None:
            self._exit = int(st["exit"])
            return self._exit
        if not alive(self.keeper):
            st = self._state()                      # it may have recorded the exit just now
            self._exit = int(st["exit"]) if st.get("exit") is not None else -signal.SIGKILL
            return self._exit
        return None

    def stop(self, timeout: float) -> int | None:
        if self.poll() is None:
            try:
                os.kill(int(self.keeper["pid"]), signal.SIGTERM)
            except ProcessLookupError:
                pass
            deadline = time.monotonic() + timeout + 10
            while self.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            if self.poll() is None:                 # the keeper hangs: end it and the server's group
                from orchestrator.launch.process import killpg

                try:
                    os.kill(int(self.keeper["pid"]), signal.SIGKILL)
                except ProcessLookupError:
                    pass
                killpg(self.pid, signal.SIGKILL)
                self._exit = -signal.SIGKILL
        from orchestrator.launch.process import group_members

        deadline = time.monotonic() + 10
        while group_members(self.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        return self._exit

    def cause(self) -> str:
        from orchestrator.launch.process import log_cause

        return log_cause(self.log_path, self.log_offset)


if __name__ == "__main__":
    raise SystemExit(main())
