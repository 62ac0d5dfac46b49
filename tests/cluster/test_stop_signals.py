"""How `up` hears that it should stop: real signals to this very process, real pipes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.cluster.lifecycle import output_closed
from orchestrator.sigutil import StopRequested, StopSignals

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
import cluster_support as S  # noqa: E402


@pytest.fixture(autouse=True)
def interactive_dispositions():
    """These tests send SIGINT, SIGTERM and SIGHUP: each starts from the dispositions an interactive shell gives,
    also under `nohup` or as a background job."""
    with S.stop_signals_at_defaults():
        yield


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_the_first_signal_stops_later_ones_only_count(sig):
    before = {s: signal.getsignal(s) for s in StopSignals.SIGNALS}
    with StopSignals() as sigs:
        with pytest.raises(StopRequested) as e:
            os.kill(os.getpid(), sig)
        assert e.value.signum == sig and e.value.exit_code == 128 + sig
        assert isinstance(e.value, KeyboardInterrupt)       # every Ctrl-C clean-up path handles it
        os.kill(os.getpid(), signal.SIGTERM)                # during the stop: counted, nothing raised
        os.kill(os.getpid(), signal.SIGINT)
        assert sigs.first == sig and sigs.count == 3
    assert {s: signal.getsignal(s) for s in StopSignals.SIGNALS} == before


def test_a_held_signal_is_raised_when_the_hold_ends():
    with StopSignals() as sigs:
        done = []
        with pytest.raises(StopRequested) as e:
            with sigs.held():
                os.kill(os.getpid(), signal.SIGTERM)
                done.append("the held section ran to its end")
        assert done and e.value.signum == signal.SIGTERM
        with sigs.held():                                    # nothing arrives: nothing raised
            pass


def test_ray_init_and_shutdown_keep_our_handlers():
    """ray.init() installs a SIGTERM handler that exits at once; RayApi puts ours back (a real local Ray)."""
    code = r"""
import os, signal, sys
from orchestrator.sigutil import StopRequested, StopSignals, keep_signal_handlers
import ray
with StopSignals() as sigs:
    mine = signal.getsignal(signal.SIGTERM)
    with keep_signal_handlers():
        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    assert signal.getsignal(signal.SIGTERM) is mine, signal.getsignal(signal.SIGTERM)
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        import time; time.sleep(5)
        print("not raised")
    except StopRequested:
        print("stop requested")
    with keep_signal_handlers():
        ray.shutdown()
    assert signal.getsignal(signal.SIGTERM) is mine
    # ray.shutdown() resets SIGTERM below Python: it must still reach our handler (counted: the stop has begun)
    os.kill(os.getpid(), signal.SIGTERM)
    import time; time.sleep(1)
    print("signals seen", sigs.count)
"""
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_AUTH_MODE": "disabled"}
    res = subprocess.run(S.with_stop_signals_reset([sys.executable, "-c", code]), env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip().splitlines()[-2:] == ["stop requested", "signals seen 2"]


def test_output_closed_sees_a_pipe_whose_reader_went_away():
    code = ("import sys, time; from orchestrator.cluster.lifecycle import output_closed\n"
            "print(output_closed(), file=sys.stderr, flush=True)\n"
            "sys.stdin.readline()\n"
            "print(output_closed(), file=sys.stderr, flush=True)\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    p = subprocess.Popen([sys.executable, "-c", code], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    assert p.stderr.readline().strip() == "False"
    p.stdout.close()                                          # stdout's reader is gone (tee died)
    p.stdin.write("\n")
    p.stdin.flush()
    assert p.stderr.readline().strip() == "True"
    p.wait(timeout=30)
    assert output_closed() in (False, True)                   # pytest's own capture: a file, never raises


def test_a_sigterm_during_ray_init_waits_for_it_and_reaches_our_handler():
    """A SIGTERM while ray.init runs (a second signal while `up` stops and reconnects): Ray's handler would
    sys.exit(15) in the middle; it is kept pending until Ray is done and then raised by ours."""
    code = r"""
import os, signal, threading
from orchestrator.sigutil import StopRequested, StopSignals, keep_signal_handlers, stop_signals_blocked
import ray
with StopSignals() as sigs:
    with stop_signals_blocked():                  # as up starts its own threads
        threading.Timer(0.2, lambda: os.kill(os.getpid(), signal.SIGTERM)).start()
    try:
        with keep_signal_handlers():
            ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
            print("init done", ray.is_initialized(), flush=True)
        import time; time.sleep(5)
        print("not raised")
    except StopRequested as e:
        print("stop requested after init", e.signum == signal.SIGTERM)
    with keep_signal_handlers():
        ray.shutdown()
"""
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_AUTH_MODE": "disabled"}
    res = subprocess.run(S.with_stop_signals_reset([sys.executable, "-c", code]), env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip().splitlines()[-2:] == ["init done True", "stop requested after init True"]


def test_a_child_is_started_with_the_stop_signals_a_terminal_gives():
    """What a test run inherited (`nohup`: SIGHUP ignored; a background job: SIGINT ignored) is not what the
    `up` these tests start gets: with_stop_signals_reset gives it the defaults, in the same process (pid)."""
    code = ("import os, signal; print(os.getpid(), [getattr(signal.getsignal(s), 'name', 'KeyboardInterrupt') "
            "for s in (1, 2, 15)])")
    old = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGHUP, signal.SIGINT)}
    try:
        inherited = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout
        p = subprocess.Popen(S.with_stop_signals_reset([sys.executable, "-c", code]), stdout=subprocess.PIPE,
                             text=True)
        reset = p.communicate(timeout=60)[0]
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    assert inherited.split(" ", 1)[1].strip() == "['SIG_IGN', 'SIG_IGN', 'SIG_DFL']"
    pid, seen = reset.split(" ", 1)
    assert int(pid) == p.pid and seen.strip() == "['SIG_DFL', 'KeyboardInterrupt', 'SIG_DFL']"
