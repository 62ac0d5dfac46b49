"""wrap / worker_spec / script location; and the wrapped argv run for real (balancing wrapper + numactl)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from orchestrator.errors import LaunchError
from orchestrator.launch import LaunchSpec, NumaPolicy, numactl_argv, worker_spec, wrap
from orchestrator.launch import wrappers as wrap_mod
from orchestrator.paths import REPO_ROOT

BAL = str(REPO_ROOT / "scripts" / "numa" / "disable-numa-balancing.sh")


def test_scripts_come_from_the_checkout():
    assert wrap_mod.scripts_dir() == REPO_ROOT / "scripts" / "numa"
    for name in wrap_mod.SCRIPTS:
        p = Path(wrap_mod.script_path(name))
        assert p.is_file() and os.access(p, os.X_OK)
    with pytest.raises(ValueError):
        wrap_mod.script_path("rm.sh")


def test_package_data_fallback_and_clear_error(tmp_path, monkeypatch):
    """Without a checkout the scripts come from orchestrator/_data/numa; without either: a LaunchError."""
    monkeypatch.setattr(wrap_mod, "REPO_ROOT", tmp_path / "no-checkout")
    data = tmp_path / "pkg" / "orchestrator" / "_data" / "numa"
    monkeypatch.setattr(wrap_mod, "_candidates", lambda: [tmp_path / "no-checkout" / "scripts" / "numa", data])
    with pytest.raises(LaunchError, match="cannot find disable-numa-balancing.sh and numactl-bind-socket.sh"):
        wrap_mod.scripts_dir()
    data.mkdir(parents=True)
    for name in wrap_mod.SCRIPTS:
        shutil.copy(REPO_ROOT / "scripts" / "numa" / name, data / name)
    assert wrap_mod.scripts_dir() == data


@pytest.mark.parametrize("balancing,policy,expected", [
    (False, NumaPolicy.none(), ["llama-server", "-m", "m.gguf"]),
    (True, NumaPolicy.none(), [BAL, "llama-server", "-m", "m.gguf"]),
    (False, NumaPolicy.bind([0], cpus=[0, 1]),
     ["numactl", "--physcpubind=0-1", "--membind=0", "--", "llama-server", "-m", "m.gguf"]),
    (True, NumaPolicy.interleave([0, 1]),
     [BAL, "numactl", "--interleave=0-1", "--", "llama-server", "-m", "m.gguf"]),
])
def test_wrap(balancing, policy, expected):
    out = wrap(["llama-server", "-m", "m.gguf"], disable_numa_balancing=balancing, numactl=numactl_argv(policy))
    assert out == tuple(expected)
    assert isinstance(out, tuple)


def test_wrap_needs_a_command():
    with pytest.raises(ValueError):
        wrap([], disable_numa_balancing=True, numactl=[])


def test_localize_argv_swaps_only_missing_script_paths():
    foreign = "/opt/elsewhere/orchestrator/scripts/numa/disable-numa-balancing.sh"
    argv = (foreign, "numactl", "--interleave=0", "--", "/x/llama-server", "-m", "/m/scripts/numa/model.gguf")
    assert wrap_mod.localize_argv(argv) == (BAL,) + argv[1:]
    assert wrap_mod.localize_argv((BAL, "true")) == (BAL, "true")
    # a wheel's copy, installed under another prefix on the machine that planned
    wheel = "/usr/lib/python3/site-packages/orchestrator/_data/numa/numactl-bind-socket.sh"
    assert wrap_mod.localize_argv((wheel, "--socket", "0")) == (wrap_mod.script_path("numactl-bind-socket.sh"),
                                                                 "--socket", "0")


def test_the_package_data_folder_holds_the_scripts_themselves():
    """What a wheel ships under orchestrator/_data/numa is the scripts of scripts/numa, byte for byte."""
    data = REPO_ROOT / "orchestrator" / "_data" / "numa"
    for name in wrap_mod.SCRIPTS:
        assert (data / name).read_bytes() == (REPO_ROOT / "scripts" / "numa" / name).read_bytes()


def test_worker_spec():
    spec = worker_spec("s1", ["llama-server", "-m", "m.gguf", "--host", "127.0.0.1", "--port", "9001"],
                       numa=NumaPolicy.bind([1], cpus=[4, 5, 6, 7]), disable_numa_balancing=True,
                       env={"CUDA_VISIBLE_DEVICES": "0"}, port=9001, node="box2", resources={"numa_node_1": 1.0},
                       model_alias="demo")
    assert spec == LaunchSpec(
        name="s1",
        argv=(BAL, "numactl", "--physcpubind=4-7", "--membind=1", "--", "llama-server", "-m", "m.gguf",
              "--host", "127.0.0.1", "--port", "9001"),
        env={"CUDA_VISIBLE_DEVICES": "0"}, host="127.0.0.1", port=9001, node="box2",
        resources={"numa_node_1": 1.0}, model_alias="demo")
    assert LaunchSpec.from_dict(spec.to_dict()) == spec
    assert spec.shell_line().startswith("CUDA_VISIBLE_DEVICES=0 " + BAL + " numactl --physcpubind=4-7")


@pytest.mark.parametrize("argv,message", [
    (["llama-server", "--port", "9002"], "--port 9002 but the spec says 9001"),
    (["llama-server", "--host=0.0.0.0", "--port", "9001"], "--host 0.0.0.0 but the spec says 127.0.0.1"),
    ([], "empty llama-server argv"),
])
def test_worker_spec_checks(argv, message):
    with pytest.raises(ValueError, match=message):
        worker_spec("w", argv, port=9001)


def test_worker_spec_env_must_be_strings():
    with pytest.raises(TypeError, match="must be strings"):
        worker_spec("w", ["llama-server"], env={"GGML_OP_OFFLOAD_MIN_BATCH": 64})  # type: ignore[dict-item]


def test_connect_url():
    assert LaunchSpec("a", ("x",), host="0.0.0.0", port=1).connect_url == "http://127.0.0.1:1"
    assert LaunchSpec("a", ("x",), host="::", port=2).connect_url == "http://[::1]:2"
    assert LaunchSpec("a", ("x",), host="10.0.0.5", port=3).connect_url == "http://10.0.0.5:3"
    assert LaunchSpec("a", ("x",), host="fe80::1", port=4).connect_url == "http://[fe80::1]:4"


@pytest.mark.integration
def test_wrapped_argv_runs_for_real(tmp_path, numactl_path):
    """The exact argv wrap() builds, run: balancing off inside (fake file), the numactl binding in effect,
    the value restored after."""
    cpu = min(os.sched_getaffinity(0))
    node = next(int(p.name[4:]) for p in Path("/sys/devices/system/node").glob("node[0-9]*")
                if str(cpu) in _expand((p / "cpulist").read_text()))
    fake = tmp_path / "numa_balancing"
    fake.write_text("1\n")
    env = {"NUMA_BALANCING_FILE": str(fake), "NUMA_BALANCING_STATE_DIR": str(tmp_path / "state")}
    spec = worker_spec("w0", ["bash", "-c", 'echo "balancing=$(cat "$NUMA_BALANCING_FILE")"; '
                                            'grep -E "^Cpus_allowed_list" /proc/self/status; '
                                            'cut -d" " -f2 /proc/self/numa_maps | sort -u'],
                       numa=NumaPolicy.bind([node], cpus=[cpu]), disable_numa_balancing=True, env=env)
    r = subprocess.run(list(spec.argv), env={**os.environ, **spec.env}, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["balancing=0", f"Cpus_allowed_list:\t{cpu}", f"bind:{node}"]
    assert fake.read_text().strip() == "1"


def _expand(text: str) -> list[str]:
    from orchestrator.launch.numa import parse_cpulist

    return [str(c) for c in parse_cpulist(text)]


def _settings(numa, **kw):
    from orchestrator.launch.settings import WorkerSettings

    base = dict(model_path="/m/model.gguf", alias="demo", host="127.0.0.1", port=9003, gpus=(0,), numa=numa,
                numa_flag="numactl", disable_numa_balancing=True, op_offload_min_batch=128, metrics=False)
    base.update(kw)
    return WorkerSettings(**base)


def test_spec_for_a_planned_worker():
    from orchestrator.backend.info import BackendInfo
    from orchestrator.launch import spec_for_worker

    backend = BackendInfo(server="/opt/llama/bin/llama-server", features=frozenset({"numa", "fit"}))
    settings = _settings(NumaPolicy.bind([1], cpus=(16, 17, 18, 19), cpu_nodes=(1,)))
    spec = spec_for_worker("socket1", settings, backend, node="box", resources={"node:box": 0.01})
    assert spec.argv == (BAL, "numactl", "--physcpubind=16-19", "--membind=1", "--", "/opt/llama/bin/llama-server",
                         "-m", "/m/model.gguf", "--alias", "demo", "--host", "127.0.0.1", "--port", "9003",
                         "--numa", "numactl")
    assert dict(spec.env) == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "0",
                              "GGML_OP_OFFLOAD_MIN_BATCH": "128"}
    assert (spec.name, spec.node, spec.port, spec.model_alias) == ("socket1", "box", 9003, "demo")
    assert dict(spec.resources) == {"node:box": 0.01}
    assert spec.settings == settings and LaunchSpec.from_dict(spec.to_dict()) == spec
    assert spec_for_worker("socket1", settings, backend, node="box", local_node="box").node is None


@pytest.mark.parametrize("numa,prefix", [
    (NumaPolicy.none(cpus=(0, 1, 2, 3)), []),                                     # cpus listed, no numactl
    (NumaPolicy.interleave([0, 1], cpu_nodes=(0, 1)), ["numactl", "--cpunodebind=0-1", "--interleave=0-1", "--"]),
    (NumaPolicy.bind([2], cpu_nodes=(2,)), ["numactl", "--cpunodebind=2", "--membind=2", "--"]),
])
def test_numa_policy_translation(numa, prefix):
    from orchestrator.backend.info import BackendInfo
    from orchestrator.launch import spec_for_worker

    spec = spec_for_worker("w", _settings(numa, disable_numa_balancing=False), BackendInfo(server="llama-server"))
    assert list(spec.argv[: len(prefix)]) == prefix
    assert spec.argv[len(prefix)] == "llama-server"
