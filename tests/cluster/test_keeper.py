"""The keeper that holds a llama-server `up` started before its worker actor existed (workers.early_start),
with real processes: a stand-in server (a Python process) under a real keeper process.

- the owner (`up`) dies before any actor adopted the server: the keeper stops it;
- after the hand-over the server outlives `up`, and stops when its adopter says so or dies (like the
  parent-death signal of a server the actor started itself);
- a server that exits is seen with its exit status and the cause from its log;
- a keeper killed outright takes its server along (parent-death signal);
- a server with another argv is not adopted, and stopped.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from orchestrator.cluster.keeper import AdoptedHandle, EarlyServer, read_json
from orchestrator.launch.spec import LaunchSpec

REPO = Path(__file__).resolve().parents[2]
SLEEPER = (sys.executable, "-c", "import time; print('I serving', flush=True); time.sleep(600)")


def spec(argv=SLEEPER, name="w0"):
    return LaunchSpec(name=name, argv=tuple(argv), port=1)


def wait_for(cond, timeout=15.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError("timed out")


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.fixture()
def owner():
    """A stand-in for `up`: a process the test can kill."""
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    yield p
    p.kill()
    p.wait()


def start(tmp_path, owner, argv=SLEEPER):
    es = EarlyServer(spec(argv), tmp_path / "logs" / "w0.log", tmp_path / "run", grace=3.0).start(owner.pid)
    st = wait_for(lambda: (read_json(es.state_path) or {}).get("pid") and read_json(es.state_path))
    return es, st


def test_the_owner_dying_before_the_handover_stops_the_server(tmp_path, owner):
    es, st = start(tmp_path, owner)
    server = st["pid"]
    assert psutil.Process(server).ppid() == es.popen.pid          # the keeper is its parent
    assert not es.adopted()
    owner.kill()
    owner.wait()
    es.popen.wait(timeout=15)
    assert gone(server)
    final = read_json(es.state_path)
    assert final["exit"] == -signal.SIGTERM and "owner" in final["why"]


def test_adopted_server_outlives_up_and_stops_with_its_adopter(tmp_path, owner):
    es, st = start(tmp_path, owner)
    h, why = AdoptedHandle.adopt(es.handover(), spec())
    assert h is not None and why == "" and h.pid == st["pid"] and es.adopted()
    owner.kill()                                                   # `up --detach` ends after ready
    owner.wait()
    time.sleep(0.6)
    assert h.poll() is None and psutil.Process(h.pid).is_running()
    assert h.stop(3.0) == -signal.SIGTERM                          # the actor stops it (down, a restart)
    assert gone(h.pid) and es.popen.wait(timeout=5) == 0
    assert h.poll() == -signal.SIGTERM


def test_the_adopter_dying_stops_the_server(tmp_path, owner):
    es, st = start(tmp_path, owner)
    adopter = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(REPO)!r})
        from orchestrator.cluster.keeper import AdoptedHandle
        from orchestrator.launch.spec import LaunchSpec
        h, why = AdoptedHandle.adopt({es.handover()!r}, LaunchSpec(name="w0", argv={SLEEPER!r}, port=1))
        print("adopted" if h else why, flush=True)
        time.sleep(600)
        """)], stdout=subprocess.PIPE, text=True)
    try:
        assert adopter.stdout.readline().strip() == "adopted"
        assert read_json(es.owner_path)["pid"] == adopter.pid
        adopter.kill()                                             # kill -9 of the worker actor
        adopter.wait()
        es.popen.wait(timeout=15)
        assert gone(st["pid"])
        assert f"owner pid {adopter.pid} gone" in read_json(es.state_path)["why"]
    finally:
        adopter.kill()


def test_a_server_that_exits_is_seen_with_its_status_and_cause(tmp_path, owner):
    argv = (sys.executable, "-c", "import sys, time; time.sleep(0.5); "
            "print('E llama_model_load: error loading model: out of memory', flush=True); sys.exit(3)")
    es, st = start(tmp_path, owner, argv)
    h, _ = AdoptedHandle.adopt(es.handover(), spec(argv))
    assert wait_for(lambda: h.poll() is not None) and h.poll() == 3
    assert "out of memory" in h.cause()
    assert es.popen.wait(timeout=5) == 0


def test_a_keeper_killed_outright_takes_its_server_along(tmp_path, owner):
    es, st = start(tmp_path, owner)
    h, _ = AdoptedHandle.adopt(es.handover(), spec())
    es.popen.kill()
    es.popen.wait()
    wait_for(lambda: gone(st["pid"]), timeout=10)                  # the exec guard's parent-death signal
    assert h.poll() is not None


def test_another_argv_is_not_adopted_and_is_stopped(tmp_path, owner):
    es, st = start(tmp_path, owner)
    h, why = AdoptedHandle.adopt(es.handover(), spec(argv=SLEEPER + ("--other",)))
    assert h is None and "another argv" in why
    assert gone(st["pid"]) and es.popen.wait(timeout=5) == 0


def test_up_stops_a_server_nobody_adopted(tmp_path, owner):
    es, st = start(tmp_path, owner)
    es.stop()
    assert gone(st["pid"]) and es.popen.returncode == 0
    assert read_json(es.state_path)["why"] == "stopped"


def test_a_server_that_cannot_start_leaves_the_reason_for_the_actor(tmp_path, owner):
    es = EarlyServer(spec(("/nonexistent/llama-server",)), tmp_path / "w0.log", tmp_path / "run", 3.0).start(owner.pid)
    assert es.popen.wait(timeout=15) == 1
    h, why = AdoptedHandle.adopt(es.handover(), spec(("/nonexistent/llama-server",)))
    assert h is None and "/nonexistent/llama-server" in why
