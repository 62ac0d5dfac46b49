"""The supervisor state machine, stepped with a fake clock, fake processes and a fake /health."""

from __future__ import annotations

import time

from pathlib import Path

import pytest

from orchestrator.cluster.deployment import RestartPolicy
from orchestrator.cluster.supervisor import BACKOFF, FAILED, READY, STARTING, STOPPED, Health, Supervisor
from orchestrator.errors import LaunchError
from orchestrator.launch.spec import LaunchSpec


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t

    def advance(self, s: float) -> None:
        self.t += s


class FakeProc:
    def __init__(self, pid: int, log: str = "") -> None:
        self.pid = pid
        self.log_path = Path("/dev/null")
        self.code: int | None = None
        self.stopped = False
        self.log = log

    def poll(self):
        return self.code

    def stop(self, timeout):
        self.stopped = True
        if self.code is None:
            self.code = -15
        return self.code

    def cause(self):
        return self.log


class FakeLauncher:
    def __init__(self) -> None:
        self.procs: list[FakeProc] = []
        self.fail_with: str | None = None
        self.next_log = ""

    def start(self, spec, log_path):
        if self.fail_with:
            raise LaunchError(self.fail_with)
        p = FakeProc(100 + len(self.procs), self.next_log)
        self.procs.append(p)
        return p


class FakeProbe:
    def __init__(self) -> None:
        self.ok = False
        self.calls = 0

    def __call__(self, url, timeout):
        self.calls += 1
        return Health(True) if self.ok else Health(False, "HTTP 503 Loading model")


SPEC = LaunchSpec(name="w0", argv=("llama-server", "-m", "m.gguf"), port=9001)
PORT: dict = {"busy": None}


def make(**policy):
    clock, launcher, probe = Clock(), FakeLauncher(), FakeProbe()
    pol = RestartPolicy(**{"backoff_initial_s": 1.0, "backoff_max_s": 8.0, "health_timeout_s": 10.0,
                           "load_timeout_s": 60.0, "stable_s": 30.0, "max_restarts": 3, **policy})
    sup = Supervisor(SPEC, pol, launcher, Path("/tmp/w0.log"), probe=probe, clock=clock,
                     port_check=lambda host, port: PORT["busy"])
    PORT["busy"] = None
    return sup, clock, launcher, probe


def run_until_ready(sup, clock, probe):
    probe.ok = True
    clock.advance(0.5)
    assert sup.update() == READY


def test_start_waits_for_health_then_ready():
    sup, clock, launcher, probe = make()
    sup.start()
    assert sup.state == STARTING and len(launcher.procs) == 1
    for _ in range(5):
        clock.advance(1)
        assert sup.update() == STARTING          # 503 while loading
    snap = sup.snapshot()
    assert snap["pid"] == 100 and not snap["healthy"] and "Loading" in snap["health_detail"]
    assert snap["load_s"] is None
    run_until_ready(sup, clock, probe)
    assert sup.snapshot()["healthy"] and sup.snapshot()["pid"] == 100
    assert sup.snapshot()["load_s"] == pytest.approx(sup.ready_at - sup.started_at) and sup.snapshot()["load_s"] >= 5
    assert abs(sup.snapshot()["spawned_wall"] - time.time()) < 60        # wall-clock spawn time, for `up`'s line


def test_crash_restarts_with_exponential_backoff_then_gives_up():
    sup, clock, launcher, probe = make(max_restarts=3)
    launcher.next_log = "slot print_timing: id 1 | task 1 | total time = 58.18 ms"
    sup.start()
    run_until_ready(sup, clock, probe)
    delays = []
    for i in range(4):
        launcher.procs[-1].code = -9               # kill -9
        clock.advance(0.25)
        sup.update()
        if i == 3:
            break
        assert sup.state == BACKOFF, sup.last_error
        assert sup.last_error == "killed by SIGKILL"       # no log lines: it was killed, not failing
        t0 = clock.t
        while sup.state == BACKOFF:
            clock.advance(0.25)
            sup.update()
        delays.append(round(clock.t - t0, 2))
        assert sup.state == STARTING
        clock.advance(0.25)
        sup.update()
        assert sup.state == READY                  # probe still ok: the restarted server is up
    assert delays == [1.0, 2.0, 4.0]
    assert sup.state == FAILED
    assert "gave up after 3 restart(s)" in sup.reason and "SIGKILL" in sup.reason
    assert sup.restarts == 3 and len(launcher.procs) == 4
    assert all(p.stopped for p in launcher.procs)   # every run was reaped


def test_backoff_is_capped():
    sup, clock, launcher, probe = make(max_restarts=10, backoff_max_s=3.0)
    sup.start()
    run_until_ready(sup, clock, probe)
    for _ in range(4):
        launcher.procs[-1].code = 1
        sup.update()
        assert sup.state == BACKOFF
        assert sup.next_start_at - clock.t <= 3.0
        clock.t = sup.next_start_at
        sup.update()
        clock.advance(0.1)
        sup.update()


def test_hung_server_is_killed_and_restarted():
    sup, clock, launcher, probe = make(health_timeout_s=10.0, health_interval_s=1.0)
    sup.start()
    run_until_ready(sup, clock, probe)
    probe.ok = False                               # the process lives but stops answering
    for _ in range(9):
        clock.advance(1.0)
        assert sup.update() == READY
    clock.advance(1.5)
    assert sup.update() == BACKOFF
    assert launcher.procs[0].stopped and launcher.procs[0].code == -15   # TERMed, not just forgotten
    assert sup.last_error.startswith("hung: /health failing")


