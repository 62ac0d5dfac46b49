"""`up`'s start-up limits: how ray.start_timeout becomes the head's, the actors' and Ray's own waits, and a real
Ray head that is given too little time."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from orchestrator.cluster.deployment import Deployment, StartLimits
from orchestrator.config import load_topology
from orchestrator.errors import ClusterError, ConfigError
from orchestrator.launch.spec import LaunchSpec


@pytest.mark.parametrize("value,load,head", [("auto", 0.0, 120.0), ("auto", 0.5, 120.0), ("auto", 3.0, 360.0),
                                             ("auto", 50.0, 1200.0), (300.0, 0.0, 300.0), (300.0, 8.0, 300.0)])
def test_start_timeout_scales_every_limit_together(value, load, head):
    lim = StartLimits.from_start_timeout(value, load)
    assert (lim.head_s, lim.actor_s, lim.ray_wait_s) == (head, head / 2, head / 4)
    env = lim.ray_env()
    assert env == {"RAY_agent_register_timeout_ms": str(int(head / 4 * 1000)),
                   "RAY_raylet_start_wait_time_s": str(round(head / 4)),
                   "RAY_DASHBOARD_STARTUP_TIMEOUT_S": str(round(head))}


def test_the_defaults_are_the_limits_up_always_had():
    lim = StartLimits()
    assert (lim.head_s, lim.actor_s, lim.ray_wait_s) == (120.0, 60.0, 30.0)


def test_limits_travel_with_the_deployment():
    spec = LaunchSpec("w0", ("llama-server", "-m", "m.gguf"), port=9001)
    dep = Deployment(specs=(spec,), limits=StartLimits.from_start_timeout(600))
    back = Deployment.from_dict(dep.to_dict())
    assert back.limits == dep.limits and back.limits.actor_s == 300.0
    assert Deployment.from_dict({k: v for k, v in dep.to_dict().items() if k != "limits"}).limits == StartLimits()


def _topology(tmp_path: Path, ray_lines: str):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    f = tmp_path / "t.yaml"
    f.write_text(f"model:\n  path: {model}\nray:\n{ray_lines}")
    return f


def test_the_topology_sets_the_start_timeout(tmp_path):
    assert load_topology(_topology(tmp_path, "  start_timeout: 5m\n")).ray.start_timeout == 300.0
    assert load_topology(_topology(tmp_path, "  namespace: x\n")).ray.start_timeout == "auto"
    with pytest.raises(ConfigError, match=r"t\.yaml:\d+: ray\.start_timeout: 3s is out of range \(expected auto or "
                                          r"a duration"):
        load_topology(_topology(tmp_path, "  start_timeout: 3s\n"))


def test_a_head_given_too_little_time_is_stopped_with_the_key_to_change(tmp_path, monkeypatch):
    """A real `ray start --head` given half a second: one line naming ray.start_timeout, nothing of the head left;
    Ray's own waits reached the head's environment."""
    from orchestrator.cluster import head as headmod
    from orchestrator.cluster.head import free_port

    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")     # no token written into the user's home
    seen = {}

    def on_spawn(info):
        seen["info"] = info
        seen["env"] = Path(f"/proc/{info.pid}/environ").read_bytes().split(b"\0")

    lim = StartLimits.from_start_timeout(40)
    t0 = time.monotonic()
    # where Ray stopped, from its own logs: half a second in, nothing of the GCS or raylet has written one yet
    with pytest.raises(ClusterError, match=r"did not start within 0\.5s \((no GCS or raylet log yet|"
                                           r"(gcs_server|raylet)\.(err|out): .+); log: .*a slow machine may need a "
                                           r"longer ray\.start_timeout"):
        headmod.start_head(node_name="local", gcs_port=None, dashboard_host="127.0.0.1",
                           dashboard_port=free_port("127.0.0.1", set()), metrics_port=None, log_dir=tmp_path,
                           timeout=0.5, on_spawn=on_spawn, ray_env=lim.ray_env())
    assert time.monotonic() - t0 < 60
    assert b"RAY_agent_register_timeout_ms=10000" in seen["env"] and b"RAY_raylet_start_wait_time_s=10" in seen["env"]
    info = seen["info"]
    assert headmod.head_tree(info.pid, info.started) == []


def test_a_down_in_progress_is_told_apart_from_a_lost_head(tmp_path, monkeypatch):
    """The foreground `up` reads `down`'s mark in the state record: a `down` that still runs means "being
    stopped" (exit 0 once it is done), one that died does not (the lost head is then reported)."""
    import os
    import subprocess
    import sys

    from orchestrator.cluster import lifecycle, state

    monkeypatch.setenv("ORCHESTRATOR_STATE", str(tmp_path / "state"))
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        st = state.ClusterState(namespace="ns", ray_address="127.0.0.1:1", embedded=True, up_pid=os.getpid(),
                                started_at=time.time(), phase="stopping", stopping_pid=other.pid)
        assert lifecycle._down_running(st)
        assert not lifecycle._down_running(state.ClusterState(**{**st.__dict__, "stopping_pid": os.getpid()}))
        assert not lifecycle._down_running(state.ClusterState(**{**st.__dict__, "phase": "running"}))
        said = []
        state.write(st)
        other.kill()
        other.wait()
        assert not lifecycle._down_running(st)                   # that `down` died before it finished
        assert lifecycle._stopped_elsewhere("ns", st, said.append) is False and said == []
        state.remove("ns")
        assert lifecycle._stopped_elsewhere("ns", st, said.append) is True
        assert said == ["stopped by `orchestrator down`"]
    finally:
        if other.poll() is None:
            other.kill()
            other.wait()


