"""Every way a person stops a foreground `orchestrator up`, after it said "serving": a real `up` of the demo
topology (two llama-server replicas started early and adopted by their worker actors, an embedded Ray head, the
gateway) over a tiny generated model. Each way runs the same clean stop and leaves nothing: no llama-server of the
model, no keeper, no raylet or gcs_server of the deployment's head, no state file. Exit status: 0 for Ctrl-C and
SIGTERM (asked for), 129 for a hang-up, 141 when the output pipe closed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cluster"))
import cluster_support as S  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "topologies" / "demo.yaml"
pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture()
def iso(tmp_path, monkeypatch, llama_server_path):
    monkeypatch.setenv("ORCHESTRATOR_STATE", str(tmp_path / "state"))
    return {"tmp": tmp_path, "binary": llama_server_path, "model": S.write_tiny_llama(tmp_path / "tiny.gguf"),
            "state": tmp_path / "state"}


_ours = S.processes_with


class Up:
    """`orchestrator up topologies/demo.yaml` in its own session (as a terminal would run it), its output read
    here without blocking (so closing our end really leaves the pipe without a reader); :meth:`serving` waits for
    "serving"."""

    def __init__(self, iso, ns: str) -> None:
        self.ns = ns
        self.iso = iso
        env = {**os.environ, "PYTHONPATH": str(REPO), "LLAMA_SERVER": iso["binary"]}
        sets = {"model.path": iso["model"], "model.context": 1024, "gateway.port": S.free_port(),
                "ray.dashboard_port": S.free_port(), "workers.port_base": S.free_port_base(4), "ray.namespace": ns}
        argv = [sys.executable, "-m", "orchestrator", "up", str(DEMO)]
        for k, v in sets.items():
            argv += ["--set", f"{k}={v}"]
        # from the dispositions a terminal gives (not the ones this test run inherited: `nohup` ignores SIGHUP)
        self.p = subprocess.Popen(S.with_stop_signals_reset(argv), env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, start_new_session=True)
        self.fd = self.p.stdout.fileno()
        os.set_blocking(self.fd, False)
        self.data = b""
        self.temp_dir = None

    @property
    def out(self) -> str:
        while self.fd is not None:
            try:
                chunk = os.read(self.fd, 65536)
            except BlockingIOError:
                break
            if not chunk:
                break
            self.data += chunk
        return self.data.decode(errors="replace")

    def close_output(self) -> None:
        """Our end of up's output pipe goes away, as tee's does when it dies."""
        self.out
        self.p.stdout.close()
        self.fd = None

    def serving(self, timeout: float = 180) -> None:
        assert S.wait_for(lambda: "serving; Ctrl-C stops everything" in self.out or self.p.poll() is not None,
                          timeout, interval=0.2), self.out
        assert self.p.poll() is None, self.out
        import json

        st = json.loads((self.iso["state"] / "cluster" / f"{self.ns}.json").read_text())
        assert st["phase"] == "running" and st["up_pid"] == self.p.pid
        self.temp_dir = st["head_temp_dir"]
        # Ray makes its temp dir world-writable; it lies in a folder of ours that only we can enter
        assert os.stat(os.path.dirname(self.temp_dir)).st_mode & 0o777 == 0o700
        assert S.ray_processes_of(self.temp_dir), "no Ray processes of the head seen while serving"
        # every component of the head got a port of its own (Ray refuses to start when two share one)
        start = [q.cmdline() for q in S.ray_processes_of(self.temp_dir) if "--block" in q.cmdline()]
        assert len(start) == 1
        ports = [start[0][i + 1] for i, a in enumerate(start[0][:-1]) if a.endswith("-port")]
        assert len(ports) >= 9 and len(set(ports)) == len(ports), ports
        assert len(self.servers()) == 2, self.out
        # every thread but the main one blocks the stop signals, so a signal always reaches up's own handler (one
        # that lands in another thread while Ray's handler is in place aborts up: seen with numpy's BLAS threads)
        stop = (1 << signal.SIGHUP - 1) | (1 << signal.SIGINT - 1) | (1 << signal.SIGTERM - 1)
        for task in Path(f"/proc/{self.p.pid}/task").iterdir():
            if int(task.name) != self.p.pid:
                blocked = int(next(ln for ln in (task / "status").read_text().splitlines()
                                   if ln.startswith("SigBlk:")).split()[1], 16)
                assert blocked & stop == stop, f"thread {task.name} of up takes stop signals"

    def servers(self) -> list[psutil.Process]:
        return [q for q in _ours(str(self.iso["model"])) if q.name() == "llama-server"]

    def wait(self, timeout: float = 180) -> int:
        deadline = time.monotonic() + timeout
        while self.p.poll() is None and time.monotonic() < deadline:
            self.out
            time.sleep(0.1)
        self.out
        return self.p.wait(timeout=1)

    def leftovers(self) -> list[str]:
        left = [f"llama-server {q.pid}" for q in self.servers()]
        left += [f"keeper {q.pid}" for q in _ours(f"run/{self.ns}/")]
        left += [f"{q.name()} {q.pid}" for q in S.ray_processes_of(self.temp_dir)
                 if q.is_running() and q.status() != psutil.STATUS_ZOMBIE]
        if (self.iso["state"] / "cluster" / f"{self.ns}.json").exists():
            left.append("the state file")
        return left

    def cleanup(self) -> None:
        if self.p.poll() is None:
            os.killpg(self.p.pid, signal.SIGKILL)
            self.p.wait()
        subprocess.run([sys.executable, "-m", "orchestrator", "down", "-n", self.ns, "--force"], capture_output=True,
                       timeout=180, env={**os.environ, "PYTHONPATH": str(REPO)})


def _nothing_left(up: Up) -> None:
    deadline = time.monotonic() + 10       # a zombie's parent may need a moment to reap it
    while up.leftovers() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert up.leftovers() == [], up.out
    assert not Path(up.temp_dir).parent.exists(), "Ray's temp dir was left"


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 0), (signal.SIGINT, 0), (signal.SIGHUP, 128 + signal.SIGHUP)])
def test_a_signal_while_serving_stops_everything(iso, sig, code):
    up = Up(iso, f"stop-{sig.name.lower()}")
    try:
        up.serving()
        up.p.send_signal(sig)
        rc = up.wait()
        assert rc == code, up.out
        assert "stopping workers, gateway and Ray ..." in up.out and "stopped (2 worker(s), Ray head)" in up.out
        assert "Traceback" not in up.out
        _nothing_left(up)
    finally:
        up.cleanup()


def test_down_from_another_shell_stops_the_foreground_up_with_0(iso):
    """`orchestrator down` from another shell: the foreground `up` sees the deployment stopped (not its head
    lost) and exits 0 with "stopped by `orchestrator down`"."""
    up = Up(iso, "stop-down")
    try:
        up.serving()
        res = subprocess.run([sys.executable, "-m", "orchestrator", "down", "-n", up.ns], capture_output=True,
                             text=True, timeout=180, env={**os.environ, "PYTHONPATH": str(REPO)})
        assert res.returncode == 0, res.stderr
        rc = up.wait()
        assert rc == 0, up.out
        assert "stopped by `orchestrator down`" in up.out and "the Ray head is gone" not in up.out, up.out
        assert "Traceback" not in up.out
        _nothing_left(up)
    finally:
        up.cleanup()


def test_a_second_sigterm_during_the_stop_waits_for_it(iso):
    up = Up(iso, "stop-twice")
    try:
        up.serving()
        up.p.send_signal(signal.SIGTERM)
        assert S.wait_for(lambda: "stopping workers, gateway and Ray" in up.out, 30, interval=0.05), up.out
        up.p.send_signal(signal.SIGTERM)
        up.p.send_signal(signal.SIGINT)
        rc = up.wait()
        assert rc == 0, up.out
        assert "stopped (2 worker(s), Ray head); 2 further signal(s) waited for it" in up.out
        _nothing_left(up)
    finally:
        up.cleanup()


def test_a_closed_output_pipe_stops_everything_with_141(iso):
    """`orchestrator up ... | tee log`, and tee goes away: up notices within a second, stops cleanly, exits 141."""
    up = Up(iso, "stop-pipe")
    try:
        up.serving()
        up.close_output()                       # the only reader of up's output is gone
        rc = up.wait(timeout=120)
        assert rc == 128 + signal.SIGPIPE
        _nothing_left(up)
    finally:
        up.cleanup()


def test_ctrl_c_that_killed_tee_first_still_stops_everything(iso):
    """`orchestrator up ... 2>&1 | tee log` and Ctrl-C: the terminal signals both; tee dies first, so every line up
    writes while it stops hits a closed pipe. The stop still runs to its end."""
    up = Up(iso, "stop-tee")
    try:
        up.serving()
        up.close_output()
        up.p.send_signal(signal.SIGINT)
        rc = up.wait(timeout=120)
        assert rc in (0, 128 + signal.SIGPIPE)  # Ctrl-C (asked for) or the closed pipe, whichever it saw first
        _nothing_left(up)
    finally:
        up.cleanup()


def _gateway(up: Up) -> str:
    import json

    return json.loads((up.iso["state"] / "cluster" / f"{up.ns}.json").read_text())["gateway_url"]


def _cli(*args, timeout=180):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "orchestrator", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_kill_9_of_up_while_serving_leaves_a_deployment_that_serves_and_down_stops(iso):
    """`up` itself killed outright while serving: nothing can run its stop, so the deployment goes on serving
    (the worker actors own the servers); status sees it, a new `up` of the namespace is refused with the reason,
    and `down` stops all of it."""
    up = Up(iso, "stop-kill9")
    try:
        up.serving()
        gw = _gateway(up)
        up.p.kill()
        up.wait()
        t = time.monotonic()
        while time.monotonic() - t < 5:
            assert S.post_json(gw + "/v1/completions", {"prompt": "x", "max_tokens": 2})[0] == 200
            time.sleep(0.5)
        st = _cli("status", "-n", up.ns)
        assert st.returncode == 0, st.stderr
        again = Up(iso, up.ns)
        assert again.wait(120) == 2
        assert "deployment 'stop-kill9' is already running" in again.out and "orchestrator down" in again.out
        res = _cli("down", "-n", up.ns)
        assert res.returncode == 0, res.stderr
        _nothing_left(up)
    finally:
        up.cleanup()


def test_model_file_removed_while_serving(iso):
    """The model file goes away under a serving deployment: the running servers keep serving (they hold it); a
    server that then dies cannot be started again, and its worker says why in one line naming the file, while
    the other replica serves on."""
    up = Up(iso, "stop-model")
    try:
        up.serving()
        gw = _gateway(up)
        model = Path(iso["model"])
        model.unlink()
        assert S.post_json(gw + "/v1/completions", {"prompt": "x", "max_tokens": 2})[0] == 200
        victim = up.servers()[0]
        victim.kill()
        t = time.monotonic()

        def said_why():
            res = _cli("status", "-n", up.ns, "--json", timeout=60)
            import json

            ws = json.loads(res.stdout or "{}").get("workers", [])
            return next((w for w in ws if str(model) in (w.get("last_error") or "")), None)

        w = S.wait_for(said_why, 10, 0.5)
        assert w is not None and time.monotonic() - t < 12, up.out
        assert len((w["last_error"] or "").splitlines()) == 1
        for _ in range(5):
            assert S.post_json(gw + "/v1/completions", {"prompt": "x", "max_tokens": 2})[0] == 200
        up.p.send_signal(signal.SIGTERM)
        assert up.wait() == 0
        _nothing_left(up)
    finally:
        up.cleanup()


def test_kill_9_of_the_raylet_stops_everything_with_one_line(iso):
    """The raylet killed outright takes every actor with it and `ray start --block` ends the head: the
    foreground `up` says so in one line, stops what is left, exits 1; nothing stays."""
    up = Up(iso, "stop-raylet")
    try:
        up.serving()
        raylet = next(q for q in S.ray_processes_of(up.temp_dir) if q.name() == "raylet")
        raylet.kill()
        t = time.monotonic()
        rc = up.wait(timeout=120)
        assert rc == 1, up.out
        assert "the Ray head is gone: cleaning up" in up.out and "Traceback" not in up.out
        assert time.monotonic() - t < 10, up.out
        _nothing_left(up)
    finally:
        up.cleanup()


def test_a_broken_state_file_is_named_and_down_force_stops_the_deployment(iso):
    """The state file of a serving deployment (its `up` killed outright) is broken: `down` refuses naming the
    file, `down --force` stops the head, the actors and the llama-servers from the Ray record beside it."""
    up = Up(iso, "stop-force")
    try:
        up.serving()
        up.p.kill()
        up.wait()
        path = iso["state"] / "cluster" / "stop-force.json"
        path.write_text("[]")
        res = _cli("down", "-n", up.ns)
        assert res.returncode == 2 and f"state file {path}: not a deployment record" in res.stderr, res.stderr
        assert len(up.servers()) == 2                           # refused: still running
        res = _cli("down", "-n", up.ns, "--force")
        assert res.returncode == 0, res.stderr
        assert "stopped 2 worker(s)" in res.stderr and "the Ray head" in res.stderr, res.stderr
        _nothing_left(up)
        assert not (iso["state"] / "run" / "stop-force").exists()
    finally:
        up.cleanup()


def test_a_namespace_that_is_a_path_is_refused_before_anything_starts(iso):
    up = Up(iso, "..")
    assert up.wait(60) == 2
    assert "namespace '..': not a valid name" in up.out and "Traceback" not in up.out
    assert not (iso["state"] / "cluster").exists() or not list((iso["state"] / "cluster").iterdir())
