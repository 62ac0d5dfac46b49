"""The bandwidth probe for real: the host memory probe is built with cc and run on this machine; the GPU
probe is built with nvcc (when present) and run against the real CUDA runtime, which says there is no device
here. Speeds are not asserted beyond "measured and plausible": targets are for bench_probe on the GPU machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest

from orchestrator.hardware import load_dump, read_machine
from orchestrator.hardware.probe import (
    build_native,
    find_cc,
    find_nvcc,
    gpu_nodes,
    host_plan,
    load_cached,
    machine_key,
    run_probe,
)
from orchestrator.hardware.topology import Gpu

from .conftest import SYSFS

SMALL = 64 << 20


@pytest.fixture(scope="module")
def live():
    return read_machine("/")


def test_host_probe_measures_every_allowed_pair_and_caches(live, isolated_cache):
    res = run_probe(live, host_bytes=SMALL, host_reps=2, gpu=False)
    assert not res.failed and not res.cached, res.messages
    mem_nodes, sets, _ = host_plan(live)
    assert set(res.bandwidth.host) == {(c, m) for c, _ in sets for m in mem_nodes}
    for (c, m), v in res.bandwidth.host.items():
        assert 1e8 < v < 1e13, (c, m, v)   # between 0.1 GB/s and 10 TB/s
    recs = [r for r in res.records if r.get("kind") == "host"]
    assert all(r["placed_node"] == r["mem_node"] for r in recs)  # the buffer really is on the node
    assert all(r["threads"] == len(dict(sets)[r["cpu_node"]]) for r in recs)
    assert res.cache_file.is_file() and res.cache_file.parent == isolated_cache / "probe"
    # a second run is the cached result, untouched
    again = run_probe(live, host_bytes=SMALL, host_reps=2, gpu=False)
    assert again.cached and again.bandwidth == res.bandwidth
    # and the live machine read by the planner carries it
    from orchestrator.hardware.probe import cached_bandwidth

    assert cached_bandwidth(live) == res.bandwidth
    assert read_machine("/").bandwidth == res.bandwidth
    fresh = run_probe(live, host_bytes=SMALL, host_reps=2, gpu=False, refresh=True)
    assert not fresh.cached and fresh.records != res.records


def test_build_is_cached_per_source_and_compiler(isolated_cache):
    cc = find_cc()
    assert cc, "a C compiler is part of this machine's setup"
    exe = build_native("membw", cc)
    mtime = exe.stat().st_mtime_ns
    assert build_native("membw", cc) == exe and exe.stat().st_mtime_ns == mtime
    out = subprocess.run([str(exe), "--mem-nodes", "999", "--set", "0:0", "--bytes", str(SMALL)],
                         capture_output=True, text=True)
    rec = json.loads(out.stdout.splitlines()[0])
    assert rec["mem_node"] == 999 and "cannot bind" in rec["error"]   # reported, not a crash
    bad = subprocess.run([str(exe), "--bogus"], capture_output=True, text=True)
    assert bad.returncode == 2 and "usage" in bad.stderr


def test_broken_compiler_is_one_clear_error(isolated_cache, tmp_path):
    from orchestrator.errors import HardwareError

    fake_cc = tmp_path / "cc"
    fake_cc.write_text("#!/bin/sh\necho 'cc: fatal error: out of cheese' >&2\nexit 1\n")
    fake_cc.chmod(0o755)
    with pytest.raises(HardwareError, match="building membw.c with .* failed \\(exit 1\\): cc: fatal error"):
        build_native("membw", str(fake_cc))
    assert not list((isolated_cache / "native").glob("*/membw"))


@pytest.mark.skipif(not find_nvcc(), reason="nvcc is not installed on this machine")
def test_gpu_probe_builds_with_nvcc_and_reports_no_device(live, isolated_cache):
    exe = build_native("pcie_bw", find_nvcc())
    out = subprocess.run([str(exe), "--node", "0:0"], capture_output=True, text=True)
    if out.returncode == 0:
        pytest.skip("a CUDA device is present: covered by test_gpu_probe_on_gpus")
    rec = json.loads(out.stdout.splitlines()[0])
    assert out.returncode == 3 and rec["kind"] == "init" and rec["error"].startswith("no CUDA device")


def _pretend_gpu(m):
    g = Gpu(index=0, name="pretend", uuid=None, pci="0000:99:00.0", vendor="nvidia", numa_node=-1,
            memory_bytes=None, memory_free_bytes=None, pcie_gen=None, pcie_width=None, pcie_gen_max=None,
            pcie_width_max=None, local_cpus=(), compute_capability=None, source="sysfs")
    return replace(m, gpus=(g,))


@pytest.mark.parametrize("backend", ["nvcc", "cudart"])
def test_gpu_probe_without_a_device_fails_cleanly(live, isolated_cache, backend):
    """The real CUDA runtime is asked (native build, or libcudart through ctypes): it finds no device here, and
    the probe says so instead of inventing numbers or crashing."""
    from orchestrator.hardware.cudart_probe import load_cudart

    if os.environ.get("CUDA_VISIBLE_DEVICES") is None and _has_cuda_device():
        pytest.skip("a CUDA device is present: covered by test_gpu_probe_on_gpus")
    if backend == "nvcc" and not find_nvcc():
        pytest.skip("nvcc is not installed on this machine")
    if backend == "cudart" and load_cudart() is None:
        pytest.skip("libcudart is not installed on this machine")
    res = run_probe(_pretend_gpu(live), host=False, gpu_backend=backend, gpu_bytes=SMALL, gpu_reps=1)
    assert res.failed and not res.bandwidth.gpu_h2d
    assert any("no CUDA device" in m for m in res.messages), res.messages
    assert not res.cache_file.exists()  # a failed probe is not cached


def _has_cuda_device() -> bool:
    from orchestrator.hardware.nvml import read_gpus

    r = read_gpus()
    return r.ok and bool(r.gpus)


def test_no_gpu_measures_host_only(live, isolated_cache):
    if live.gpus:
        pytest.skip("this machine has GPUs")
    res = run_probe(live, host_bytes=SMALL, host_reps=1)
    assert "no GPU found: measuring host memory only" in res.messages
    assert not res.failed and res.bandwidth.host and not res.bandwidth.gpu_h2d


def test_plans_on_recorded_machines():
    # cpuset allows CPUs 0-3 (node 0) but only memory nodes 2-3: threads of node 0 read nodes 2 and 3
    m = load_dump(SYSFS / "16amd64-4n4c-cgroup-distance-merge.tar.bz2")
    mem, sets, _ = host_plan(m, SMALL)
    assert mem == [2, 3] and sets == [(0, (0, 1, 2, 3))]
    assert [n for n, _ in gpu_nodes(m)] == [2, 3] and gpu_nodes(m)[0][1] == (0, 1, 2, 3)
    # SMT4 POWER9: one thread per core; GPU-memory nodes are not host buffers
    m = load_dump(SYSFS / "nvidiagpunumanodes.tar.bz2")
    mem, sets, _ = host_plan(m, SMALL)
    assert mem == [0, 8] and sets == [(0, (0, 4, 8, 12)), (8, (88, 92, 96, 100))]
    assert [n for n, _ in gpu_nodes(m)] == [0, 8]
    # CPU-less HBM/NVM nodes are measured as memory, from every CPU node
    m = load_dump(SYSFS / "fakeheteromemtiers.tar.bz2")
    mem, sets, _ = host_plan(m, SMALL)
    assert mem == [0, 1, 2, 4, 6, 8, 9] and [n for n, _ in sets] == [0, 1, 2]


def test_cache_key_follows_gpus_and_driver(live):
    k = machine_key(live)
    assert k == machine_key(read_machine("/"))
    assert machine_key(_pretend_gpu(live)) != k
    assert machine_key(replace(live, gpu_driver="999.1")) != k


def test_corrupt_cache_is_ignored(live, isolated_cache):
    from orchestrator.hardware.probe import cache_file

    p = cache_file(live)
    p.parent.mkdir(parents=True)
    p.write_text("{ not json")
    assert load_cached(live) is None


@pytest.mark.gpu
def test_gpu_probe_on_gpus(live, isolated_cache):
    """Device counterpart (lead, H200 machine): every GPU measured from every host node; full speed is checked
    by `python3 -m lab.bench_probe` (>= 95% of torch, <= 3 s per GPU)."""
    res = run_probe(live, host=False)
    assert not res.failed, res.messages
    for g in live.gpus:
        for node, _ in gpu_nodes(live):
            assert res.bandwidth.gpu_h2d[(g.index, node)] > 1e9
            assert res.bandwidth.gpu_d2h[(g.index, node)] > 1e9
    placed = [r for r in res.records if r.get("kind") == "gpu"]
    assert all(r["placed_node"] == r["node"] for r in placed)


def test_cudart_probe_runs_as_a_module_without_a_device():
    from orchestrator.hardware.cudart_probe import load_cudart

    if load_cudart() is None:
        pytest.skip("libcudart is not installed on this machine")
    if _has_cuda_device():
        pytest.skip("a CUDA device is present")
    res = subprocess.run([sys.executable, "-m", "orchestrator.hardware.cudart_probe", "--node", "0:0"],
                         capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(SYSFS.parents[2])})
    assert res.returncode == 3 and "Traceback" not in res.stderr
    assert json.loads(res.stdout)["error"].startswith("no CUDA device")


def test_bench_probe_script_runs_end_to_end(live, isolated_cache, tmp_path, monkeypatch, capsys):
    """bench_probe (what the lead runs on the H200) runs through every backend here; with a pretended GPU the
    real CUDA runtime answers "no device", and the report is still written."""
    from lab import bench_probe
    from orchestrator.hardware import sysfs

    monkeypatch.setattr(sysfs, "read_machine", lambda root="/", nvml=True: _pretend_gpu(live))
    out = tmp_path / "bench.json"
    assert bench_probe.main(["--reps", "1", "--bytes", "8MiB", "--no-torch", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "probe nvcc/register" in text and "probe cudart/hostalloc" in text
    report = json.loads(out.read_text())
    assert set(report["probe"]) == {"nvcc/register", "nvcc/hostalloc", "cudart/register", "cudart/hostalloc"}
    if not _has_cuda_device():
        assert all(r["failed"] for r in report["probe"].values())


def test_misplaced_or_unverifiable_buffers(live):
    """A buffer that landed on another node is not counted for the node it was meant for; unverifiable
    placement (move_pages refused) and first-touch placement (mbind refused in containers) are said."""
    from orchestrator.hardware.probe import ingest_gpu, ingest_host

    hostbw: dict = {}
    msgs: list[str] = []
    ingest_host([
        {"kind": "host", "cpu_node": 0, "mem_node": 1, "best_bytes_per_s": 9e9, "placed_node": 0, "placement": "first-touch"},
        {"kind": "host", "cpu_node": 0, "mem_node": 0, "best_bytes_per_s": 2e10, "placed_node": -1},
        {"kind": "host", "mem_node": 3, "error": "cannot bind 1 bytes to node 3: Invalid argument"},
    ], hostbw, msgs)
    assert hostbw == {(0, 0): 2e10}
    assert any("meant for node 1 landed on node 0 (first-touch): not counted" in m for m in msgs)
    assert any("could not be verified" in m for m in msgs)
    assert any("reading node 3: cannot bind" in m for m in msgs)
    m = _pretend_gpu(live)
    h2d: dict = {}
    d2h: dict = {}
    msgs = []
    ok = ingest_gpu(m, [{"kind": "device", "device": 0, "pci": "00000000:99:00.0", "init_seconds": 0.2},
                        {"kind": "gpu", "device": 0, "pci": "00000000:99:00.0", "node": 0, "placed_node": 0,
                         "h2d_best": 5e10, "d2h_best": 4.9e10, "placement": "first-touch"}], h2d, d2h, msgs)
    assert ok and h2d == {(0, 0): 5e10} and d2h == {(0, 0): 4.9e10}
    assert any("first touch" in m for m in msgs)


@pytest.mark.integration
def test_the_cpus_prompt_speed_is_measured_with_llama_bench_and_cached(live, isolated_cache, llama_server_path,
                                                                       monkeypatch):
    """The probe's CPU measurement (orchestrator.resolve.cpu_prompt_probe: llama-bench beside the llama-server,
    the probe's small model written into the cache): a prompt speed on one core, kept with the bandwidths, and
    the plan's CPU prompts follow it."""
    from orchestrator.plan import rates as R
    from orchestrator.resolve import cpu_prompt_probe

    monkeypatch.setenv("LLAMA_SERVER", llama_server_path)
    res = run_probe(live, host_bytes=SMALL, host_reps=1, gpu=False, cpu_prompt=cpu_prompt_probe)
    assert not res.failed, res.messages
    pp = res.bandwidth.cpu_probe_pp
    assert 10 < pp < 1e6, pp
    rec = next(r for r in res.records if r.get("kind") == "cpu_prompt")
    assert rec["argv"][0] == "llama-bench" and max(rec["samples_ts"]) == pp and "-p" in rec["argv"]
    assert any((isolated_cache / "probe").glob("cpu-probe-*.gguf"))
    assert load_cached(live).bandwidth.cpu_probe_pp == pp                    # kept in the cache, read back
    from orchestrator.plan.candidates import speed_inputs

    sp, notes = speed_inputs(replace(live, bandwidth=res.bandwidth), [], "mmap", (0,), 1)
    assert sp.cpu_rate == pytest.approx(pp / R.CPU_PROBE_REFERENCE_PP)
    assert any(n.startswith("CPU prompt speed x") for n in notes)
    # without a llama.cpp build the probe says so and measures the rest
    monkeypatch.setenv("LLAMA_SERVER", str(isolated_cache / "nope"))
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    pp, why = cpu_prompt_probe(live, [])
    assert pp == 0.0 and why
