"""The seam between the bench and the process manager: start a :class:`LaunchSpec`, wait for /health, stop it.

The process manager is ``orchestrator.launch.process`` (own process group, log file, TERM→KILL, reason from the
log on early exit); the bench uses this much of it: ``start(spec, log_path) -> proc`` with
``proc.wait_healthy(timeout) -> seconds``, ``proc.stop(grace)``, ``proc.running()``, ``proc.pid``,
``proc.failure_cause()``. Tests pass their own launcher (wrapping the real one) through ``run_bench(launcher=)``.
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
    from orchestrator.launch.process import start

    return start


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now (the kernel's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
