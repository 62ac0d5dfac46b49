"""Run a real ``llama-server`` once: load a model, optionally decode one full micro-batch, capture the log.

Used by calibration (``lab.calibrate``) and by the integration tests. The process is started, health-checked and
stopped by the product's one launcher (:mod:`orchestrator.launch.process`: its own process group bound to
127.0.0.1, SIGTERM then SIGKILL to the group, reaped); this module adds the calibration's batch and probes.
Standard library only (with the package).
"""

from __future__ import annotations

import json
import socket
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from orchestrator.launch.process import start
from orchestrator.launch.spec import LaunchSpec


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


def post_json(url: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read().decode())


def run_server(binary: str, model: str, args: list[str], *, timeout: float = 300.0,
               batch_tokens: int | None = None, env: dict | None = None,
               probe: Callable[[], Any] | None = None, n_vocab: int = 32000) -> ServerRun:
    """Start ``binary -m model ARGS --host 127.0.0.1 --port P -lv 4``, wait until it has loaded (or died), send
    one completion of ``batch_tokens`` prompt tokens when asked, stop it, and return its log. ``probe`` is
    called while the server runs, once loaded and again after the batch (e.g. to read GPU memory)."""
    port = free_port()
    argv = [binary, "-m", model, *args, "--host", "127.0.0.1", "--port", str(port), "-lv", "4"]
    spec = LaunchSpec(name="calibration", argv=tuple(argv), env=dict(env or {}), host="127.0.0.1", port=port)
    t0 = time.monotonic()
    loaded = False
    error: str | None = None
    batch_ok: bool | None = None
    probes: dict[str, Any] = {}
    exit_code: int | None = None
    with tempfile.TemporaryDirectory(prefix="orch-serverrun-") as tmp:
        log_path = Path(tmp) / "llama-server.log"
        proc = start(spec, log_path)
        try:
            deadline = t0 + timeout
            while True:
                if proc.poll() is not None:
                    error = f"llama-server exited with status {proc.returncode} while loading"
                    break
                if proc.health(timeout=2.0) == 200:
                    loaded = True
                    break
                if time.monotonic() > deadline:
                    error = f"llama-server did not load within {timeout:.0f} s"
                    break
                time.sleep(0.2)
            if loaded and probe is not None:
                probes["loaded"] = probe()
            if loaded and batch_tokens:
                # ids from 259 on are plain pieces in the calibration vocabularies (after <unk>, <s>, </s>, bytes)
                span = max(1, min(5000, n_vocab - 259))
                prompt = [259 + (i % span) for i in range(batch_tokens)]
                try:
                    post_json(f"http://127.0.0.1:{port}/completion",
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
            proc.stop(grace=15.0)
            with open(log_path, "rb") as f:
                f.seek(proc.log_offset)
                log = f.read().decode("utf-8", "replace")
    return ServerRun(argv, log, loaded, batch_ok, error, time.monotonic() - t0, exit_code, probes)