def test_probe_interval_is_respected_when_ready():
    sup, clock, launcher, probe = make(health_interval_s=2.0)
    sup.start()
    run_until_ready(sup, clock, probe)
    n = probe.calls
    for _ in range(8):
        clock.advance(0.25)
        sup.update()
    assert probe.calls - n == 1


def test_failure_before_first_ready_fails_fast_with_cause():
    sup, clock, launcher, probe = make()
    launcher.next_log = "gguf_init_from_file: failed to open GGUF file 'x.gguf' (No such file or directory)"
    sup.start()
    launcher.procs[0].code = 1
    clock.advance(0.25)
    assert sup.update() == FAILED
    assert "exited with status 1 while loading" in sup.reason
    assert "No such file or directory" in sup.reason
    assert sup.restarts == 0 and len(launcher.procs) == 1


def test_failure_before_ready_is_retried_without_fail_fast():
    sup, clock, launcher, probe = make(fail_fast=False, max_restarts=1)
    sup.start()
    launcher.procs[0].code = 1
    clock.advance(0.25)
    assert sup.update() == BACKOFF
    clock.advance(1.0)
    sup.update()
    launcher.procs[1].code = 1
    clock.advance(0.25)
    assert sup.update() == FAILED


def test_load_timeout():
    sup, clock, launcher, probe = make(load_timeout_s=5.0)
    sup.start()
    for _ in range(5):
        clock.advance(1.0)
        assert sup.update() == STARTING
    clock.advance(1.0)
    assert sup.update() == FAILED
    assert "not healthy 5s after start" in sup.reason and "Loading model" in sup.reason
    assert launcher.procs[0].stopped


def test_spawn_error_is_a_failure_not_an_exception():
    sup, clock, launcher, probe = make()
    launcher.fail_with = "worker 'w0': cannot run '/nope/llama-server': not found or not executable"
    sup.start()
    assert sup.state == FAILED
    assert sup.reason == "failed to start: cannot run '/nope/llama-server': not found or not executable"


def test_stable_run_resets_the_failure_count():
    sup, clock, launcher, probe = make(max_restarts=1, stable_s=30.0)
    sup.start()
    run_until_ready(sup, clock, probe)
    for _ in range(3):                             # 3 crashes, each after a long healthy run: never gives up
        clock.advance(31)
        sup.update()
        launcher.procs[-1].code = -9
        sup.update()
        assert sup.state == BACKOFF and sup.failures == 1
        clock.advance(1.0)
        sup.update()
        clock.advance(0.25)
        assert sup.update() == READY
    assert sup.restarts == 3


def test_stop_kills_and_stays_stopped():
    sup, clock, launcher, probe = make()
    sup.start()
    run_until_ready(sup, clock, probe)
    sup.stop()
    assert sup.state == STOPPED and launcher.procs[0].stopped
    clock.advance(100)
    assert sup.update() == STOPPED and len(launcher.procs) == 1


@pytest.mark.parametrize("code,text", [(-9, "killed by SIGKILL"), (2, "exited with status 2"),
                                       (-15, "killed by SIGTERM")])
def test_exit_descriptions(code, text):
    from orchestrator.cluster.supervisor import describe_exit

    assert describe_exit(code) == text


def test_restart_waits_for_a_busy_port_without_counting_failures():
    sup, clock, launcher, probe = make(port_wait_s=10.0, max_restarts=1)
    sup.start()
    run_until_ready(sup, clock, probe)
    launcher.procs[-1].code = -9
    PORT["busy"] = "port 9001 on 127.0.0.1 is already in use"
    sup.update()
    for _ in range(12):                            # 6 s of a busy port: no spawn, no restart counted
        clock.advance(0.5)
        assert sup.update() == BACKOFF
    assert len(launcher.procs) == 1 and sup.restarts == 0 and "waiting for the port" in sup.snapshot()["health_detail"]
    PORT["busy"] = None
    clock.advance(0.5)
    assert sup.update() == STARTING and sup.restarts == 1 and len(launcher.procs) == 2


def test_a_port_busy_for_too_long_is_a_failed_run():
    sup, clock, launcher, probe = make(port_wait_s=2.0, max_restarts=3)
    sup.start()
    run_until_ready(sup, clock, probe)
    launcher.procs[-1].code = -9
    PORT["busy"] = "port 9001 on 127.0.0.1 is already in use"
    launcher.fail_with = "worker w0: port 9001 on 127.0.0.1 is already in use (choose another port ...)"
    sup.update()
    for _ in range(8):
        clock.advance(0.5)
        sup.update()
    assert sup.restarts == 1 and sup.failures == 2 and "already in use" in sup.last_error


def test_a_listener_on_the_port_fails_the_first_start():
    sup, clock, launcher, probe = make()
    PORT["busy"] = "127.0.0.1:9001 is already in use by pid 77 (llama-server)"
    sup.start()
    assert sup.state == FAILED and launcher.procs == []          # nothing started: that server would answer
    assert sup.reason == "failed to start: 127.0.0.1:9001 is already in use by pid 77 (llama-server)"


def test_a_crash_keeps_the_cause_from_the_log():
    sup, clock, launcher, probe = make()
    launcher.next_log = "ggml_abort: CUDA error: out of memory"
    sup.start()
    run_until_ready(sup, clock, probe)
    launcher.procs[-1].code = -6                   # SIGABRT: its own doing, the log says why
    sup.update()
    assert sup.last_error == "killed by SIGABRT: ggml_abort: CUDA error: out of memory"
