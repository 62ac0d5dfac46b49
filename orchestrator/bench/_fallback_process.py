"""Stand-in for ``orchestrator.launch.process`` until it lands on this branch (same interface, fewer features).

Delete this file once ``orchestrator.launch.process`` is merged: ``bench.server.default_launcher`` prefers it.
"""

from __future__ import annotations

import http.client
import os
import re
import signal
import subprocess
import time
from pathlib import Path

from orchestrator.errors import LaunchError
from orchestrator.launch.spec import LaunchSpec

_ERR = re.compile(r"error|failed|unable|cannot|out of memory|invalid|unknown|abort|exception", re.IGNORECASE)


class _Proc:
    def __init__(self, spec: LaunchSpec, popen: subprocess.Popen, log_path: Path, offset: int):
        self.spec, self._popen, self.log_path, self.log_offset = spec, popen, log_path, offset
        self.started_at = time.monotonic()

    @property
    def pid(self) -> int:
        return self._popen.pid

    def running(self) -> bool:
        return self._popen.poll() is None

    def failure_cause(self) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self.log_offset)
                lines = f.read().decode("utf-8", "replace").splitlines()
        except OSError:
            return ""
        errs = [" ".join(ln.split()) for ln in lines if _ERR.search(ln)]
        chosen = errs[:2] + errs[-1:] if len(errs) > 3 else errs
        return " | ".join(dict.fromkeys(chosen)) or " | ".join(ln.strip() for ln in lines[-3:] if ln.strip())

    def _health(self) -> int | None:
        conn = http.client.HTTPConnection(self.spec.host, self.spec.port, timeout=2)
        try:
            conn.request("GET", "/health")
            r = conn.getresponse()
            r.read()
            return r.status
        except (OSError, http.client.HTTPException):
            return None
        finally:
            conn.close()

    def wait_healthy(self, timeout: float) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            rc = self._popen.poll()
            if rc is not None:
                cause = self.failure_cause() or "(nothing in the log)"
                self.stop()
                raise LaunchError(f"worker {self.spec.name}: exited with status {rc} before it was ready: {cause} "
                                  f"(log: {self.log_path})")
            if self._health() == 200:
                return time.monotonic() - self.started_at
            time.sleep(0.1)
        cause = self.failure_cause()
        self.stop()
        raise LaunchError(f"worker {self.spec.name}: /health did not answer 200 within {timeout:g} s; stopped it. "
                          f"Last log lines: {cause or '(none)'} (log: {self.log_path})")

    def stop(self, grace: float = 10.0) -> int | None:
        if self._popen.poll() is None:
            try:
                os.kill(self._popen.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self._popen.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(self._popen.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self._popen.wait()
        try:
            os.killpg(self._popen.pid, signal.SIGKILL)   # anything the leader left in its group
        except (ProcessLookupError, PermissionError):
            pass
        return self._popen.returncode


def start(spec: LaunchSpec, log_path) -> _Proc:
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **dict(spec.env)}
    with open(log_path, "ab", buffering=0) as log:
        log.write(f"# orchestrator: starting {spec.name}: {spec.shell_line()}\n".encode())
        offset = log.tell()
        try:
            popen = subprocess.Popen(list(spec.argv), env=env, stdin=subprocess.DEVNULL, stdout=log,
                                     stderr=subprocess.STDOUT, start_new_session=True, close_fds=True)
        except OSError as e:
            raise LaunchError(f"worker {spec.name}: cannot run {spec.argv[0]}: {e.strerror}") from None
    return _Proc(spec, popen, log_path, offset)
