"""`up`'s phases unwind in the reverse of the order they started, and a failure in each late phase (controller,
ready, serve) leaves nothing behind. A real `up` of a one-replica topology over a tiny model (its llama-server
started early under a keeper, an embedded Ray head, the controller and gateway actors), run in this process;
each failure is a real one, injected where `up` says what it does next: a stop signal, the gateway's port taken
by someone else, the raylet killed."""

from __future__ import annotations

import os
import signal
import socket
import sys
from pathlib import Path

import psutil
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cluster"))
import cluster_support as S  # noqa: E402

from orchestrator.errors import ClusterError  # noqa: E402
from orchestrator.sigutil import StopRequested  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.slow]

# the phases of an `up` on this machine, in the order they start, and the undoing each registers
PHASES = ["lock", "signals", "resolve", "early head", "pull", "prefetch", "early servers", "head", "controller",
          "ready", "serve"]
UNDO_OF = {"lock": "lock", "signals": "signals", "early head": "early head", "prefetch": "prefetch",
           "early servers": "early servers", "head": "head", "ray connection": "controller",
           "controller": "controller", "stop": "serve"}
NUMA_BALANCING = Path("/proc/sys/kernel/numa_balancing")


@pytest.fixture()
def iso(tmp_path, monkeypatch, llama_server_path):
    monkeypatch.setenv("ORCHESTRATOR_STATE", str(tmp_path / "state"))
    monkeypatch.setenv("LLAMA_SERVER", llama_server_path)
    with S.stop_signals_at_defaults():                  # the signals these tests send, whatever the run inherited
        yield {"tmp": tmp_path, "binary": llama_server_path, "model": S.write_tiny_llama(tmp_path / "tiny.gguf"),
               "state": tmp_path / "state"}


def _startup(iso, ns: str, *, detach: bool, on_say):
    from orchestrator.cluster.startup import Startup
    from orchestrator.config import load_topology

    gw = S.free_port()
    topo = iso["tmp"] / f"{ns}.yaml"
    topo.write_text(f"model:\n  path: {iso['model']}\n  context: 1024\nworkers:\n  replicas: 1\n"
                    f"  port_base: {S.free_port_base(2)}\ngateway:\n  port: {gw}\n"
                    f"ray:\n  address: local\n  dashboard_port: {S.free_port()}\n  namespace: {ns}\n")
    up = Startup(load_topology(topo), detach=detach)
    said = []

    def say(msg: str) -> None:
        said.append(msg)
        on_say(up, msg)

    up.say = say
    up.said = said
    up.gateway_port = gw
    return up


def _started(up) -> list[str]:
    return [t.split(" ", 1)[1] for t in up.trace if t.startswith("start ")]


def _undone(up) -> list[str]:
    return [t.split(" ", 1)[1] for t in up.trace if t.startswith("undo ")]


def _assert_unwinds_in_reverse(up) -> None:
    """Every undoing belongs to a phase that started, and they run newest phase first."""
    started = _started(up)
    assert started == PHASES[:len(started)], up.trace
    order = [started.index(UNDO_OF[u]) for u in _undone(up)]
    assert order == sorted(order, reverse=True), up.trace


def _leftovers(iso, up) -> list[str]:
    ours = S.processes_with
    left = [f"llama-server {q.pid}" for q in ours(str(iso["model"])) if q.name() == "llama-server"]
    left += [f"keeper {q.pid}" for q in ours(f"run/{up.namespace}/")]
    left += [f"numa wrapper {q.pid}" for q in ours("disable-numa-balancing") if str(iso["model"]) in
             " ".join(q.cmdline())]
    if up.st is not None and up.st.head_temp_dir:
        left += [f"{q.name()} {q.pid}" for q in S.ray_processes_of(up.st.head_temp_dir)
                 if q.is_running() and q.status() != psutil.STATUS_ZOMBIE]
    if (iso["state"] / "cluster" / f"{up.namespace}.json").exists():
        left.append("the state file")
    return left


def _nothing_left(iso, up, numa_before: str | None) -> None:
    assert S.wait_for(lambda: _leftovers(iso, up) == [], 15), (_leftovers(iso, up), up.said)
    assert up.st is not None and up.st.head_temp_dir, "the head never started: the failure came too early"
    assert not Path(up.st.head_temp_dir).parent.exists(), "Ray's temp dir was left"
    if numa_before is not None:
        assert NUMA_BALANCING.read_text() == numa_before


def _numa_now() -> str | None:
    try:
        return NUMA_BALANCING.read_text()
    except OSError:
        return None


def test_a_failure_while_becoming_ready_unwinds_every_phase_in_reverse(iso):
    """The gateway's port is taken by someone else right after `up` checked it, as the controller starts: the
    gateway cannot listen, so the ready phase fails with that line; every phase that started is undone, newest
    first, and nothing is left."""
    numa = _numa_now()
    holder = socket.socket()

    def on_say(up, msg):
        if msg.startswith("starting 1 worker(s) and the gateway"):
            holder.bind(("127.0.0.1", up.gateway_port))
            holder.listen()

    up = _startup(iso, "phases-ready", detach=True, on_say=on_say)
    try:
        with pytest.raises(ClusterError, match=rf"gateway cannot serve on 127\.0\.0\.1:{up.gateway_port}"):
            up.run()
    finally:
        holder.close()
    assert _started(up) == PHASES[:PHASES.index("ready") + 1]
    assert _undone(up) == ["controller", "ray connection", "head", "early servers", "prefetch", "early head",
                           "signals", "lock"]
    _assert_unwinds_in_reverse(up)
    assert any("starting now, while Ray starts" in m for m in up.said), up.said    # an early server was running
    _nothing_left(iso, up, numa)


def test_a_stop_signal_in_the_controller_phase_undoes_what_started(iso):
    """SIGTERM as the controller phase starts the controller (the early llama-server loading, the head up): the
    signal's StopRequested propagates, and the controller, the head and the early server are undone in turn."""
    numa = _numa_now()

    def on_say(up, msg):
        if msg.startswith("starting 1 worker(s) and the gateway"):
            os.kill(os.getpid(), signal.SIGTERM)

    up = _startup(iso, "phases-ctrl", detach=True, on_say=on_say)
    with pytest.raises(StopRequested) as e:
        up.run()
    assert e.value.signum == signal.SIGTERM
    assert _started(up)[-1] == "controller"
    assert _undone(up)[:3] == ["controller", "ray connection", "head"]
    _assert_unwinds_in_reverse(up)
    assert "interrupted: stopping everything up started ..." in up.said
    _nothing_left(iso, up, numa)


def test_the_head_lost_while_serving_is_stopped_by_the_stop_phase(iso):
    """A foreground `up` serving, and its raylet is killed outright: the serve phase ends with status 1 and its
    undoing (the stop, as `down`) stops the rest; the head's and controller's own undoing do not run again, and
    nothing is left."""
    numa = _numa_now()

    def on_say(up, msg):
        if msg.startswith("serving;"):
            raylet = next(q for q in S.ray_processes_of(up.st.head_temp_dir) if q.name() == "raylet")
            raylet.kill()

    up = _startup(iso, "phases-serve", detach=False, on_say=on_say)
    assert up.run() == 1, up.said
    assert _started(up) == PHASES
    assert _undone(up)[0] == "stop" and "controller" not in _undone(up) and "head" not in _undone(up)
    _assert_unwinds_in_reverse(up)
    assert "the Ray head is gone: cleaning up" in up.said and up.result.stopped
    _nothing_left(iso, up, numa)
