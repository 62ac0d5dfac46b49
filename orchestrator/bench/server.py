"""The seam between the bench and the process manager: start a :class:`LaunchSpec`, wait for /health, stop it.

The process manager is ``orchestrator.launch.process`` (own process group, log file, TERM→KILL, reason from the
log on early exit). Until it is on this branch, ``_fallback_process`` implements the same small interface:
``start(spec, log_path) -> proc`` with ``proc.wait_healthy(timeout) -> seconds``, ``proc.stop()``,
``proc.running()``, ``proc.pid``, ``proc.failure_cause()``.
"""

from __future__ import annotations

import os
import socket
from typing import Any, Callable, Protocol

from orchestrator.launch.spec import LaunchSpec


class ServerProcess(Protocol):
    pid: int

    def wait_healthy(self, timeout: float) -> float: ...
    def stop(self, grace: float = 10.0) -> Any: ...
    def running(self) -> bool: ...
    def failure_cause(self) -> str: ...


Launcher = Callable[[LaunchSpec, "os.PathLike[str] | str"], ServerProcess]


def default_launcher() -> Launcher:
    try:
        from orchestrator.launch.process import start  # type: ignore[attr-defined]
    except ImportError:
        from orchestrator.bench._fallback_process import start
    return start


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now (the kernel's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
