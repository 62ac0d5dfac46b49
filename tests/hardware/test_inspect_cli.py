"""`orchestrator inspect` and `orchestrator probe` as a user runs them: subprocesses, exit codes, no tracebacks."""

from __future__ import annotations

import json
import sys

import pytest

from .conftest import EXPECTED, REPO, SYSFS, assert_one_line_error, run_cli


def test_inspect_live_tree():
    res = run_cli("inspect")
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert out.startswith("Machine ") and "NUMANode 0" in out and "Package " in out
    assert "NUMA balancing" in out and "This process may use" in out
    assert "Traceback" not in res.stderr


def test_inspect_live_json_is_the_documented_document():
    res = run_cli("inspect", "--json")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    for key in ("schema", "packages", "cores", "pus", "smt", "numa_nodes", "gpus", "numa_balancing",
                "allowed_cpus", "allowed_nodes", "hugepages", "thp", "notes"):
        assert key in doc
    node = doc["numa_nodes"][0]
    assert {"id", "cpus", "memory_bytes", "distances"} <= set(node)
    from orchestrator.hardware import Machine

    assert Machine.from_json(doc).to_json() == doc


@pytest.mark.parametrize("name", ["32amd64-4s2n4c-cgroup2.tar.bz2", "nvidiagpunumanodes.tar.bz2",
                                  "offline-cpu0-node0.tar.bz2"])
def test_inspect_dump_json(name):
    exp = EXPECTED[name]
    res = run_cli("inspect", "--dump", str(SYSFS / name), "--json")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["summary"]["packages"] == exp["packages"] and doc["summary"]["cores"] == exp["cores"]
    assert [n["cpus"] for n in doc["numa_nodes"]] == [n["cpus"] for n in exp["nodes"]]
    assert doc["source"] == f"dump {SYSFS / name}"
    # notes go to stderr as well, one line each
    assert len([l for l in res.stderr.splitlines() if l.startswith("orchestrator inspect: note:")]) == len(doc["notes"])


def test_inspect_allowed_view_of_a_restricted_dump():
    name = "16amd64-8n2c-cpusets.tar.bz2"
    res = run_cli("inspect", "--dump", str(SYSFS / name), "--allowed", "--json")
    doc = json.loads(res.stdout)
    al = EXPECTED[name]["allowed"]
    assert doc["summary"]["pus"] == al["pus"] and doc["summary"]["numa_nodes"] == al["numa_nodes"]
    tree = run_cli("inspect", "--dump", str(SYSFS / name)).stdout
    assert "This process may use: CPUs 0-3,5-6,12-15 (10 of 15), NUMA nodes 1-4 [cpuset /dummy (/dev/cpuset)]" in tree


def test_inspect_root_and_save_round_trip(tmp_path, extracted):
    root = extracted("128arm-2pa2n8cluster4co.tar.bz2")
    out = tmp_path / "arm.tar.gz"
    a = run_cli("inspect", "--root", str(root), "--json", "--save", str(out))
    assert a.returncode == 0, a.stderr
    assert f"recorded the machine into {out}" in a.stderr
    b = run_cli("inspect", "--dump", str(out), "--json")
    da, db = json.loads(a.stdout), json.loads(b.stdout)
    da["source"] = db["source"] = da["hostname"] = db["hostname"] = None
    assert da == db
    assert "Package 36" in run_cli("inspect", "--dump", str(out)).stdout


def test_inspect_live_save_then_dump(tmp_path):
    out = tmp_path / "here.tar.gz"
    a = run_cli("inspect", "--save", str(out))
    assert a.returncode == 0 and out.is_file()
    b = run_cli("inspect", "--dump", str(out), "--json")
    assert b.returncode == 0 and json.loads(b.stdout)["summary"] == json.loads(run_cli("inspect", "--json").stdout)["summary"]


@pytest.mark.parametrize("args, needles", [
    (["--root", "/nonexistent/dir"], ["/nonexistent/dir: no such directory"]),
    (["--dump", "/nonexistent.tar.gz"], ["/nonexistent.tar.gz: no such file"]),
    (["--dump", str(REPO / "README.md")], ["README.md: not a readable tar archive"]),
    (["--root", str(REPO)], ["is not a Linux sysfs root"]),
    (["--save", "/nonexistent/dir/x.tar.gz"], ["/nonexistent/dir/x.tar.gz: directory /nonexistent/dir does not exist"]),
])
def test_inspect_bad_input_is_one_line_exit_2(args, needles):
    assert_one_line_error(run_cli("inspect", *args), "orchestrator inspect: error:", *needles)


