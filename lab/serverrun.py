"""Run a real ``llama-server`` once: load a model, optionally decode one full micro-batch, capture the log.

Used by calibration (``lab.calibrate``) and by the integration tests. Standard library only.
The process gets an argv list, binds 127.0.0.1, is always terminated and reaped (SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass
class ServerRun:
    argv: list[str]
    log: str
    loaded: bool             # the server said "model loaded"
    batch_ok: bool | None    # one full micro-batch decoded (None: not tried)
    error: str | None
    seconds: float
    exit_code: int | None    # None when it was still running and we stopped it
    probes: dict[str, Any] = field(default_factory=dict)   # probe results: "loaded", "batch"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read().decode())


def _reap_group(pgid: int, grace: float = 5.0) -> None:
    """Make sure nothing of the process group we started survives (children of llama-server, if any)."""
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.05)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_server(binary: str, model: str, args: list[str], *, timeout: float = 300.0,
               batch_tokens: int | None = None, env: dict | None = None,
               probe: Callable[[], Any] | None = None, n_vocab: int = 32000) -> ServerRun:
    """Start ``binary -m model ARGS --host 127.0.0.1 --port P -lv 4``, wait until it has loaded (or died), send
    one completion of ``batch_tokens`` prompt tokens when asked, stop it, and return its log. ``probe`` is
    called while the server runs, once loaded and again after the batch (e.g. to read GPU memory)."""
    port = free_port()
    argv = [binary, "-m", model, *args, "--host", "127.0.0.1", "--port", str(port), "-lv", "4"]
    t0 = time.monotonic()
    with tempfile.TemporaryFile(mode="w+b") as logf:
        proc = subprocess.Popen(argv, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, **(env or {})}, start_new_session=True)
        loaded = False
        error: str | None = None
        batch_ok: bool | None = None
        probes: dict[str, Any] = {}
        try:
            deadline = t0 + timeout
            while time.monotonic() < deadline:
                if proc.poll() is not None:
                    error = f"llama-server exited with status {proc.returncode} while loading"
                    break
                logf.flush()
                logf.seek(0)
                text = logf.read().decode("utf-8", "replace")
                logf.seek(0, os.SEEK_END)
                if "model loaded" in text or "listening on" in text:
                    loaded = True
                    break
                time.sleep(0.2)
            else:
                error = f"llama-server did not load within {timeout:.0f} s"
            if loaded and probe is not None:
                probes["loaded"] = probe()
            if loaded and batch_tokens:
                # ids from 259 on are plain pieces in the calibration vocabularies (after <unk>, <s>, </s>, bytes)
                span = max(1, min(5000, n_vocab - 259))
                prompt = [259 + (i % span) for i in range(batch_tokens)]
                try:
                    _post(f"http://127.0.0.1:{port}/completion",
                          {"prompt": prompt, "n_predict": 1, "cache_prompt": False},
                          timeout=max(30.0, deadline - time.monotonic()))
                    batch_ok = proc.poll() is None
                    if batch_ok and probe is not None:
                        probes["batch"] = probe()
                    if not batch_ok:
                        error = f"llama-server exited with status {proc.returncode} during the first batch"
                except (urllib.error.URLError, OSError, ValueError) as e:
                    batch_ok = False
                    error = f"first batch failed: {e}"
        finally:
            exit_code = proc.poll()
            if exit_code is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    try:
                        os.killpg(proc.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    proc.wait()
            _reap_group(proc.pid)
            logf.seek(0)
            log = logf.read().decode("utf-8", "replace")
    return ServerRun(argv, log, loaded, batch_ok, error, time.monotonic() - t0, exit_code, probes)
