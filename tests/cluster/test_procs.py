"""Real processes through LocalLauncher: exact argv/env and pid, group stop, KILL escalation, no orphan when the
parent dies, and llama-server's own failure reasons read from its log."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from orchestrator.cluster.procs import RAY_INJECTED_ENV, LocalLauncher, same_start, started_since_boot
from orchestrator.errors import LaunchError
from orchestrator.launch.spec import LaunchSpec

from cluster_support import free_port, wait_for


def wait_exit(h, timeout=30.0):
    assert wait_for(lambda: h.poll() is not None, timeout), "process did not exit"
    return h.poll()


def test_runs_exact_argv_and_env_with_the_same_pid(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7")        # as Ray sets it in an actor
    monkeypatch.setenv("KEEP_ME", "yes")
    out = tmp_path / "out.json"
    code = ("import json,os,sys; json.dump({'argv': sys.argv, 'pid': os.getpid(), 'cvd': os.environ.get("
            "'CUDA_VISIBLE_DEVICES'), 'x': os.environ.get('X'), 'keep': os.environ.get('KEEP_ME'), "
            "'pgid': os.getpgid(0), 'cwd': os.getcwd()}, open(sys.argv[1], 'w'))")
    spec = LaunchSpec(name="w0", argv=(sys.executable, "-c", code, str(out), "two words"), env={"X": "1"})
    h = LocalLauncher(drop_env=RAY_INJECTED_ENV).start(spec, tmp_path / "w0.log")
    assert wait_exit(h) == 0
    got = json.loads(out.read_text())
    assert got["argv"][1:] == [str(out), "two words"]
    assert got["pid"] == h.pid == got["pgid"]              # exec'd in place, leader of its own group
    assert got["cvd"] is None and got["x"] == "1" and got["keep"] == "yes"
    assert got["cwd"] == str(tmp_path)                     # the log's folder (ik_llama.cpp writes llama.log there)
    assert "# orchestrator:" in (tmp_path / "w0.log").read_text()


def test_spec_env_wins_over_dropped_variables(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    out = tmp_path / "cvd"
    spec = LaunchSpec(name="w0", argv=("bash", "-c", f"echo -n $CUDA_VISIBLE_DEVICES > {out}"),
                      env={"CUDA_VISIBLE_DEVICES": "0,1"})
    h = LocalLauncher(drop_env=RAY_INJECTED_ENV).start(spec, tmp_path / "w0.log")
    assert wait_exit(h) == 0 and out.read_text() == "0,1"


def test_stop_terminates_the_whole_group(tmp_path):
    spec = LaunchSpec(name="w0", argv=("bash", "-c", "sleep 300 & sleep 300 & wait"))
    h = LocalLauncher().start(spec, tmp_path / "w0.log")
    assert wait_for(lambda: len(psutil.Process(h.pid).children()) == 2, 10)
    kids = psutil.Process(h.pid).children()
    t = time.monotonic()
    code = h.stop(timeout=5)
    assert code == -signal.SIGTERM and time.monotonic() - t < 4
    assert not any(k.is_running() and k.status() != psutil.STATUS_ZOMBIE for k in kids)


def test_stop_escalates_to_kill(tmp_path):
    spec = LaunchSpec(name="w0", argv=("bash", "-c", "trap '' TERM; while :; do sleep 0.1; done"))
    h = LocalLauncher().start(spec, tmp_path / "w0.log")
    time.sleep(0.3)
    assert h.stop(timeout=0.5) == -signal.SIGKILL


def test_missing_binary_is_a_launch_error(tmp_path):
    spec = LaunchSpec(name="w0", argv=(str(tmp_path / "no-llama-server"), "-m", "x"))
    with pytest.raises(LaunchError, match=r"worker 'w0': cannot run .*no-llama-server.*not found"):
        LocalLauncher().start(spec, tmp_path / "w0.log")


def test_child_dies_when_its_parent_is_killed(tmp_path):
    """The actor that started llama-server is kill -9'd: the parent-death signal takes the child down."""
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(f"""
        import sys, threading, time
        sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})
        from pathlib import Path
        from orchestrator.cluster.procs import LocalLauncher
        from orchestrator.launch.spec import LaunchSpec
        box = {{}}
        def spawn():   # like the worker actor: from a long-lived thread
            box['h'] = LocalLauncher().start(LaunchSpec(name="w", argv=("sleep", "300")), Path({str(tmp_path / 'c.log')!r}))
            print(box['h'].pid, flush=True)
            time.sleep(1000)
        threading.Thread(target=spawn, daemon=True).start()
        time.sleep(1000)
    """))
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    child = None
    try:
        child = int(parent.stdout.readline())
        assert wait_for(lambda: psutil.Process(child).name() == "sleep", 10)
        parent.kill()
        parent.wait()
        gone = wait_for(lambda: not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE, 5)
        assert gone, "child outlived its killed parent"
    finally:
        if parent.poll() is None:
            parent.kill()
        if child and psutil.pid_exists(child) and psutil.Process(child).name() == "sleep":
            os.kill(child, signal.SIGKILL)   # never leave the orphan behind, even when the test fails


