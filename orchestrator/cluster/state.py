"""What ``up`` started, on disk, so ``status`` and ``down`` (other processes, later) find it.

One JSON file per namespace under ``orchestrator.paths.state_dir()/cluster/``; written to a temporary name and
renamed, so a reader never sees half a file. A file that cannot be read or parsed is an error naming it (the
deployment may well still run), never "nothing runs".

Beside it, per namespace:

- ``cluster/NS.lock``: held (``flock``) by the ``up`` that starts or serves the deployment, with its pid inside,
  so a second ``up`` of that namespace is refused at once instead of racing the first;
- ``run/NS/ray.json``: the Ray head ``up`` started (pid, start time, temp dir) or the cluster it joined,
  written apart from the state file, so ``down --force`` stops the deployment even when the state file is lost;
  the keepers' ``run/NS/*.keeper.json`` name the early-started llama-servers the same way.

Namespaces are names, never paths: ``[A-Za-z0-9][A-Za-z0-9_.-]{0,63}``.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from orchestrator.errors import ClusterError
from orchestrator.fsutil import write_atomic
from orchestrator.paths import state_dir

NAMESPACE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


class StateError(ClusterError):
    """A state file that exists but cannot be used."""


@dataclass
class ClusterState:
    namespace: str
    ray_address: str
    embedded: bool                      # True: up started the Ray head below and down stops it
    up_pid: int
    started_at: float
    phase: str = "starting"             # starting | running | stopping (a `down` is stopping it)
    stopping_pid: int | None = None     # the `down` that is stopping it
    head_pid: int | None = None
    head_started: float | None = None     # seconds since boot (older records: a wall-clock time)
    head_temp_dir: str | None = None
    head_log: str | None = None
    dashboard_url: str | None = None
    metrics_url: str | None = None
    gateway_url: str | None = None
    auth_mode: str | None = None
    foreground: bool = False
    workers: list[dict[str, Any]] = field(default_factory=list)   # name, node, url: for messages only

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict) -> "ClusterState":
        names = {f.name for f in fields(cls)}
        if "head_create_time" in d and "head_started" not in d:      # records written before the rename
            d = {**d, "head_started": d["head_create_time"]}
        return cls(**{k: v for k, v in d.items() if k in names})


def check_namespace(namespace: str) -> str:
    """``namespace`` when it is a valid name, else StateError (it names files: '..' or 'a/b' must never pass)."""
    if not isinstance(namespace, str) or not NAMESPACE_RE.fullmatch(namespace):
        raise StateError(f"namespace {namespace!r}: not a valid name (1 to 64 letters, digits, '_', '.', '-', "
                         "starting with a letter or digit)")
    return namespace


def state_path(namespace: str) -> Path:
    return state_dir() / "cluster" / f"{check_namespace(namespace)}.json"


def run_dir(namespace: str) -> Path:
    """Per-deployment files besides the state file: the Ray record, the keepers' hand-over files."""
    return state_dir() / "run" / check_namespace(namespace)


def _private_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    return path


def write(st: ClusterState) -> Path:
    path = state_path(st.namespace)
    _private_dir(path.parent)
    out = write_atomic(path, st.to_json(), mode=0o600)
    write_ray_record(st)
    return out


def read(namespace: str) -> ClusterState | None:
    """The recorded deployment; None when there is no state file; StateError naming the file when there is one
    that cannot be read or is not a state record."""
    path = state_path(namespace)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as e:
        raise StateError(f"state file {path}: cannot read it ({getattr(e, 'strerror', None) or e}); "
                         f"`orchestrator down --force -n {namespace}` stops what up recorded elsewhere") from None
    try:
        d = json.loads(text)
        if not isinstance(d, dict):
            raise ValueError(f"a JSON {type(d).__name__}, not an object")
        st = ClusterState.from_dict(d)
        if not isinstance(st.up_pid, int) or not isinstance(st.ray_address, str):
            raise ValueError("up_pid or ray_address has the wrong type")
        return st
    except (ValueError, TypeError) as e:
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise StateError(f"state file {path}: not a deployment record ({why}); "
                         f"`orchestrator down --force -n {namespace}` stops what up recorded elsewhere") from None


def remove(namespace: str) -> None:
    """Forget the deployment: its state file and its Ray record."""
    for path in (state_path(namespace), ray_record_path(namespace)):
        try:
            path.unlink()
        except FileNotFoundError:
            pass


def recorded() -> list[str]:
    d = state_dir() / "cluster"
    return sorted(p.stem for p in d.glob("*.json") if NAMESPACE_RE.fullmatch(p.stem)) if d.is_dir() else []


# --- the Ray record, apart from the state file ---------------------------------------------------------------------

def ray_record_path(namespace: str) -> Path:
    return run_dir(namespace) / "ray.json"


def write_ray_record(st: ClusterState) -> None:
    rec = {"ray_address": st.ray_address, "embedded": st.embedded, "head_pid": st.head_pid,
           "head_started": st.head_started, "head_temp_dir": st.head_temp_dir, "up_pid": st.up_pid}
    write_atomic(_private_dir(run_dir(st.namespace)) / "ray.json", json.dumps(rec), mode=0o600)


def read_ray_record(namespace: str) -> dict | None:
    try:
        d = json.loads(ray_record_path(namespace).read_text())
        return d if isinstance(d, dict) else None
    except (OSError, ValueError):
        return None


# --- one up per namespace -------------------------------------------------------------------------------------------

class NamespaceLock:
    """An exclusive ``flock`` on ``cluster/NS.lock`` holding the owner's pid; released when this process exits,
    however it exits. Re-entrant within one process."""

    _held: dict[str, "NamespaceLock"] = {}

    def __init__(self, namespace: str) -> None:
        self.namespace = check_namespace(namespace)
        self.path = state_dir() / "cluster" / f"{namespace}.lock"
        self.fd: int | None = None
        self.depth = 0

    @classmethod
    def acquire(cls, namespace: str) -> "NamespaceLock":
        """The lock of ``namespace`` for this process; ClusterError naming the holder's pid when another has it."""
        lk = cls._held.get(namespace)
        if lk is None:
            lk = cls(namespace)
            lk._take()
            cls._held[namespace] = lk
        lk.depth += 1
        return lk

    def _take(self) -> None:
        _private_dir(self.path.parent)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = ""
            try:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
            except OSError:
                pass
            os.close(fd)
            if e.errno in (errno.EAGAIN, errno.EACCES):
                raise ClusterError(f"deployment {self.namespace!r} is being started or served by another `up` "
                                   f"(pid {holder or '?'}; lock {self.path})") from None
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd = fd

    def release(self) -> None:
        self.depth -= 1
        if self.depth > 0 or self.fd is None:
            return
        self._held.pop(self.namespace, None)
        try:
            os.ftruncate(self.fd, 0)
        except OSError:
            pass
        os.close(self.fd)       # the file stays: unlinking it would let two lockers hold two different files
        self.fd = None

    def __enter__(self) -> "NamespaceLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()
