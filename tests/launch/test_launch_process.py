"""launch.process with real processes: the real llama-server on a tiny GGUF (start, /health, a completion, stop
with nothing left), real load failures giving llama-server's own reason, and the stop path for stubborn or
leaky process groups."""

from __future__ import annotations

import json
import os
import socket
import time
import urllib.request
from pathlib import Path

import pytest

from orchestrator.errors import LaunchError
from orchestrator.launch import LaunchSpec, NumaPolicy, worker_spec
from orchestrator.launch.process import group_members, launch, log_cause, start

pytestmark = pytest.mark.integration


def server_argv(server: str, model: Path, port: int, *extra: str) -> list[str]:
    return [server, "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-c", "256", "-t", "1",
            "-np", "1", *extra]


@pytest.fixture
def balancing(tmp_path):
    """A fake NUMA-balancing file (value 1) and the env that points the wrapper at it."""
    f = tmp_path / "numa_balancing"
    f.write_text("1\n")
    return f, {"NUMA_BALANCING_FILE": str(f), "NUMA_BALANCING_STATE_DIR": str(tmp_path / "state")}


def gone(pid: int) -> bool:
    """Not running and reaped (no /proc entry at all)."""
    return not os.path.exists(f"/proc/{pid}")


def wait_until(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def children_of(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def completion(url: str, prompt: str = "hello") -> dict:
    req = urllib.request.Request(f"{url}/completion", data=json.dumps({"prompt": prompt, "n_predict": 4, "ignore_eos": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(req, timeout=60) as r:
        assert r.status == 200
        return json.loads(r.read())


# --- the happy path -------------------------------------------------------------------------------------------

def test_llama_server_under_both_wrappers_starts_serves_and_stops_clean(
        llama_server_path, tiny_gguf, free_port, tmp_path, balancing, numactl_path):
    fake, env = balancing
    cpu = min(os.sched_getaffinity(0))
    spec = worker_spec("w0", server_argv(llama_server_path, tiny_gguf, free_port),
                       numa=NumaPolicy.bind([0], cpus=[cpu]), disable_numa_balancing=True, env=env, port=free_port)
    log = tmp_path / "logs" / "w0.log"
    proc = start(spec, log)
    try:
        ready_s = proc.wait_healthy(timeout=120)
        assert 0 < ready_s < 120
        wrapper = proc.pid
        assert Path(f"/proc/{wrapper}/cmdline").read_bytes().split(b"\0")[1].endswith(b"disable-numa-balancing.sh")
        (server,) = children_of(wrapper)                  # numactl exec'd llama-server: the wrapper's only child
        assert Path(f"/proc/{server}/exe").resolve() == Path(llama_server_path).resolve()
        assert os.sched_getaffinity(server) == {cpu}      # the numactl binding is in force
        assert set(proc.members()) == {wrapper, server}
        assert fake.read_text().strip() == "0"            # balancing off while it runs
        assert proc.healthy()
        assert completion(spec.connect_url)["tokens_predicted"] == 4
    finally:
        rc = proc.stop(grace=20)
    # one SIGTERM reached llama-server (a second would make it exit 1): a clean exit, passed on by the wrapper
    assert rc == 0
    assert gone(wrapper) and gone(server)
    assert group_members(wrapper) == []
    assert fake.read_text().strip() == "1"                # restored
    text = log.read_text()
    assert text.startswith("# orchestrator: ") and "starting worker w0" in text
    assert "listening on http://127.0.0.1:" in text


def test_wrapper_killed_behind_our_back(llama_server_path, tiny_gguf, free_port, tmp_path, balancing):
    """The wrapper dies by SIGKILL (say, the OOM killer) while llama-server runs on: stop() still ends the
    server and the balancing setting comes back."""
    fake, env = balancing
    spec = worker_spec("orphan", server_argv(llama_server_path, tiny_gguf, free_port), disable_numa_balancing=True,
                       env=env, port=free_port)
    proc = start(spec, tmp_path / "orphan.log")
    proc.wait_healthy(timeout=120)
    (server,) = children_of(proc.pid)
    os.kill(proc.pid, 9)
    wait_until(lambda: proc.poll() is not None)
    assert proc.members() == [server] and proc.health() == 200
    assert fake.read_text().strip() == "0"
    assert proc.stop(grace=20) == -9
    assert group_members(proc.pid) == []
    wait_until(lambda: gone(server) or Path(f"/proc/{server}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z")
    assert fake.read_text().strip() == "1"


def test_plain_llama_server_with_launch_helper(llama_server_path, tiny_gguf, free_port, tmp_path):
    spec = LaunchSpec("plain", tuple(server_argv(llama_server_path, tiny_gguf, free_port)), port=free_port)
    with launch(spec, tmp_path / "plain.log", timeout=120) as proc:
        assert proc.health() == 200
        pid = proc.pid
        assert Path(f"/proc/{pid}/exe").resolve() == Path(llama_server_path).resolve()
    assert proc.returncode == 0
    assert gone(pid)
    assert proc.health(timeout=0.5) is None               # nothing answers any more


# --- llama-server fails: its reason reaches the error ---------------------------------------------------------

def test_corrupt_gguf_gives_llama_servers_reason(llama_server_path, truncated_gguf, free_port, tmp_path, balancing,
                                                 numactl_path):
    fake, env = balancing
    spec = worker_spec("bad", server_argv(llama_server_path, truncated_gguf, free_port),
                       numa=NumaPolicy.interleave([0]), disable_numa_balancing=True, env=env, port=free_port)
    proc = start(spec, tmp_path / "bad.log")
    with pytest.raises(LaunchError) as ei:
        proc.wait_healthy(timeout=120)
    msg = str(ei.value)
    assert msg.startswith("worker bad: llama-server exited with status 1 before it was ready: ")
    assert "data is not within the file bounds, model is corrupted or incomplete" in msg
    assert f"(log: {tmp_path / 'bad.log'})" in msg
    assert "\n" not in msg
    assert group_members(proc.pid) == [] and gone(proc.pid)
    assert fake.read_text().strip() == "1"


def test_missing_model_reason(llama_server_path, free_port, tmp_path):
    spec = LaunchSpec("nomodel", tuple(server_argv(llama_server_path, tmp_path / "absent.gguf", free_port)),
                      port=free_port)
    with pytest.raises(LaunchError, match=r"failed to open GGUF file '.*absent.gguf' \(No such file or directory\)"):
        launch(spec, tmp_path / "nomodel.log", timeout=120)


def test_port_taken_is_refused_before_starting(llama_server_path, tiny_gguf, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        spec = LaunchSpec("busy", tuple(server_argv(llama_server_path, tiny_gguf, port)), port=port)
        with pytest.raises(LaunchError, match=f"worker busy: port {port} on 127.0.0.1 is already in use"):
            start(spec, tmp_path / "busy.log")
        assert not (tmp_path / "busy.log").exists()      # nothing was started


def test_port_lost_in_a_race_gives_the_bind_error(llama_server_path, tiny_gguf, tmp_path):
    """Taken after our check: llama-server's own 'couldn't bind' comes back."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        spec = LaunchSpec("race", tuple(server_argv(llama_server_path, tiny_gguf, port)), port=port)
        proc = start(spec, tmp_path / "race.log", check_port=False)
        with pytest.raises(LaunchError, match=f"couldn't bind HTTP server socket, hostname: 127.0.0.1, port: {port}"):
            proc.wait_healthy(timeout=120)


def test_missing_binary(tmp_path, free_port):
    spec = LaunchSpec("nobin", (str(tmp_path / "llama-server"), "-m", "x"), port=free_port)
    with pytest.raises(LaunchError, match=r"worker nobin: cannot run .*llama-server: no such file"):
        start(spec, tmp_path / "nobin.log")


def test_missing_binary_behind_numactl(tmp_path, free_port, numactl_path):
    spec = worker_spec("nobin2", [str(tmp_path / "llama-server"), "-m", "x"], numa=NumaPolicy.interleave([0]),
                       port=free_port)
    with pytest.raises(LaunchError) as ei:
        launch(spec, tmp_path / "nobin2.log", timeout=60)
    assert "exited with status 1 before it was ready" in str(ei.value)
    assert f"execution of `{tmp_path / 'llama-server'}': No such file or directory" in str(ei.value)


def test_previous_runs_in_the_same_log_are_not_blamed(llama_server_path, truncated_gguf, free_port, tmp_path):
    log = tmp_path / "same.log"
    first = LaunchSpec("w", tuple(server_argv(llama_server_path, tmp_path / "absent.gguf", free_port)), port=free_port)
    with pytest.raises(LaunchError, match="No such file or directory"):
        launch(first, log, timeout=120)
    second = LaunchSpec("w", tuple(server_argv(llama_server_path, truncated_gguf, free_port)), port=free_port)
    with pytest.raises(LaunchError) as ei:
        launch(second, log, timeout=120)
    assert "not within the file bounds" in str(ei.value)
    assert "No such file" not in str(ei.value)
    assert log.read_text().count("# orchestrator: ") == 2


# --- stopping what does not want to stop ------------------------------------------------------------------------

def test_never_healthy_times_out_and_leaves_nothing(tmp_path, free_port):
    spec = LaunchSpec("mute", ("bash", "-c", "echo loading forever; sleep 60 & wait"), port=free_port)
    proc = start(spec, tmp_path / "mute.log")
    t0 = time.monotonic()
    with pytest.raises(LaunchError, match=r"worker mute: http://127.0.0.1:\d+/health did not answer 200 within 1.5 s "
                                          r"\(no answer\); stopped it. Last log lines: loading forever"):
        proc.wait_healthy(timeout=1.5, grace=2)
    assert time.monotonic() - t0 < 10
    assert group_members(proc.pid) == []


def test_sigterm_ignoring_command_is_killed_and_balancing_restored(tmp_path, free_port, balancing):
    fake, env = balancing
    spec = worker_spec("stubborn", ["bash", "-c", 'trap "" TERM; echo "up-$((40 + 2))"; while :; do sleep 0.1; done'],
                       disable_numa_balancing=True, env=env, port=free_port)
    proc = start(spec, tmp_path / "stubborn.log")
    try:
        wait_until(lambda: "up-42" in (tmp_path / "stubborn.log").read_text())
        assert fake.read_text().strip() == "0"
        assert len(proc.members()) >= 2
    except BaseException:
        proc.stop(grace=1)
        raise
    t0 = time.monotonic()
    rc = proc.stop(grace=1.0)
    assert 1.0 <= time.monotonic() - t0 < 15
    assert rc == -9                                        # SIGKILL after the grace period
    assert group_members(proc.pid) == []
    assert fake.read_text().strip() == "1"                 # the wrapper could not; its --cleanup did
    assert "value=1" in (tmp_path / "stubborn.log").read_text()


def test_leftovers_of_an_exited_leader_are_stopped(tmp_path, free_port):
    spec = LaunchSpec("leaky", ("bash", "-c", "sleep 60 & echo $! > " + str(tmp_path / "bg.pid")), port=free_port)
    proc = start(spec, tmp_path / "leaky.log")
    wait_until(lambda: proc.poll() is not None)
    bg = int((tmp_path / "bg.pid").read_text())
    assert proc.members() == [bg]                          # orphaned, but still in the worker's group
    assert proc.stop(grace=2) == 0
    assert group_members(proc.pid) == []
    wait_until(lambda: gone(bg) or Path(f"/proc/{bg}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z")


def test_stop_is_idempotent(tmp_path, free_port):
    proc = start(LaunchSpec("once", ("sleep", "30"), port=free_port), tmp_path / "once.log")
    assert proc.stop(grace=5) == -15
    assert proc.stop(grace=5) == -15
    assert not proc.running()


# --- reading the reason (the log texts are llama-server's, as printed by the build under test) -----------------

def test_log_cause_prefers_precise_lines(tmp_path):
    log = tmp_path / "x.log"
    log.write_text(
        "# orchestrator: 2026-01-01 starting worker w: llama-server -m m.gguf\n"
        "0.00.005.996 I srv    load_model: loading model 'm.gguf'\n"
        "0.00.006.333 E llama_model_load: error loading model: tensor 'blk.0.attn_output.weight' data is not "
        "within the file bounds, model is corrupted or incomplete\n"
        "0.00.006.343 E llama_model_load_from_file_impl: failed to load model\n"
        "0.00.006.371 E common_fit_params: encountered an error while trying to fit params to free device memory: "
        "failed to load model\n"
        "0.00.006.470 E llama_model_load: error loading model: tensor 'blk.0.attn_output.weight' data is not "
        "within the file bounds, model is corrupted or incomplete\n"
        "0.00.006.475 E srv    load_model: failed to load model, 'm.gguf'\n"
        "0.00.006.476 I srv    operator(): operator(): cleaning up before exit...\n"
        "0.00.006.749 E srv  llama_server: exiting due to model loading error\n")
    assert log_cause(log) == ("llama_model_load: error loading model: tensor 'blk.0.attn_output.weight' data is not "
                              "within the file bounds, model is corrupted or incomplete | "
                              "srv llama_server: exiting due to model loading error")


def test_log_cause_without_levels_and_without_errors(tmp_path):
    log = tmp_path / "y.log"
    log.write_text("ggml_backend_cuda_buffer_type_alloc_buffer: allocating 81920.00 MiB on device 0: "
                   "cudaMalloc failed: out of memory\nalloc_tensor_range: failed to allocate CUDA0 buffer\n")
    assert log_cause(log) == ("ggml_backend_cuda_buffer_type_alloc_buffer: allocating 81920.00 MiB on device 0: "
                              "cudaMalloc failed: out of memory | alloc_tensor_range: failed to allocate CUDA0 buffer")
    log.write_text("one\n\ntwo\nthree\nfour\n")
    assert log_cause(log) == "two | three | four"
    assert log_cause(tmp_path / "absent.log") == ""
    offset = len("one\n\ntwo\n")
    assert log_cause(log, offset) == "three | four"


def test_env_is_merged_and_dropped_names_do_not_leak(tmp_path, free_port, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7")              # as Ray sets it in an actor
    monkeypatch.setenv("KEEP_ME", "kept")
    spec = LaunchSpec("env", ("bash", "-c", 'echo "cvd=${CUDA_VISIBLE_DEVICES-unset} keep=$KEEP_ME '
                                            'min=$GGML_OP_OFFLOAD_MIN_BATCH"'),
                      env={"GGML_OP_OFFLOAD_MIN_BATCH": "64"}, port=free_port)
    proc = start(spec, tmp_path / "env.log", drop_env=("CUDA_VISIBLE_DEVICES",))
    wait_until(lambda: proc.poll() is not None)
    assert "cvd=unset keep=kept min=64" in (tmp_path / "env.log").read_text()
    assert proc.cause() == proc.failure_cause() == "cvd=unset keep=kept min=64"


def test_a_planned_worker_runs(llama_server_path, tiny_gguf, free_port, tmp_path, balancing, numactl_path):
    """planned WorkerSettings -> spec_for_worker -> start -> healthy -> stop, on the real llama-server."""
    from dataclasses import replace

    from orchestrator.backend.detect import detect_backend
    from orchestrator.launch import spec_for_worker
    from orchestrator.launch.llama_args import parse_server_args

    fake, env = balancing
    cpus = tuple(sorted(os.sched_getaffinity(0)))
    settings = replace(parse_server_args(server_argv("x", tiny_gguf, free_port)[1:]), gpus=(), numa_flag="numactl",
                       numa=NumaPolicy.bind([0], cpus=cpus, cpu_nodes=[0]), disable_numa_balancing=True)
    spec = spec_for_worker("planned", settings, detect_backend(llama_server_path), node="local", local_node="local")
    assert spec.settings == settings and spec.node is None and spec.env == {"CUDA_VISIBLE_DEVICES": ""}
    assert spec.argv[spec.argv.index("--numa") + 1] == "numactl"
    spec = replace(spec, env={**spec.env, **env})
    with launch(spec, tmp_path / "planned.log", timeout=120) as proc:
        assert completion(spec.connect_url)["tokens_predicted"] == 4
        assert fake.read_text().strip() == "0"
    assert proc.returncode == 0
    assert fake.read_text().strip() == "1"