def test_inspect_not_a_dump_tarball(tmp_path):
    import tarfile

    p = tmp_path / "notes.tar.gz"
    with tarfile.open(p, "w:gz") as tf:
        tf.add(REPO / "README.md", arcname="stuff/README.md")
    assert_one_line_error(run_cli("inspect", "--dump", str(p)), "not a machine dump: no sys/devices/system/cpu")


FAKE_NVML = '''
class NVMLError(Exception):
    pass
class NVMLError_DriverNotLoaded(NVMLError):
    pass
def nvmlInit():
    raise NVMLError_DriverNotLoaded("Driver Not Loaded")
def nvmlShutdown():
    pass
'''


def test_inspect_with_nvml_failing(tmp_path):
    """NVML installed but failing (driver not loaded): one note saying what was assumed, exit 0."""
    (tmp_path / "pynvml.py").write_text(FAKE_NVML)
    env = {"PYTHONPATH": f"{tmp_path}:{REPO}"}
    res = run_cli("inspect", "--json", env=env)
    assert res.returncode == 0 and "Traceback" not in res.stderr
    assert ("orchestrator inspect: note: NVML failed to start (NVMLError_DriverNotLoaded: Driver Not Loaded): "
            "GPUs read from sysfs") in res.stderr
    tree = run_cli("inspect", env=env).stdout
    assert "note: NVML failed to start" in tree


def test_probe_host_only_json(isolated_cache):
    res = run_cli("probe", "--host-only", "--json", "--host-bytes", "64MiB", "--reps", "1",
                  env={"ORCHESTRATOR_CACHE": str(isolated_cache)})
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["bandwidth"]["host"] and all(e["bytes_per_s"] > 1e8 for e in doc["bandwidth"]["host"])
    assert doc["cached"] is False and doc["failed"] is False
    again = json.loads(run_cli("probe", "--host-only", "--json", env={"ORCHESTRATOR_CACHE": str(isolated_cache)}).stdout)
    assert again["cached"] is True and again["bandwidth"] == doc["bandwidth"]
    # inspect shows the cached host bandwidth
    tree = run_cli("inspect", env={"ORCHESTRATOR_CACHE": str(isolated_cache)}).stdout
    assert "Host memory read bandwidth, GB/s" in tree
    text = run_cli("probe", "--host-only", env={"ORCHESTRATOR_CACHE": str(isolated_cache)}).stdout   # the cache again
    rows = text[text.index("Host memory read bandwidth, GB/s"):].splitlines()
    first = doc["bandwidth"]["host"][0]
    assert any(r.split()[:1] == [str(first["cpu_node"])] and f"{first['bytes_per_s'] / 1e9:.1f}" in r.split()
               for r in rows), text


def test_probe_without_gpu_says_so_and_exits_0(isolated_cache):
    from orchestrator.hardware import read_machine

    if read_machine("/").gpus:
        pytest.skip("this machine has GPUs")
    res = run_cli("probe", "--host-bytes", "64MiB", "--reps", "1", env={"ORCHESTRATOR_CACHE": str(isolated_cache)})
    assert res.returncode == 0, res.stderr
    assert "no GPU found: measuring host memory only" in res.stdout
    assert "Host memory read bandwidth" in res.stdout


@pytest.mark.parametrize("args, needle", [
    (["--host-bytes", "12"], "--host-bytes: at least 1 MiB"),
    (["--gpu-bytes", "lots"], "--gpu-bytes: expected a size like"),
    (["--reps", "0"], "--reps: at least 1"),
])
def test_probe_bad_arguments(args, needle, isolated_cache):
    assert_one_line_error(run_cli("probe", *args, env={"ORCHESTRATOR_CACHE": str(isolated_cache)}), needle)


def test_hardware_imports_without_heavy_packages():
    """The GPU machine's python has no gguf/pydantic/ray: discovery and the probe must not need them."""
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('gguf', 'pydantic', 'ray', 'numpy', 'yaml', 'aiohttp', 'rich', 'torch'):\n"
        "            raise ImportError('blocked ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import orchestrator.hardware, orchestrator.hardware.probe, lab.bench_probe\n"
        "import orchestrator.hardware.cudart_probe, orchestrator.hardware.render\n"
        "from orchestrator.cli import main\n"
        "sys.exit(main(['inspect', '--json']))\n"
    )
    import subprocess

    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=str(REPO),
                         env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["schema"] == "orchestrator.machine/1"
