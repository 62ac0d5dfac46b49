"""What the expert-cache tests share: llama-server on ggml's RPC device as a stand-in GPU (the RPC tests and
lab/bench/cache_miss_modes.py), and what they compare in its answers (also the GPU tests)."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

N_PREDICT = 48
PROMPT = [785, 374, 138, 838, 342, 916, 279, 156, 556, 13, 576, 397, 876, 388, 208, 96]


def probs(out: dict) -> list[list[float]]:
    """The top probabilities of every generated step (llama-server names them by version and options)."""
    steps = []
    for step in out["completion_probabilities"]:
        top = step.get("top_logprobs") or step.get("top_probs") or step.get("probs") or []
        steps.append([math.exp(p["logprob"]) if "logprob" in p else p["prob"] for p in top])
    assert steps and all(steps), f"no probabilities in {list(out)}"
    return steps


def agreement(a: dict, b: dict) -> tuple[int, float]:
    """How many leading tokens two answers share, and the largest difference of their top probabilities over
    those steps (the first step at least): the comparison of two paths with different kernels."""
    same = 0
    for x, y in zip(a["tokens"], b["tokens"]):
        if x != y:
            break
        same += 1
    pa, pb = probs(a), probs(b)
    worst = max(abs(x - y) for step in range(max(1, same)) for x, y in zip(pa[step], pb[step]))
    return same, worst


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(cond, timeout: float, what: str, log: Path, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert proc.poll() is None, f"{what} exited:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"{what} not ready after {timeout:.0f}s:\n{log.read_text()[-3000:]}"
        time.sleep(0.1)


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _start(argv: list[str], log: Path) -> subprocess.Popen:
    with open(log, "w") as lf:
        return subprocess.Popen(argv, stdout=lf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def one_completion(server: str, rpc_server: str, model: Path, tmp: Path, name: str, extra: list[str],
                   sampling=None):
    """One llama-server whose 'GPU' is a fresh ggml-rpc-server: a completion (greedy, or ``sampling``'s request
    fields) and the /metrics values."""
    ((out, metrics),), text = completions_in_turn(server, rpc_server, model, tmp, name, extra, [sampling or {}])
    return out, metrics, text


def server_path() -> str:
    """The llama-server the device tests run, which run without the suite's conftest: $LLAMA_SERVER, else the
    one orchestrator finds."""
    path = os.environ.get("LLAMA_SERVER")
    if not path:
        from orchestrator.backend.detect import find_llama_server

        path, _ = find_llama_server(None)
    return path


def metrics_of(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        return {k: float(v) for k, v in re.findall(r"^llamacpp:(\w+) (\S+)$", r.read().decode(), re.M)}


def serve_in_turn(argv: list[str], log: Path, url: str, bodies: list[dict],
                  env: dict | None = None) -> tuple[list[tuple[dict, dict]], str]:
    """Start llama-server (``argv``, listening at ``url``), answer ``bodies`` one after another (greedy completions
    of PROMPT unless a body says otherwise), reading /metrics after each; stop it. Returns ([(answer, metrics)],
    log)."""
    with open(log, "w") as lf:
        proc = subprocess.Popen(argv, stdout=lf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, **(env or {})}, start_new_session=True)
    out = []
    try:
        _wait(lambda: _healthy(url), 300, "llama-server", log, proc)
        for body in bodies:
            req_body = {"prompt": PROMPT, "n_predict": N_PREDICT, "temperature": 0.0, "n_probs": 4,
                        "ignore_eos": True, "cache_prompt": False, "return_tokens": True, **body}
            req = urllib.request.Request(url + "/completion", data=json.dumps(req_body).encode(),
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=600) as r:
                answer = json.loads(r.read())
            out.append((answer, metrics_of(url)))
    finally:
        _stop(proc)
    return out, log.read_text()


def completions_in_turn(server: str, rpc_server: str, model: Path, tmp: Path, name: str, extra: list[str],
                        bodies: list[dict], env: dict | None = None,
                        experts: tuple[str, ...] = ("--cpu-moe",)) -> tuple[list[tuple[dict, dict]], str]:
    """:func:`serve_in_turn` on a llama-server whose 'GPU' is a fresh ggml-rpc-server; ``experts``: the options
    that leave the routed experts in host memory (every one of them by default)."""
    rpc_port, port = _port(), _port()
    rpc = _start([rpc_server, "-H", "127.0.0.1", "-p", str(rpc_port), "-t", "1"], tmp / f"{name}-rpc.log")
    try:
        _wait(lambda: _listening(rpc_port), 60, "ggml-rpc-server", tmp / f"{name}-rpc.log", rpc)
        argv = [server, "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-c", "1024", "-np", "1",
                "--rpc", f"127.0.0.1:{rpc_port}", "-ngl", "999", *experts, "--no-repack", "--metrics",
                "--no-warmup", "-t", "1", *extra]
        return serve_in_turn(argv, tmp / f"{name}.log", f"http://127.0.0.1:{port}", bodies, env)
    finally:
        _stop(rpc)
