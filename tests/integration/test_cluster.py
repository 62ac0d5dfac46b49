"""The single-machine proof, with real parts: an embedded Ray head, two real llama-server replicas of a tiny GGUF,
the gateway, Ray's metrics endpoint, a kill -9, and `orchestrator down` leaving nothing behind.

The tests run in file order against one deployment (module fixture): Ray start costs ~10 s on this machine.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cluster"))
import cluster_support as S  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.integration, pytest.mark.slow]
NS = "itest-single"


@pytest.fixture(scope="module")
def env(tmp_path_factory, llama_server_path):
    tmp = tmp_path_factory.mktemp("cluster")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ORCHESTRATOR_STATE", str(tmp / "state"))
        model = S.write_tiny_llama(tmp / "tiny.gguf")
        from orchestrator.cluster import Deployment, RestartPolicy, up

        dep = Deployment(
            specs=(S.llama_spec("w0", llama_server_path, model), S.llama_spec("w1", llama_server_path, model)),
            gateway_port=S.free_port(), dashboard_port=S.free_port(), namespace=NS, plan_json={"demo": True},
            gateway_processes=2,
            restart=RestartPolicy(backoff_initial_s=0.5, health_timeout_s=5.0, load_timeout_s=60.0))
        t = time.monotonic()
        said: list[str] = []
        res = up(dep, foreground=False, say=said.append)
        from orchestrator.cluster import state

        st = state.read(NS)
        info = {"dep": dep, "res": res, "model": model, "binary": llama_server_path, "state": st, "tmp": tmp,
                "up_s": time.monotonic() - t, "said": said}
        try:
            yield info
        finally:
            if state.read(NS) is not None:      # a failed test must not leave the deployment running
                from orchestrator.cluster import down

                down(NS, say=lambda m: None)


def gw(env, path):
    return env["res"].gateway_url + path


def test_up_reports_urls_and_ready_workers(env):
    res, dep = env["res"], env["dep"]
    assert res.gateway_url == f"http://127.0.0.1:{dep.gateway_port}"
    assert res.dashboard_url == f"http://127.0.0.1:{dep.dashboard_port}"
    assert res.status["phase"] == "ready"
    assert [w["state"] for w in res.status["workers"]] == ["ready", "ready"]
    assert env["state"].embedded and psutil.pid_exists(env["state"].head_pid)
    # the ready line says where the time went: the head, then each llama-server's spawn time and load
    ready = next(m for m in env["said"] if m.startswith("ready in "))
    m = re.match(r"ready in ([\d.]+)s \(Ray head ([\d.]+)s; llama-server (.*)\)", ready)
    assert m, ready
    total, head = float(m.group(1)), float(m.group(2))
    spawns = re.findall(r"(w[01]) spawned at \+([\d.]+)s, loaded in ([\d.]+)s", m.group(3))
    assert sorted(w for w, _, _ in spawns) == ["w0", "w1"], ready
    for _w, at, load in spawns:
        assert head <= float(at) and float(at) + float(load) <= total + 0.2, ready
    print(f"up to ready: {env['up_s']:.1f}s")


def test_completion_through_the_gateway(env):
    code, body = S.post_json(gw(env, "/v1/completions"), {"model": "tiny", "prompt": "hello", "max_tokens": 8})
    assert code == 200 and body["object"] == "text_completion" and body["usage"]["completion_tokens"] > 0
    code, body = S.post_json(gw(env, "/v1/chat/completions"),
                             {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8})
    assert code == 200 and body["choices"][0]["message"]["role"] == "assistant"


def test_streamed_completion_through_the_gateway(env):
    code, events, done = S.stream_completion(gw(env, "/v1/chat/completions"),
                                             {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 12})
    assert code == 200 and done and len(events) >= 2
    assert all(e["object"] == "chat.completion.chunk" for e in events)


def test_replicas_answer_only_the_gateway_which_adds_their_key(env):
    """Each llama-server has the deployment's own key (in its environment, never on its command line, never in
    the state file): asked directly without it, a completion is refused; /health stays open for the probes; the
    gateway's request carries it, and the user never sees it."""
    from orchestrator.cluster import status

    st = status(NS)
    for w in st["workers"]:
        url = next(s.url for s in env["dep"].specs if s.name == w["name"])
        code, body = S.post_json(url + "/v1/completions", {"prompt": "x", "max_tokens": 2})
        assert code == 401, body
        assert S.http_json(url + "/health")[0] == 200
        proc_env = dict(ln.split("=", 1) for ln in open(f"/proc/{w['pid']}/environ").read().split("\0") if "=" in ln)
        key = proc_env["LLAMA_API_KEY"]
        assert len(key) >= 32 and key not in " ".join(psutil.Process(w["pid"]).cmdline())
        assert key not in json.dumps(st) and key not in (Path(os.environ["ORCHESTRATOR_STATE"]) / "cluster" /
                                                          f"{NS}.json").read_text()
        code, _ = S.post_json(url + "/v1/completions", {"prompt": "x", "max_tokens": 2},
                              headers={"Authorization": f"Bearer {key}"})
        assert code == 200
    assert S.post_json(gw(env, "/v1/completions"), {"prompt": "x", "max_tokens": 2})[0] == 200


