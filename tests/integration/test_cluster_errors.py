"""`up` with bad input and `up` stopped by Ctrl-C, with real parts (an embedded Ray head, real llama-server):

- no Ray reachable at the address, the gateway or dashboard port taken, the API key variable unset: one clear
  error before anything starts;
- a worker that cannot load its model under an embedded head: the cause from llama-server's log, and the head
  that `up` started is gone again with every process it had;
- a foreground `up` (the real entry point, in its own process) with an API key: the gateway wants the key;
  SIGINT stops workers, gateway and Ray, exit 0, nothing left.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cluster"))
import cluster_support as S  # noqa: E402

from orchestrator.errors import ClusterError, ConfigError, LaunchError  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.integration]


@pytest.fixture()
def iso(tmp_path, monkeypatch, llama_server_path):
    monkeypatch.setenv("ORCHESTRATOR_STATE", str(tmp_path / "state"))
    return {"tmp": tmp_path, "binary": llama_server_path, "model": S.write_tiny_llama(tmp_path / "tiny.gguf")}


def _dep(iso, **kw):
    from orchestrator.cluster import Deployment

    kw.setdefault("specs", (S.llama_spec("w0", iso["binary"], iso["model"]),))
    kw.setdefault("gateway_port", S.free_port())
    kw.setdefault("dashboard_port", S.free_port())
    return Deployment(**kw)


def test_unreachable_ray_address(iso):
    from orchestrator.cluster import state, up

    port = S.free_port()
    t = time.monotonic()
    with pytest.raises(ClusterError, match=rf"ray.address: cannot reach the Ray cluster at 127.0.0.1:{port}: "
                                           r"Connection refused"):
        up(_dep(iso, ray_address=f"127.0.0.1:{port}"), foreground=False, say=lambda m: None)
    assert time.monotonic() - t < 10
    assert state.recorded() == []


@pytest.mark.parametrize("which", ["gateway", "dashboard"])
def test_port_taken_before_anything_starts(iso, which):
    from orchestrator.cluster import state, up

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        dep = _dep(iso, **{f"{which}_port": port})
        label = "gateway.port" if which == "gateway" else "ray.dashboard_port"
        with pytest.raises(ClusterError, match=rf"{label}: cannot listen on 127.0.0.1:{port}: Address already in use"):
            up(dep, foreground=False, say=lambda m: None)
    assert state.recorded() == [] and not list(Path("/tmp").glob("orch-ray-*/session_*/logs/nothing"))


def test_api_key_variable_unset(iso, monkeypatch):
    from orchestrator.cluster import up

    monkeypatch.delenv("ORCH_NO_SUCH_KEY", raising=False)
    with pytest.raises(ConfigError, match="gateway.api_key_env: the environment variable ORCH_NO_SUCH_KEY is not set"):
        up(_dep(iso, api_key_env="ORCH_NO_SUCH_KEY"), foreground=False, say=lambda m: None)


def _cmdline(p) -> str:
    try:
        return " ".join(p.cmdline())
    except psutil.Error:            # exited between listing the tree and reading its command line
        return ""


@pytest.mark.slow
def test_load_failure_under_an_embedded_head_stops_the_head(iso, monkeypatch):
    from orchestrator.cluster import head as headmod
    from orchestrator.cluster import state, up

    seen = {}
    real_stop = headmod.stop_head

    def spy_stop(pid, started, temp_dir=None, **kw):     # records what the head had, then really stops it
        seen["tree"] = headmod.head_tree(pid, started)
        seen["cmds"] = [_cmdline(p) for p in seen["tree"]]
        seen["temp_dir"] = temp_dir
        return real_stop(pid, started, temp_dir, **kw)

    monkeypatch.setattr(headmod, "stop_head", spy_stop)
    bad = iso["tmp"] / "bad.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(8192))
    dep = _dep(iso, specs=(S.llama_spec("w0", iso["binary"], iso["model"]),
                           S.llama_spec("w1", iso["binary"], bad)), namespace="err-embedded")
    with pytest.raises(LaunchError, match=r"worker w1: failed to start: (exited with status \d+|killed by SIG\w+) "
                                          r"while loading: .*(bad\.gguf|model)"):
        up(dep, foreground=False, say=lambda m: None)
    tree = seen["tree"]
    assert any("raylet" in c for c in seen["cmds"]) and any("gcs_server" in c for c in seen["cmds"])
    left = [p for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert left == []
    assert S.ray_processes_of(seen["temp_dir"]) == []
    assert [p for p in S.llama_servers(iso["binary"]) if str(iso["tmp"]) in _cmdline(p)] == []
    assert state.read("err-embedded") is None


@pytest.mark.slow
def test_foreground_up_with_api_key_and_ctrl_c(iso):
    from orchestrator.cluster import state

    dep = _dep(iso, specs=(S.llama_spec("w0", iso["binary"], iso["model"]),), namespace="fg",
               api_key_env="ORCH_TEST_GATEWAY_KEY")
    f = iso["tmp"] / "dep.json"
    f.write_text(json.dumps(dep.to_dict()))
    env = {**os.environ, "PYTHONPATH": str(REPO), "ORCH_TEST_GATEWAY_KEY": "k-123"}
    proc = subprocess.Popen(S.with_stop_signals_reset([sys.executable, "-m", "orchestrator.cluster", "up", str(f)]),
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    gw = f"http://127.0.0.1:{dep.gateway_port}"
    try:
        def running():
            st = state.read("fg")
            return proc.poll() is not None or (st is not None and st.phase == "running" and _ok(gw + "/health"))
        assert S.wait_for(running, 120), "never ready"
        assert proc.poll() is None
        st = state.read("fg")
        assert st is not None and st.foreground and st.up_pid == proc.pid
        tree = psutil.Process(st.head_pid).children(recursive=True) + [psutil.Process(st.head_pid)]
        code, body = S.post_json(gw + "/v1/completions", {"prompt": "x", "max_tokens": 4})
        assert code == 401 and body["error"]["code"] == "invalid_api_key"
        code, body = S.post_json(gw + "/v1/completions", {"prompt": "x", "max_tokens": 4},
                                 headers={"Authorization": "Bearer k-123"})
        assert code == 200
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out
    assert "stopping workers, gateway and Ray" in out and "stopped (1 worker(s), Ray head)" in out
    assert [p for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE] == []
    assert [p for p in S.llama_servers(iso["binary"]) if str(iso["tmp"]) in _cmdline(p)] == []
    assert state.read("fg") is None and not _ok(gw + "/health")


def _ok(url: str) -> bool:
    try:
        return S.http_json(url, timeout=2)[0] == 200
    except OSError:
        return False


def _orch_ray_dirs() -> set[str]:
    return {str(p) for p in Path("/tmp").glob("orch-ray-*")}


@pytest.mark.slow
def test_a_plan_that_fails_starts_no_ray_head(iso, tmp_path):
    """A model that cannot be read fails the plan: one line, exit 2, and no Ray head was started for it."""
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(64))
    topo = tmp_path / "t.yaml"
    topo.write_text(f"model:\n  path: {bad}\ngateway:\n  port: {S.free_port()}\nray:\n  address: local\n"
                    f"  dashboard_port: {S.free_port()}\n  namespace: early-fail\n")
    env = {**os.environ, "PYTHONPATH": str(REPO), "LLAMA_SERVER": iso["binary"]}
    res = subprocess.run([sys.executable, "-m", "orchestrator", "up", str(topo), "--detach"], env=env,
                         capture_output=True, text=True, timeout=180)
    assert res.returncode == 2, res.stderr
    err = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(err) == 1 and "bad.gguf" in err[0] and "Traceback" not in res.stderr, res.stderr
    assert not (Path(os.environ["ORCHESTRATOR_STATE"]) / "logs" / "early-fail" / "ray-head.log").exists()
    from orchestrator.cluster import state

    assert state.read("early-fail") is None


def _live_record(iso, namespace: str):
    """A state record of a running deployment: its 'head' a live process of ours (the pid and start time as
    up records them)."""
    from orchestrator.cluster import state
    from orchestrator.cluster.procs import started_since_boot

    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    state.write(state.ClusterState(namespace=namespace, ray_address="127.0.0.1:1", embedded=True, up_pid=holder.pid,
                                   started_at=time.time(), phase="running", head_pid=holder.pid,
                                   head_started=started_since_boot(holder.pid), gateway_url="http://127.0.0.1:1"))
    return holder


@pytest.mark.parametrize("conflict", ["running", "gateway", "worker", "model"])
def test_cli_up_refuses_a_conflict_before_the_plan_is_printed_or_ray_starts(iso, tmp_path, conflict):
    """A deployment already running, the gateway's or a worker's port taken (the holder named), a model file that
    is not there: one line, exit 2, within seconds; no plan printed, no Ray head, no llama-server."""
    ns = f"pre-{conflict}"
    env = {**os.environ, "PYTHONPATH": str(REPO), "LLAMA_SERVER": iso["binary"]}
    holder = None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        topo = _one_worker_topology(iso, tmp_path / "t.yaml", ns, gateway_port=taken if conflict == "gateway" else None)
        text = topo.read_text()
        if conflict == "worker":
            text = text.replace("  replicas: 1\n", f"  replicas: 1\n  port_base: {taken}\n")
        if conflict == "model":
            text = text.replace(str(iso["model"]), str(tmp_path / "missing.gguf"))
        topo.write_text(text)
        if conflict == "running":
            holder = _live_record(iso, ns)
        t0 = time.monotonic()
        try:
            res = subprocess.run([sys.executable, "-m", "orchestrator", "up", str(topo)], env=env,
                                 capture_output=True, text=True, timeout=120)
        finally:
            if holder is not None:
                holder.kill()
                holder.wait()
        took = time.monotonic() - t0
    want = {"running": rf"deployment '{ns}' is already running",
            "gateway": rf"gateway\.port: cannot listen on 127\.0\.0\.1:{taken}: .*held by pid {os.getpid()} ",
            "worker": rf"workers\.port_base: worker \S+ cannot listen: 127\.0\.0\.1:{taken} is already in use by "
                      rf"pid {os.getpid()} ",
            "model": r"model\.path: model file .*missing\.gguf does not exist"}[conflict]
    err = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == 2 and len(err) == 1 and re.search(want, err[0]), res.stderr
    assert took < 20, f"refused after {took:.1f}s"
    assert not (Path(os.environ["ORCHESTRATOR_STATE"]) / "logs" / ns / "ray-head.log").exists(), "Ray was started"
    assert [q for q in _ours(str(tmp_path)) if q.name() == "llama-server"] == []


@pytest.mark.slow
def test_up_takes_over_the_head_started_during_planning(iso):
    from orchestrator.cluster import down, state, up
    from orchestrator.cluster.lifecycle import start_early_head

    dep = _dep(iso, namespace="early-ok")
    early = start_early_head("early-ok", nodes=[("local", None)], gateway_host=dep.gateway_host,
                             gateway_port=dep.gateway_port, dashboard_host=dep.dashboard_host,
                             dashboard_port=dep.dashboard_port, metrics_port=None, log_dir=None)
    assert early is not None
    try:
        res = up(dep, foreground=False, say=lambda m: None, early=early)
        st = state.read("early-ok")
        assert res.status["phase"] == "ready" and st.head_pid == early.info.pid and st.phase == "running"
        from orchestrator.cluster.head import head_tree

        tree = head_tree(st.head_pid, st.head_started)
        assert any("raylet" in _cmdline(p) for p in tree)
    finally:
        down("early-ok", say=lambda m: None)
    assert [p for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE] == []
    assert state.read("early-ok") is None


def test_no_early_head_when_up_would_not_use_it(iso):
    from orchestrator.cluster.lifecycle import start_early_head

    kw = dict(gateway_host="127.0.0.1", dashboard_host="127.0.0.1", dashboard_port=S.free_port(), metrics_port=None,
              log_dir=None)
    assert start_early_head("x", nodes=[("a", None), ("b", "10.0.0.2")], gateway_port=S.free_port(), **kw) is None
    assert start_early_head("x", nodes=[("a", "10.0.0.2")], gateway_port=S.free_port(), **kw) is None
    with socket.socket() as s:                     # the gateway port is taken: up will say so, no head first
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert start_early_head("x", nodes=[("a", None)], gateway_port=s.getsockname()[1], **kw) is None


@pytest.mark.slow
def test_sigterm_while_waiting_for_the_early_head_stops_it(iso, monkeypatch):
    """SIGTERM (like Ctrl-C) while `up` waits for the head it started during planning: the head is stopped
    once it is up, nothing is recorded. (An interrupted Thread.join once hid the still-starting head.)"""
    import threading

    from orchestrator.cluster import state, up
    from orchestrator.cluster.lifecycle import start_early_head

    from orchestrator.cluster import head as headmod

    stopped = []
    real_stop = headmod.stop_head
    monkeypatch.setattr(headmod, "stop_head", lambda pid, ct, temp_dir=None, **kw: stopped.append(temp_dir) or
                        real_stop(pid, ct, temp_dir, **kw))
    dep = _dep(iso, namespace="early-term")
    early = start_early_head("early-term", nodes=[("local", None)], gateway_host=dep.gateway_host,
                             gateway_port=dep.gateway_port, dashboard_host=dep.dashboard_host,
                             dashboard_port=dep.dashboard_port, metrics_port=None, log_dir=None)
    assert early is not None
    threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGTERM)).start()
    with pytest.raises(KeyboardInterrupt):
        up(dep, foreground=False, say=lambda m: None, early=early)
    head_log = Path(os.environ["ORCHESTRATOR_STATE"]) / "logs" / "early-term" / "ray-head.log"
    assert "Ray runtime started" in head_log.read_text()          # it did come up, and then
    assert early.info is None                                     # it was stopped again
    assert len(stopped) == 1 and S.ray_processes_of(stopped[0]) == [] and not Path(stopped[0]).exists()
    assert state.read("early-term") is None


@pytest.mark.slow
def test_cli_up_reads_the_model_ahead_while_ray_starts_and_can_be_told_not_to(iso, tmp_path):
    """`orchestrator up` on this one-node machine: the model is read into the page cache while the head starts
    (a note says so), the deployment comes up and serves; with workers.prefetch false there is no such note."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "LLAMA_SERVER": iso["binary"]}
    for prefetch in ("true", "false"):
        gw_port = S.free_port()
        topo = tmp_path / f"p-{prefetch}.yaml"
        topo.write_text(f"model:\n  path: {iso['model']}\n  context: 1024\nworkers:\n  prefetch: {prefetch}\n"
                        "  early_start: false\n"
                        f"gateway:\n  port: {gw_port}\nray:\n  address: local\n  dashboard_port: {S.free_port()}\n"
                        f"  namespace: prefetch-{prefetch}\n")
        res = subprocess.run([sys.executable, "-m", "orchestrator", "up", str(topo), "--detach"], env=env,
                             capture_output=True, text=True, timeout=240)
        try:
            assert res.returncode == 0, res.stderr
            assert ("prefetch: reading the model" in res.stderr) == (prefetch == "true"), res.stderr
            with urllib.request.urlopen(f"http://127.0.0.1:{gw_port}/v1/models", timeout=10) as r:
                assert r.status == 200
        finally:
            subprocess.run([sys.executable, "-m", "orchestrator", "down", "-n", f"prefetch-{prefetch}"], env=env,
                           capture_output=True, text=True, timeout=180)