def test_a_refusal_in_the_resolve_phase_undoes_only_what_started(tmp_path, monkeypatch, state_home, tiny_gguf,
                                                                 llama_server_path):
    """A worker's port held by someone else: `up` stops in its resolve phase with the line naming the port, and
    only the phases before it (signals, then the lock) are undone, newest first: no Ray head was started, the
    handlers are the ones found before, and the namespace's lock is free again."""
    import signal
    import socket

    from orchestrator.cluster import state
    from orchestrator.cluster.startup import Startup

    monkeypatch.setenv("LLAMA_SERVER", llama_server_path)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        topo = tmp_path / "t.yaml"
        topo.write_text(f"model:\n  path: {tiny_gguf}\n  context: 1024\nworkers:\n  replicas: 1\n  port_base: {port}\n"
                        "ray:\n  address: local\n  namespace: refused\n")
        before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        up = Startup(load_topology(topo), say=lambda m: None)
        with pytest.raises(ClusterError, match=rf"workers\.port_base: worker \S+ cannot listen: 127\.0\.0\.1:{port}"):
            up.run()
    assert up.trace == ["start lock", "start signals", "start resolve", "undo signals", "undo lock"]
    assert up.early is None and state.recorded() == []
    assert {s: signal.getsignal(s) for s in before} == before
    import subprocess
    import sys

    other = subprocess.run([sys.executable, "-c", "from orchestrator.cluster import state\n"
                            "state.NamespaceLock.acquire('refused')\nprint('taken')"],
                           capture_output=True, text=True, timeout=60, cwd=Path(__file__).resolve().parents[2])
    assert other.stdout.strip() == "taken", other.stderr           # another process can take the lock now


def test_a_head_that_did_not_start_is_told_by_the_component_log_written_last(tmp_path):
    import os

    from orchestrator.cluster.head import _component_cause

    assert _component_cause(str(tmp_path)) == "no GCS or raylet log yet"
    logs = tmp_path / "session_latest" / "logs"
    logs.mkdir(parents=True)
    (logs / "gcs_server.out").write_text("[info] GCS started\n[error] Failed to bind port 41234: in use\n"
                                         "[info] retrying\n")
    (logs / "raylet.out").write_text("[info] waiting for the GCS\n")
    os.utime(logs / "gcs_server.out", (1, 1))                     # the raylet wrote last: its last line
    assert _component_cause(str(tmp_path)) == "raylet.out: [info] waiting for the GCS"
    os.utime(logs / "raylet.out", (0, 0))                         # the GCS last: its last error, not its last line
    assert _component_cause(str(tmp_path)) == "gcs_server.out: [error] Failed to bind port 41234: in use"