def _raw(port: int, data: bytes, timeout: float = 30.0) -> bytes:
    """Send raw bytes to the gateway; read until it closes (a reset after its answer counts as a close)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as c:
        try:
            c.sendall(data)
        except OSError:
            pass
        got = b""
        while True:
            try:
                chunk = c.recv(65536)
            except OSError:
                break
            if not chunk:
                break
            got += chunk
    return got


def test_hostile_clients_do_not_disturb_a_stream_from_a_real_replica(env):
    """While hostile clients hit the gateway (200k copies of one header, an endless header, 50 slowloris
    connections), a streamed completion from a real llama-server runs to its [DONE]; pipelined requests on one
    connection are answered in order."""
    port = env["dep"].gateway_port
    slow = [socket.create_connection(("127.0.0.1", port)) for _ in range(50)]
    try:
        for c in slow:
            c.sendall(b"POST /v1/completions HTTP/1.1\r\nX-Slow: ")
        results = {}
        stream = threading.Thread(target=lambda: results.update(stream=S.stream_completion(
            gw(env, "/v1/chat/completions"), {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 24})))
        stream.start()
        t = time.monotonic()
        flood = _raw(port, b"GET /health HTTP/1.1\r\n" + b"X-A: b\r\n" * 200_000 + b"\r\n")
        endless = _raw(port, b"GET /health HTTP/1.1\r\nX-Big: " + b"a" * (4 << 20))
        assert flood.startswith(b"HTTP/1.1 431") and endless.startswith(b"HTTP/1.1 431")
        assert time.monotonic() - t < 5
        stream.join(60)
        code, events, done = results["stream"]
        assert code == 200 and done and len(events) >= 2
        body = json.dumps({"prompt": "x", "max_tokens": 2}).encode()
        one = (b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        got = _raw(port, one + one + one.replace(b"Host: gw", b"Host: gw\r\nConnection: close"))
        assert got.count(b"HTTP/1.1 200 OK") == 3 and got.count(b'"text_completion"') == 3
    finally:
        for c in slow:
            c.close()


def test_models_and_health(env):
    code, body = S.http_json(gw(env, "/v1/models"))
    assert code == 200 and [m["id"] for m in body["data"]] == ["tiny"]
    code, body = S.http_json(gw(env, "/health"))
    assert code == 200 and body["healthy_replicas"] == 2


def test_workers_run_exactly_their_spec(env):
    from orchestrator.cluster import status

    st = status(NS)
    for spec, w in zip(env["dep"].specs, st["workers"]):
        p = psutil.Process(w["pid"])
        assert p.cmdline() == list(spec.argv)                  # exactly the planned argv, pid = llama-server
        assert w["node"] == "local" and w["binding"] == "-t 1" and w["restarts"] == 0
        assert Path(w["log"]).is_file()


def _listeners(port: int) -> set[int]:
    return {c.pid for c in psutil.net_connections("tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid}


def test_two_gateway_processes_share_the_port(env):
    pids = _listeners(env["dep"].gateway_port)
    assert len(pids) == 2, pids                            # two Ray actors, one port (SO_REUSEPORT)
    assert env["res"].status["gateway"]["processes"] == 2 and env["res"].status["gateway"]["serving"] == 2


def test_kill_9_of_a_gateway_process_the_other_serves_and_it_is_back_within_10s(env):
    port = env["dep"].gateway_port
    pids = _listeners(port)
    victim = min(pids)
    os.kill(victim, signal.SIGKILL)
    t = time.monotonic()
    codes = []
    while time.monotonic() - t < 10:
        try:
            codes.append((time.monotonic() - t, S.post_json(gw(env, "/v1/completions"),
                                                            {"prompt": "x", "max_tokens": 2})[0]))
        except OSError as e:     # a connection the kernel had queued on the dead process's socket is reset
            codes.append((time.monotonic() - t, type(e).__name__))
        now = _listeners(port)
        if len(now) == 2 and victim not in now:
            break
        time.sleep(0.2)
    assert len(_listeners(port)) == 2 and victim not in _listeners(port), "the gateway process was not replaced"
    assert time.monotonic() - t < 10
    # the other process serves meanwhile: only a connection made as the dead one's socket was going may be lost
    assert all(code == 200 for at, code in codes if at > 1.0), codes
    assert sum(code == 200 for _, code in codes) >= len(codes) - 1, codes


def _server_key(env) -> str:
    """The deployment's llama-server key, read where only its owner can: a worker's environment."""
    from orchestrator.cluster import status

    pid = status(NS)["workers"][0]["pid"]
    return dict(ln.split("=", 1) for ln in open(f"/proc/{pid}/environ").read().split("\0") if "=" in ln)[
        "LLAMA_API_KEY"]


def test_requests_are_spread_over_both_replicas(env):
    key = _server_key(env)

    def predicted(spec):
        from orchestrator.cluster.metrics import fetch_text, parse_prometheus

        page = fetch_text(spec.url, "/metrics", 5, headers={"Authorization": f"Bearer {key}"})
        return parse_prometheus(page)["llamacpp:tokens_predicted_total"]

    before = [predicted(s) for s in env["dep"].specs]
    results = []
    threads = [threading.Thread(target=lambda: results.append(
        S.post_json(gw(env, "/v1/completions"), {"prompt": "spread", "max_tokens": 32, "ignore_eos": True})[0]))
        for _ in range(8)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert results == [200] * 8
    after = [predicted(s) for s in env["dep"].specs]
    assert all(a > b for a, b in zip(after, before)), (before, after)


def test_metrics_on_the_ray_metrics_endpoint(env):
    url = env["res"].metrics_url
    want = ['ray_orchestrator_worker_healthy{', 'worker="w0"', 'worker="w1"',
            "ray_orchestrator_worker_generation_tokens_per_second", "ray_orchestrator_worker_resident_memory_bytes",
            "ray_orchestrator_gateway_requests_total", "ray_orchestrator_node_numa_balancing"]

    def page():
        import urllib.request

        text = urllib.request.urlopen(url, timeout=5).read().decode()
        healthy = [ln for ln in text.splitlines() if ln.startswith("ray_orchestrator_worker_healthy{")]
        ok = all(w in text for w in want) and len(healthy) == 2 and all(ln.endswith(" 1.0") for ln in healthy)
        return text if ok else None

    text = S.wait_for(page, 30, 1.0)
    assert text, "metrics (both workers healthy) did not show up on Ray's Prometheus endpoint"
    rss = [float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
           if ln.startswith("ray_orchestrator_worker_resident_memory_bytes{")]
    assert rss and all(v > 1e6 for v in rss)
    # a node metric once per node (both workers are on this one), its value the kernel's, not a sum of writers
    nb = [ln for ln in text.splitlines() if ln.startswith("ray_orchestrator_node_numa_balancing{")]
    assert len(nb) == 1 and 'worker="' not in nb[0], nb
    kernel = Path("/proc/sys/kernel/numa_balancing")
    if kernel.exists():
        assert float(nb[0].rsplit(" ", 1)[1]) == float(kernel.read_text())


def test_kill_9_recovers_within_10s_and_the_other_replica_serves_meanwhile(env):
    from orchestrator.cluster import status

    w0 = env["dep"].specs[0]
    old_pid = status(NS)["workers"][0]["pid"]
    results: list = []
    stop = threading.Event()

    def load():
        while not stop.is_set():
            try:
                code, body = S.post_json(gw(env, "/v1/completions"), {"prompt": "x", "max_tokens": 4}, timeout=10)
                results.append(code if code == 200 else (code, body))
            except Exception as e:  # noqa: BLE001 - recorded and asserted below
                results.append(repr(e))
            time.sleep(0.02)

    threads = [threading.Thread(target=load) for _ in range(2)]
    [t.start() for t in threads]
    try:
        time.sleep(0.5)
        t0 = time.monotonic()
        os.kill(old_pid, signal.SIGKILL)

        def back():
            try:
                return S.http_json(w0.url + "/health", timeout=1)[0] == 200
            except OSError:          # refused / reset while the new llama-server comes up
                return False
        assert S.wait_for(back, 10, 0.1), "w0 not serving again within 10 s"
        recovered = time.monotonic() - t0
        time.sleep(1.0)
    finally:
        stop.set()
        [t.join() for t in threads]
    print(f"w0 serving again {recovered:.2f}s after kill -9; {len(results)} requests meanwhile")
    assert len(results) > 10 and all(r == 200 for r in results), [r for r in results if r != 200][:5]
    def ready_again():
        w = status(NS)["workers"][0]
        return w if w["state"] == "ready" and w["pid"] != old_pid else None

    w = S.wait_for(ready_again, 10, 0.5)           # the controller's view lags the worker's by a poll or two
    assert w and w["restarts"] == 1
    assert "killed by SIGKILL" in w["last_error"]
    assert not psutil.pid_exists(old_pid) or psutil.Process(old_pid).status() == psutil.STATUS_ZOMBIE


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def test_status_command_json(env):
    res = subprocess.run([sys.executable, "-m", "orchestrator", "status", "-n", NS, "--json"], capture_output=True,
                         text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert res.returncode == 0, res.stderr
    st = json.loads(res.stdout)
    assert st["phase"] == "ready" and st["gateway"]["healthy"] == 2
    assert {w["name"]: w["restarts"] for w in st["workers"]} == {"w0": 1, "w1": 0}
    assert st["plan"] == {"demo": True}
    res = subprocess.run([sys.executable, "-m", "orchestrator", "status", "-n", NS], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert "worker" in res.stdout and "w0" in res.stdout and "ready" in res.stdout


def test_killed_worker_actor_takes_its_llama_server_along_and_is_replaced(env):
    from orchestrator.cluster import status

    w1 = status(NS)["workers"][1]
    old_server, actor = w1["pid"], w1["actor_pid"]
    assert psutil.Process(old_server).ppid() == actor          # llama-server is the actor's child
    os.kill(actor, signal.SIGKILL)                             # the actor process dies, not llama-server
    gone = S.wait_for(lambda: not psutil.pid_exists(old_server)
                      or psutil.Process(old_server).status() == psutil.STATUS_ZOMBIE, 5)
    assert gone, "llama-server outlived its killed worker actor (orphan)"

    def replaced():
        w = status(NS)["workers"][1]
        return w if w["state"] == "ready" and w["pid"] not in (None, old_server) else None

    w = S.wait_for(replaced, 60, 1.0)
    assert w and w["actor_restarts"] == 1 and w["actor_pid"] != actor and "worker actor died" in w["last_error"]
    assert S.post_json(gw(env, "/v1/completions"), {"prompt": "x", "max_tokens": 4})[0] == 200


def test_killed_controller_is_restarted_by_ray_and_brings_the_workers_back(env):
    from orchestrator.cluster import status

    before = status(NS)
    old_servers = [w["pid"] for w in before["workers"]]
    t = time.monotonic()
    os.kill(before["controller_pid"], signal.SIGKILL)
    # its worker actors and the gateway were owned by it: they go, and take their llama-servers along
    assert S.wait_for(lambda: not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                                      for p in old_servers), 20), "llama-servers outlived their controller"

    def back():
        try:
            st = status(NS)
        except Exception:  # noqa: BLE001 - the controller is being restarted
            return None
        return st if st["phase"] == "ready" else None

    st = S.wait_for(back, 90, 1.0)
    took = time.monotonic() - t
    assert st and st["restarted"] and st["controller_pid"] != before["controller_pid"]
    assert all(w["pid"] not in old_servers for w in st["workers"])
    assert S.post_json(gw(env, "/v1/completions"), {"prompt": "x", "max_tokens": 4})[0] == 200
    assert took < 10, f"serving again {took:.1f}s after the controller was killed"


def test_second_up_of_the_same_namespace_is_refused(env):
    from orchestrator.cluster import up
    from orchestrator.errors import ClusterError

    with pytest.raises(ClusterError, match=rf"deployment '{NS}' is already running .* run `orchestrator down` first"):
        up(env["dep"].copy(gateway_port=S.free_port()), foreground=False, say=lambda m: None)


def test_down_leaves_nothing_running(env):
    st = env["state"]
    head = psutil.Process(st.head_pid)
    tree = [head] + head.children(recursive=True)
    names = {p.pid: p.name() for p in tree if p.is_running()}
    assert any("raylet" in n for n in names.values()) and any("gcs_server" in n for n in names.values())
    servers = [p for p in S.llama_servers(env["binary"]) if str(env["model"]) in " ".join(p.cmdline())]
    assert len(servers) == 2
    res = subprocess.run([sys.executable, "-m", "orchestrator", "down", "-n", NS], capture_output=True, text=True,
                         timeout=180, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert res.returncode == 0, res.stderr
    assert "stopped 2 worker(s)" in res.stderr and "the Ray head" in res.stderr
    left = [f"{p.pid} {names.get(p.pid)}" for p in tree + servers
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert left == []
    assert not _port_open(env["dep"].gateway_port)
    assert not any(_port_open(s.port) for s in env["dep"].specs)
    assert S.ray_processes_of(st.head_temp_dir) == [] and not Path(st.head_temp_dir).exists()
    from orchestrator.cluster import state

    assert state.read(NS) is None