def _one_worker_topology(iso, path: Path, namespace: str, gateway_port: int | None = None,
                         dashboard_port: int | None = None, gateway_extra: str = "") -> Path:
    """A topology file: the tiny model, one CPU replica, an embedded head, free ports (the CLI tests' deployment)."""
    path.write_text(f"model:\n  path: {iso['model']}\n  context: 1024\nworkers:\n  replicas: 1\n"
                    f"gateway:\n  port: {gateway_port or S.free_port()}\n{gateway_extra}"
                    f"ray:\n  address: local\n  dashboard_port: {dashboard_port or S.free_port()}\n"
                    f"  namespace: {namespace}\n")
    return path


_ours = S.processes_with


def _keepers(namespace: str) -> list:
    """The keepers of ``namespace``'s early llama-servers still running (their hand-over files are in its run
    folder); another test's deployment may still be stopping its own."""
    from orchestrator.cluster.state import run_dir

    return [p for p in _ours("orchestrator.cluster.keeper") if str(run_dir(namespace)) in " ".join(p.cmdline())]


def _status(env, ns):
    res = subprocess.run([sys.executable, "-m", "orchestrator", "status", "-n", ns, "--json"], env=env,
                         capture_output=True, text=True, timeout=60)      # exit 1 while a worker is not ready
    assert res.stdout.strip(), res.stderr
    return {w["name"]: w for w in json.loads(res.stdout)["workers"]}


