"""The state up leaves for status/down: validated namespaces, broken files named, one up per namespace, and the
CLI's answers to each (real files, real flock, real processes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orchestrator.cluster import state
from orchestrator.cluster.procs import started_since_boot
from orchestrator.errors import ClusterError

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("bad", ["..", ".", "a/b", "../x", "", "-x", ".hidden", "x" * 65, "a b", "ns\n"])
def test_namespaces_are_names_never_paths(state_home, bad):
    with pytest.raises(state.StateError, match="not a valid name"):
        state.state_path(bad)
    with pytest.raises(state.StateError):
        state.run_dir(bad)


@pytest.mark.parametrize("good", ["orchestrator", "a", "A.b-c_9", "x" * 64])
def test_valid_namespaces(state_home, good):
    assert state.state_path(good).name == f"{good}.json"


def _st(ns="demo") -> state.ClusterState:
    return state.ClusterState(namespace=ns, ray_address="127.0.0.1:1", embedded=True, up_pid=os.getpid(),
                              started_at=time.time())


def test_state_round_trip_private_files(state_home):
    path = state.write(_st())
    assert state.read("demo") == _st().__class__(**{**_st().__dict__, "started_at": state.read("demo").started_at})
    assert path.stat().st_mode & 0o777 == 0o600
    assert path.parent.stat().st_mode & 0o777 == 0o700
    assert state.read_ray_record("demo")["ray_address"] == "127.0.0.1:1"
    state.remove("demo")
    assert state.read("demo") is None and state.read_ray_record("demo") is None


@pytest.mark.parametrize("text,why", [("{not json", "not a deployment record"),
                                      ("[1, 2]", r"a JSON list, not an object"),
                                      ('{"namespace": "demo"}', "not a deployment record"),
                                      ("\udcff", "")])
def test_a_broken_state_file_is_an_error_naming_it(state_home, text, why):
    path = state.state_path("demo")
    path.parent.mkdir(parents=True)
    if text == "\udcff":
        path.write_bytes(b"\xff\xfe\x00garbage")
    else:
        path.write_text(text)
    with pytest.raises(state.StateError, match=rf"state file {path}: .*{why}.*down --force -n demo"):
        state.read("demo")


def test_an_unreadable_state_file_is_an_error_naming_it(state_home):
    path = state.state_path("demo")
    path.parent.mkdir(parents=True)
    path.mkdir()            # a directory where the file should be: EISDIR for everyone, root included
    with pytest.raises(state.StateError, match=rf"state file {path}: cannot read it"):
        state.read("demo")


def test_the_lock_refuses_a_second_holder_naming_its_pid(state_home):
    code = ("import sys, time; from orchestrator.cluster import state; "
            "state.NamespaceLock.acquire('demo'); print('held', flush=True); time.sleep(60)")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    holder = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ClusterError, match=rf"deployment 'demo' is being started or served by another `up` "
                                               rf"\(pid {holder.pid}; lock .*demo.lock\)"):
            state.NamespaceLock.acquire("demo")
        lk = state.NamespaceLock.acquire("other")          # another namespace is free
        lk.release()
    finally:
        holder.kill()
        holder.wait()
    with state.NamespaceLock.acquire("demo") as lk:        # the holder's death released it
        assert state.NamespaceLock.acquire("demo") is lk   # re-entrant in one process
        lk.release()
        assert (state_home / "cluster" / "demo.lock").read_text().strip() == str(os.getpid())


def _cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "orchestrator", *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})


def test_down_with_a_path_as_namespace_is_refused_and_deletes_nothing(state_home):
    state.write(_st("keep"))
    (state_home / "logs" / "keep").mkdir(parents=True)
    res = _cli("down", "-n", "..")
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip() == ("orchestrator down: error: namespace '..': not a valid name (1 to 64 letters, "
                                  "digits, '_', '.', '-', starting with a letter or digit)")
    assert state.read("keep") is not None and (state_home / "logs" / "keep").is_dir()


@pytest.mark.parametrize("text", ["{broken", "[]"])
def test_down_and_status_name_a_corrupt_state_file(state_home, text):
    path = state.state_path("demo")
    path.parent.mkdir(parents=True)
    path.write_text(text)
    for cmd in (["down", "-n", "demo"], ["status", "-n", "demo"]):
        res = _cli(*cmd)
        assert res.returncode == 2, res.stderr
        assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
        assert f"state file {path}" in res.stderr and "is running" not in res.stderr
    assert path.exists()                                    # refused, not forgotten


def test_down_force_stops_what_the_ray_record_names_and_removes_the_broken_file(state_home, tmp_path):
    """A process standing in for the Ray head (its own session, like the real one): recorded by `up`'s path,
    then the state file is broken; `down --force` stops it from the Ray record and removes both files."""
    fake_head = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    try:
        st = _st("demo")
        st.head_pid, st.head_started = fake_head.pid, started_since_boot(fake_head.pid)
        st.ray_address = "127.0.0.1:9"                      # nothing listens: the head is stopped without Ray
        state.write(st)
        state.state_path("demo").write_text("[]")
        res = _cli("down", "-n", "demo", "--force")
        assert res.returncode == 0, res.stderr
        assert fake_head.wait(timeout=30) is not None
        assert "not a deployment record" in res.stderr and "stopped 0 worker(s)" in res.stderr
        assert not state.state_path("demo").exists() and not state.run_dir("demo").exists()
    finally:
        if fake_head.poll() is None:
            fake_head.kill()
            fake_head.wait()


def test_up_refuses_a_namespace_another_up_holds(state_home, tmp_path):
    code = ("import time; from orchestrator.cluster import state; "
            "state.NamespaceLock.acquire('held-ns'); print('held', flush=True); time.sleep(60)")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    holder = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
    topo = tmp_path / "t.yaml"
    topo.write_text(f"model:\n  path: {tmp_path / 'none.gguf'}\nray:\n  address: local\n  namespace: held-ns\n")
    try:
        assert holder.stdout.readline().strip() == "held"
        t = time.monotonic()
        res = _cli("up", str(topo))
        assert time.monotonic() - t < 30
    finally:
        holder.kill()
        holder.wait()
    assert res.returncode == 2
    assert res.stderr.strip() == (f"orchestrator up: error: deployment 'held-ns' is being started or served by "
                                  f"another `up` (pid {holder.pid}; lock {state_home / 'cluster' / 'held-ns.lock'})")
    assert not state.state_path("held-ns").exists()


def test_the_ray_token_is_made_owner_only(tmp_path, monkeypatch):
    from orchestrator.cluster import head

    token = tmp_path / "auth_token"
    token.write_text("t" * 32)
    token.chmod(0o644)                                       # as `ray get-auth-token --generate` leaves it
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(token))
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    assert head.ensure_auth() == "token"
    assert token.stat().st_mode & 0o777 == 0o600
