"""Helpers shared by tests/cluster (unit) and tests/integration/test_cluster*.py (real Ray, real llama-server).

Integration modules load this file by path (see ``_support()`` there).
"""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:
    sys.path.insert(0, str(HERE.parent))        # tests/: the shared tiny model writer

from tiny_llama import write_tiny_llama  # noqa: E402

__all__ = ["write_tiny_llama", "with_stop_signals_reset", "stop_signals_at_defaults", "free_port", "llama_spec",
           "http_json", "post_json", "stream_completion", "llama_servers", "processes_with", "ray_processes_of", "wait_for"]


# What a program started from an interactive shell gets: these tests rely on it, whatever the test run inherited
# (`nohup` ignores SIGHUP; a background job of a non-interactive shell ignores SIGINT), and `up` keeps an ignored
# stop signal ignored, as `nohup orchestrator up` must.
_STOP_DEFAULTS = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL,
                  signal.SIGHUP: signal.SIG_DFL}


_RESET_AND_EXEC = ("import os, signal, sys\n"
                   "for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):\n"
                   "    signal.signal(s, signal.SIG_DFL)\n"
                   "os.execv(sys.argv[1], sys.argv[1:])\n")


def with_stop_signals_reset(argv: list[str]) -> list[str]:
    """``argv`` started with SIGINT, SIGTERM and SIGHUP at their defaults (an ignored signal stays ignored across
    exec, a handler does not): a small Python resets them and execs ``argv[0]`` (a path) in the same process."""
    return [sys.executable, "-c", _RESET_AND_EXEC, *argv]


@contextlib.contextmanager
def stop_signals_at_defaults():
    """This process's SIGINT, SIGTERM and SIGHUP at their interactive defaults inside the block, then restored."""
    old = {sig: signal.signal(sig, h) for sig, h in _STOP_DEFAULTS.items()}
    try:
        yield
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


_GIVEN: set[int] = set()


def free_port() -> int:
    """A free port, never one this process was given before: a test often asks for several before anything binds
    them (a Ray node's components, a gateway beside a dashboard), and the kernel can hand out a free one twice,
    which Ray refuses ('the same port is used by multiple components')."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _GIVEN:
            _GIVEN.add(port)
            return port


def free_port_base(n: int, attempts: int = 50) -> int:
    """A port from which ``n`` consecutive ports are free now (worker i of a topology listens on base + i)."""
    for _ in range(attempts):
        base = free_port()
        if base + n > 65535:
            continue
        socks = []
        try:
            for port in range(base, base + n):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports found")


def llama_spec(name: str, binary: str, model: str | Path, port: int | None = None, node: str | None = None,
               alias: str = "tiny", extra: tuple[str, ...] = (), resources: dict | None = None, env: dict | None = None):
    from orchestrator.launch.spec import LaunchSpec

    port = port or free_port()
    argv = (binary, "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-c", "512", "-np", "2",
            "-t", "1", "--metrics", "--no-warmup", *extra)
    return LaunchSpec(name=name, argv=argv, env=env or {}, port=port, node=node, model_alias=alias,
                      resources=resources or {})


def http_json(url: str, timeout: float = 10.0, headers: dict | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as f:
            return f.status, json.loads(f.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def post_json(url: str, body: dict, timeout: float = 30.0, headers: dict | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as f:
            return f.status, json.loads(f.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def stream_completion(url: str, body: dict, timeout: float = 30.0) -> tuple[int, list[dict], bool]:
    """POST with ``stream: true``; returns (status, the parsed ``data:`` events, whether ``[DONE]`` came)."""
    req = urllib.request.Request(url, data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    events, done = [], False
    with urllib.request.urlopen(req, timeout=timeout) as f:
        assert f.headers.get("Content-Type", "").startswith("text/event-stream"), f.headers.get("Content-Type")
        for raw in f:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
            else:
                events.append(json.loads(data))
        return f.status, events, done


def processes_with(pattern) -> list:
    """Running processes (psutil.Process, zombies left out) whose command line contains ``pattern``."""
    import psutil

    out = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if str(pattern) in " ".join(p.info["cmdline"] or []) and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.Error:
            pass
    return out


def llama_servers(binary: str) -> list:
    """Running processes of this llama-server binary (psutil.Process)."""
    import psutil

    out = []
    for p in psutil.process_iter(["exe", "cmdline"]):
        try:
            if p.info["exe"] == binary or (p.info["cmdline"] or [""])[0] == binary:
                out.append(p)
        except psutil.Error:
            continue
    return out


def ray_processes_of(temp_dir: str) -> list:
    """Processes whose command line mentions a Ray temp dir (GCS, raylet, dashboard, workers)."""
    import psutil

    out = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(temp_dir in a for a in (p.info["cmdline"] or [])):
                out.append(p)
        except psutil.Error:
            continue
    return out


def wait_for(pred, timeout: float, interval: float = 0.2):
    end = time.monotonic() + timeout
    while True:
        v = pred()
        if v or time.monotonic() > end:
            return v
        time.sleep(interval)
