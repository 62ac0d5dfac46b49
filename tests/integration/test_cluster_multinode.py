"""A Ray cluster of two nodes on this one machine (two real `ray start`, node names `a` and `b`), used as an
external cluster (`ray.address: host:port`):

- a topology naming both nodes: each worker's llama-server runs under the Ray node its spec names, and the gateway
  serves from both; `down` stops our workers and actors and leaves the cluster (not ours) running;
- bad input against a running cluster: unknown node, binary missing, model missing, a model that fails to load,
  a worker port already taken: one clear error with llama-server's own reason, and nothing left running.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cluster"))
import cluster_support as S  # noqa: E402

from orchestrator.errors import LaunchError  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _ray_start(args, log: Path, auth: str) -> subprocess.Popen:
    env = dict(os.environ, RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0", PYTHONPATH=str(REPO), RAY_AUTH_MODE=auth)
    ports = []
    for opt in ("--node-manager-port", "--object-manager-port", "--dashboard-agent-listen-port",
                "--dashboard-agent-grpc-port", "--runtime-env-agent-port", "--metrics-export-port"):
        ports += [opt, str(S.free_port())]
    argv = [sys.executable, "-m", "ray.scripts.scripts", "start", "--block", "--disable-usage-stats",
            "--node-ip-address", "127.0.0.1", "--num-cpus", "1", "--min-worker-port", "0", "--max-worker-port", "0",
            *ports, *args]
    return subprocess.Popen(argv, env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, llama_server_path):
    from orchestrator.cluster.head import ensure_auth

    tmp = tmp_path_factory.mktemp("mn")
    gcs = S.free_port()
    auth = ensure_auth()          # Ray's default for a new cluster: token auth, the token in ~/.ray/auth_token
    temp_dir = f"/tmp/orch-mn-{os.getpid()}"
    head = _ray_start(["--head", "--port", str(gcs), "--node-name", "a", "--temp-dir", temp_dir,
                       "--include-dashboard", "false", "--ray-client-server-port", str(S.free_port()),
                       "--resources", '{"site_a": 1}'], tmp / "a.log", auth)
    nodes = [head]
    try:
        assert S.wait_for(lambda: _connects(gcs) and b"Ray runtime started" in (tmp / "a.log").read_bytes(), 90), \
            (tmp / "a.log").read_text()[-2000:]
        nodes.append(_ray_start(["--address", f"127.0.0.1:{gcs}", "--node-name", "b", "--resources",
                                 '{"site_b": 1}'], tmp / "b.log", auth))
        assert S.wait_for(lambda: b"Ray runtime started" in (tmp / "b.log").read_bytes(), 90), \
            (tmp / "b.log").read_text()[-2000:]
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("ORCHESTRATOR_STATE", str(tmp / "state"))
            yield {"address": f"127.0.0.1:{gcs}", "a": head, "b": nodes[1], "tmp": tmp,
                   "model": S.write_tiny_llama(tmp / "tiny.gguf"), "binary": llama_server_path}
    finally:
        _leave_cluster()
        for p in nodes:
            p.terminate()
        for p in nodes:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, 9)
                p.wait()
        import shutil

        shutil.rmtree(temp_dir, ignore_errors=True)


def _leave_cluster() -> None:
    """This process stays the driver of the cluster that `up` and `down` connected it to. Leave it before the
    cluster stops and its temp dir (which holds this driver's log) goes: a driver left behind writes to a closed
    log at exit, and Ray's core worker has aborted there ("corrupted size vs. prev_size")."""
    from orchestrator.cluster.ray_api import RayApi

    RayApi().disconnect()


def _connects(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def _tree(p: subprocess.Popen) -> set[int]:
    try:
        return {c.pid for c in psutil.Process(p.pid).children(recursive=True)}
    except psutil.Error:
        return set()


def _our_actor_processes(cluster) -> list[str]:
    out = []
    for node in ("a", "b"):
        for pid in _tree(cluster[node]):
            try:
                cmd = psutil.Process(pid).cmdline()
            except psutil.Error:
                continue
            if cmd and cmd[0].startswith(("ray::WorkerActor", "ray::ControllerActor", "ray::GatewayActor")):
                out.append(f"{node}:{pid}:{cmd[0]}")
    return out


def _servers(cluster) -> list:
    return [p for p in S.llama_servers(cluster["binary"]) if str(cluster["tmp"]) in " ".join(p.cmdline())]


def _deployment(cluster, specs, ns):
    from orchestrator.cluster import Deployment, RestartPolicy

    return Deployment(specs=tuple(specs), ray_address=cluster["address"], gateway_port=S.free_port(), namespace=ns,
                      restart=RestartPolicy(backoff_initial_s=0.5, load_timeout_s=60))


def _assert_nothing_left(cluster):
    assert S.wait_for(lambda: not _our_actor_processes(cluster), 20), _our_actor_processes(cluster)
    assert S.wait_for(lambda: not _servers(cluster), 10), [p.cmdline() for p in _servers(cluster)]


def test_each_worker_runs_on_its_node_and_the_gateway_serves_both(cluster):
    from orchestrator.cluster import down, status, up
    from orchestrator.cluster.metrics import fetch_text, parse_prometheus

    specs = [S.llama_spec("wa", cluster["binary"], cluster["model"], node="a", resources={"site_a": 1}),
             S.llama_spec("wb", cluster["binary"], cluster["model"], node="b", resources={"site_b": 1})]
    dep = _deployment(cluster, specs, "mn")
    res = up(dep, foreground=False, say=lambda m: None)
    try:
        st = status("mn")
        by = {w["name"]: w for w in st["workers"]}
        assert by["wa"]["node"] == "a" and by["wb"]["node"] == "b"
        # the real check: each llama-server is a descendant of the `ray start` of its node
        assert by["wa"]["pid"] in _tree(cluster["a"]) and by["wa"]["pid"] not in _tree(cluster["b"])
        assert by["wb"]["pid"] in _tree(cluster["b"]) and by["wb"]["pid"] not in _tree(cluster["a"])

        environ = open(f"/proc/{by['wa']['pid']}/environ").read().split("\0")   # the deployment's server key
        key = dict(ln.split("=", 1) for ln in environ if "=" in ln)["LLAMA_API_KEY"]

        def predicted(s):
            page = fetch_text(s.url, "/metrics", 5, headers={"Authorization": f"Bearer {key}"})
            return parse_prometheus(page)["llamacpp:tokens_predicted_total"]

        before = [predicted(s) for s in specs]
        codes = []
        ts = [threading.Thread(target=lambda: codes.append(S.post_json(
            res.gateway_url + "/v1/completions", {"prompt": "both", "max_tokens": 24, "ignore_eos": True})[0]))
            for _ in range(6)]
        [t.start() for t in ts]
        [t.join() for t in ts]
        assert codes == [200] * 6
        after = [predicted(s) for s in specs]
        assert all(x > y for x, y in zip(after, before)), (before, after)
    finally:
        d = down("mn", say=lambda m: None)
    assert not d.head_stopped                      # not our cluster: it stays up
    assert {w["name"] for w in d.workers} == {"wa", "wb"}
    _assert_nothing_left(cluster)
    assert cluster["a"].poll() is None and cluster["b"].poll() is None


def test_unknown_node_is_a_clear_error(cluster):
    from orchestrator.cluster import state, up

    dep = _deployment(cluster, [S.llama_spec("wz", cluster["binary"], cluster["model"], node="zz")], "mn-node")
    with pytest.raises(LaunchError, match=r"node 'zz' is not in the Ray cluster \(alive nodes: a \(.*\), b \("):
        up(dep, foreground=False, say=lambda m: None)
    assert state.read("mn-node") is None
    _assert_nothing_left(cluster)


@pytest.mark.parametrize("case", ["binary", "model", "load", "port"])
def test_bad_worker_input_fails_with_the_cause_and_leaves_nothing(cluster, case):
    from orchestrator.cluster import state, up

    tmp, binary, model = cluster["tmp"], cluster["binary"], cluster["model"]
    holder = None
    if case == "binary":
        spec = S.llama_spec("w0", str(tmp / "bin" / "llama-server"), model)
        want = r"worker w0: failed to start: cannot run '.*/bin/llama-server': not found or not executable"
    elif case == "model":
        spec = S.llama_spec("w0", binary, tmp / "missing.gguf")
        want = r"worker w0: failed to start: (exited with status \d+|killed by SIG\w+) while loading: .*missing\.gguf.*No such file"
    elif case == "load":
        bad = tmp / "bad.gguf"
        bad.write_bytes(b"GGUF" + os.urandom(8192))
        spec = S.llama_spec("w0", binary, bad)
        want = r"worker w0: failed to start: (exited with status \d+|killed by SIG\w+) while loading: .*(model|gguf)"
    else:
        holder = socket.socket()
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        spec = S.llama_spec("w0", binary, model, port=holder.getsockname()[1])
        want = rf"127\.0\.0\.1:{spec.port} is already in use by pid {os.getpid()}"
    dep = _deployment(cluster, [spec, S.llama_spec("ok", binary, model)], f"mn-{case}")
    try:
        with pytest.raises(LaunchError, match=want):
            up(dep, foreground=False, say=lambda m: None)
    finally:
        if holder:
            holder.close()
    assert state.read(dep.namespace) is None
    _assert_nothing_left(cluster)                    # the healthy worker "ok" was stopped too


def test_cli_exit_status_and_one_line_error(cluster, tmp_path):
    import json

    dep = _deployment(cluster, [S.llama_spec("w0", cluster["binary"], tmp_path / "nope.gguf")], "mn-cli")
    f = tmp_path / "dep.json"
    f.write_text(json.dumps(dep.to_dict()))
    res = subprocess.run([sys.executable, "-m", "orchestrator.cluster", "up", str(f), "--detach"],
                         capture_output=True, text=True, timeout=180,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert res.returncode == 2
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("orchestrator up: error: worker w0: failed to start:") and "No such file" in last
    assert "Traceback" not in res.stderr
    _assert_nothing_left(cluster)