def test_cause_of_a_real_llama_server_failure(tmp_path, llama_server_path):
    missing = tmp_path / "missing.gguf"
    spec = LaunchSpec(name="w0", argv=(llama_server_path, "-m", str(missing), "--port", str(free_port())))
    h = LocalLauncher().start(spec, tmp_path / "w0.log")
    assert wait_exit(h) != 0
    cause = h.cause()     # mainline and ik_llama.cpp word it differently; both name the file and the errno
    assert "failed to open" in cause and "No such file or directory" in cause and str(missing) in cause
    # a second run appends to the same log; its cause is read from its own part
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(4096))
    spec2 = LaunchSpec(name="w0", argv=(llama_server_path, "-m", str(bad), "--port", str(free_port())))
    h2 = LocalLauncher().start(spec2, tmp_path / "w0.log")
    assert wait_exit(h2) != 0
    c2 = h2.cause()
    assert "missing.gguf" not in c2 and ("bad.gguf" in c2 or "model" in c2.lower())


def test_listener_on_sees_listeners_not_leftover_connections():
    import socket

    from orchestrator.cluster.procs import listener_on

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        assert listener_on("127.0.0.1", port) is None              # bound, not listening
        s.listen()
        assert listener_on("127.0.0.1", port) == f"pid {os.getpid()} ({psutil.Process().name()})"
        assert listener_on("0.0.0.0", port) is not None            # a wildcard spec conflicts with it too
        # a connection that the server side closes first leaves a TIME-WAIT on the port: not a listener
        c = socket.create_connection(("127.0.0.1", port))
        conn, _ = s.accept()
        conn.close()
        c.close()
    assert listener_on("127.0.0.1", port) is None


def test_a_process_keeps_its_identity_when_the_wall_clock_steps(monkeypatch):
    """A process is known by pid and start since boot. psutil's wall-clock start time is boot time plus that, and
    the boot time moves when the clock is stepped (NTP, a resumed VM): here by 3 s, as two processes reading it a
    moment apart can see. The identity must not move with it, and a different start must still be told apart."""
    import psutil._pslinux as pslinux

    from orchestrator.cluster.keeper import alive, process_identity

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        ident = process_identity(child.pid)
        wall_before = psutil.Process(child.pid).create_time()
        real_boot = pslinux.boot_time
        monkeypatch.setattr(pslinux, "boot_time", lambda: real_boot() + 3.0)
        assert abs(psutil.Process(child.pid).create_time() - wall_before) > 2.5     # the step is visible to psutil
        assert alive(ident)
        assert started_since_boot(child.pid) == ident["started"]
        assert not same_start(child.pid, ident["started"] + 0.5)                    # another process at that pid
        assert not alive({**ident, "started": ident["started"] - 1.0})
    finally:
        child.kill()
        child.wait()
    assert not alive(ident)


def test_older_records_with_a_wall_clock_start_still_match():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        wall = psutil.Process(child.pid).create_time()
        assert same_start(child.pid, wall) and not same_start(child.pid, wall - 5.0)
        assert same_start(child.pid, None)
    finally:
        child.kill()
        child.wait()


def test_ports_for_ray_come_from_below_the_ephemeral_range():
    """A port the kernel would hand to an outgoing connection can be taken before Ray binds it; the ports the
    embedded head is given are free now, below that range and above Ray's own worker ports."""
    import socket

    from orchestrator.cluster.head import RAY_WORKER_PORTS_END, _ephemeral_low, free_port

    low = _ephemeral_low()
    ports = {free_port() for _ in range(20)}
    assert len(ports) > 1
    for port in ports:
        assert RAY_WORKER_PORTS_END < port < low         # and not among Ray's worker ports
        with socket.socket() as s:                      # and nothing holds it
            s.bind(("127.0.0.1", port))


def test_ports_given_to_one_head_are_distinct_even_when_the_draw_repeats():
    """Nothing binds the head's ports until Ray starts, so a second draw of the same number looks free: Ray then
    refuses the whole start ('port 29023 that is used by other components', seen in CI). Ports already given are
    skipped, whatever the draw; the kernel's pick is the last resort and is checked the same way."""
    import random

    from orchestrator.cluster.head import RAY_WORKER_PORTS_END, _ephemeral_low, free_port

    class SameNumber(random.Random):          # the draw's seam: always the same port
        def randrange(self, *a, **k):
            return 25001

    rng = SameNumber()
    first = free_port(avoid=(), rng=rng)
    second = free_port(avoid={first}, rng=rng)
    third = free_port(avoid={first, second}, rng=rng)
    assert len({first, second, third}) == 3
    if _ephemeral_low() > 25001:                # the draw is used where the range leaves room for it
        assert first == 25001