@pytest.mark.slow
def test_cli_up_starts_llama_server_while_ray_starts_and_the_worker_adopts_it(iso, tmp_path):
    """workers.early_start (the default with an embedded head): `up` starts llama-server before Ray is up, under a
    keeper; the worker actor adopts it (status says so). kill -9 of that server: the worker restarts its own,
    with the cause. `down`: no llama-server and no keeper left."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "LLAMA_SERVER": iso["binary"]}
    gw_port = S.free_port()
    topo = _one_worker_topology(iso, tmp_path / "early.yaml", "early-cli", gateway_port=gw_port)
    res = subprocess.run([sys.executable, "-m", "orchestrator", "up", str(topo), "--detach"], env=env,
                         capture_output=True, text=True, timeout=240)
    try:
        assert res.returncode == 0, res.stderr
        assert "starting now, while Ray starts (workers.early_start)" in res.stderr
        assert "spawned by up at +" in res.stderr and "adopted healthy at +" in res.stderr, res.stderr
        (name, w), = _status(env, "early-cli").items()
        assert w["state"] == "ready" and w["adopted"] is True
        server = psutil.Process(w["pid"])
        assert "orchestrator.cluster.keeper" in " ".join(server.parent().cmdline())
        with urllib.request.urlopen(f"http://127.0.0.1:{gw_port}/v1/models", timeout=10) as r:
            assert r.status == 200
        server.kill()                                             # kill -9 of the adopted llama-server
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            w = _status(env, "early-cli")[name]
            if w["state"] == "ready" and w["pid"] != server.pid:
                break
            time.sleep(0.5)
        assert w["state"] == "ready" and w["restarts"] == 1 and "SIGKILL" in w["last_error"], w
        assert w["adopted"] is False
        assert psutil.Process(w["pid"]).parent().name().startswith("ray::WorkerActor")
    finally:
        down = subprocess.run([sys.executable, "-m", "orchestrator", "down", "-n", "early-cli"], env=env,
                              capture_output=True, text=True, timeout=180)
    assert down.returncode == 0, down.stderr
    assert _keepers("early-cli") == []
    assert [p for p in _ours(iso["model"]) if p.name() == "llama-server"] == []


@pytest.mark.slow
def test_cli_up_failing_after_the_early_start_stops_that_llama_server(iso, tmp_path):
    """The early llama-server is already loading when `up` fails (here: the API key variable is unset): exit 1
    with the one-line reason, and neither the server nor its keeper is left."""
    env = {k: v for k, v in os.environ.items() if k != "ORCH_TEST_NO_SUCH_KEY"}
    env.update({"PYTHONPATH": str(REPO), "LLAMA_SERVER": iso["binary"]})
    topo = _one_worker_topology(iso, tmp_path / "fail.yaml", "early-fail",
                                gateway_extra="  api_key_env: ORCH_TEST_NO_SUCH_KEY\n")
    res = subprocess.run([sys.executable, "-m", "orchestrator", "up", str(topo), "--detach"], env=env,
                         capture_output=True, text=True, timeout=240)
    assert res.returncode != 0
    assert "starting now, while Ray starts" in res.stderr
    assert "ORCH_TEST_NO_SUCH_KEY is not set" in res.stderr and "Traceback" not in res.stderr
    assert _keepers("early-fail") == []
    assert [p for p in _ours(iso["model"]) if p.name() == "llama-server"] == []


@pytest.mark.slow
def test_cli_up_interrupted_before_the_handover_stops_the_early_llama_server(iso, tmp_path):
    """SIGTERM to `up` while the early llama-server loads and Ray still starts: exit 143 (128 + SIGTERM: up did not
    get to serve), and neither that server, its keeper nor the Ray head is left."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "LLAMA_SERVER": iso["binary"]}
    topo = _one_worker_topology(iso, tmp_path / "int.yaml", "early-int")
    p = subprocess.Popen(S.with_stop_signals_reset([sys.executable, "-m", "orchestrator", "up", str(topo)]), env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    seen = []
    for line in p.stdout:
        seen.append(line)
        if "while Ray starts" in line:
            break
    time.sleep(1.0)
    assert _keepers("early-int"), "".join(seen)     # it is running now, before any actor
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=180)
    assert p.returncode == 128 + signal.SIGTERM, "".join(seen) + out
    assert "Traceback" not in out
    assert _keepers("early-int") == []
    assert [q for q in _ours(iso["model"]) if q.name() == "llama-server"] == []
    state = Path(os.environ["ORCHESTRATOR_STATE"]) / "cluster" / "early-int.json"
    assert not state.exists()


@pytest.mark.slow
def test_up_killed_while_the_head_starts_leaves_what_down_can_clean_up(iso, tmp_path):
    """kill -9 of `up` while its Ray head is still starting (its GCS runs, `ray start` has not finished): the early
    llama-server stops with its owner (the keeper sees `up` gone), and the head, recorded as soon as its process
    existed, is stopped by `down` with every process it had. (Recorded only once started, it was left running.)"""
    env = {**os.environ, "PYTHONPATH": str(REPO), "LLAMA_SERVER": iso["binary"]}
    dash = S.free_port()
    topo = _one_worker_topology(iso, tmp_path / "kill.yaml", "early-kill", dashboard_port=dash)
    state = Path(os.environ["ORCHESTRATOR_STATE"]) / "cluster" / "early-kill.json"
    p = subprocess.Popen(S.with_stop_signals_reset([sys.executable, "-m", "orchestrator", "up", str(topo)]), env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)

    def gcs_of_our_head():
        for q in _ours("--dashboard-port"):
            cmd = q.cmdline()
            if str(dash) in cmd and "--temp-dir" in cmd:
                temp = cmd[cmd.index("--temp-dir") + 1]
                return temp if any("gcs_server" in " ".join(r.cmdline()) for r in S.ray_processes_of(temp)) else None
        return None

    try:
        temp = S.wait_for(gcs_of_our_head, timeout=60, interval=0.05)
        p.kill()                                   # while `ray start` still brings up the rest
        p.wait()
        assert state.exists(), "the head was not recorded while it started"
        assert json.loads(state.read_text())["head_temp_dir"] == temp
        deadline = time.monotonic() + 10
        while _keepers("early-kill") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _keepers("early-kill") == []
        assert [q for q in _ours(iso["model"]) if q.name() == "llama-server"] == []
    finally:
        p.kill()
        res = subprocess.run([sys.executable, "-m", "orchestrator", "down", "-n", "early-kill"], env=env,
                             capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stderr
    assert S.ray_processes_of(temp) == [] and not state.exists()
