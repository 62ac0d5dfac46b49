"""The live machine, checked against independent tools: numactl (libnuma), lscpu, the kernel's affinity."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

from orchestrator.hardware import read_machine
from orchestrator.hardware.libnuma import live_info
from orchestrator.hardware.nvml import read_gpus


def _nvml_gpus() -> int:
    res = read_gpus()
    return len(res.gpus) if res.ok else 0


HAS_GPU = _nvml_gpus() > 0


@pytest.fixture(scope="module")
def live():
    return read_machine("/")


def test_affinity_and_online_cpus(live):
    assert set(live.allowed_cpus) == os.sched_getaffinity(0) & set(live.pus)
    assert len(live.pus) == os.sysconf("SC_NPROCESSORS_ONLN")
    assert live.source == "live /"
    assert live.arch == os.uname().machine
    assert live.hostname == os.uname().nodename


def test_matches_numactl_hardware(live, numactl_path):
    out = subprocess.run([numactl_path, "--hardware"], capture_output=True, text=True, check=True).stdout
    nodes = {int(m.group(1)): [int(c) for c in m.group(2).split()]
             for m in re.finditer(r"^node (\d+) cpus:(.*)$", out, re.M)}
    assert sorted(nodes) == [n.id for n in live.numa_nodes if n.id in live.allowed_nodes]
    for nid, cpus in nodes.items():
        assert set(cpus) & set(live.pus) == set(live.node(nid).cpus)
    sizes = {int(m.group(1)): int(m.group(2)) for m in re.finditer(r"^node (\d+) size: (\d+) MB$", out, re.M)}
    for nid, mb in sizes.items():
        assert abs(live.node(nid).memory_bytes / 2**20 - mb) <= 64  # numactl reads the same meminfo, later
    rows = re.search(r"node distances:\nnode\s+([\d\s]+)\n((?:\s*\d+:.*\n?)+)", out)
    ids = [int(x) for x in rows.group(1).split()]
    for line in rows.group(2).strip().splitlines():
        a, vals = line.split(":")
        for b, d in zip(ids, vals.split()):
            assert live.node(int(a)).distance_to(b) == int(d)


@pytest.mark.skipif(not shutil.which("lscpu"), reason="lscpu (util-linux) is not installed")
def test_matches_lscpu(live):
    out = subprocess.run(["lscpu", "-p=CPU,CORE,SOCKET,NODE"], capture_output=True, text=True, check=True).stdout
    rows = [tuple(int(x) if x else -1 for x in l.split(",")) for l in out.splitlines() if not l.startswith("#")]
    online = set(live.pus)
    rows = [r for r in rows if r[0] in online]
    assert len({r[2] for r in rows}) == len(live.packages)
    assert len({(r[2], r[1]) for r in rows}) == len(live.cores)
    for cpu, _core, _sock, node in rows:
        if node >= 0:
            assert cpu in live.node(node).cpus


def test_memory_settings(live):
    nb = "/proc/sys/kernel/numa_balancing"
    assert live.numa_balancing == (int(open(nb).read()) if os.path.exists(nb) else None)
    thp = "/sys/kernel/mm/transparent_hugepage/enabled"
    if os.path.exists(thp):
        assert f"[{live.thp}]" in open(thp).read()
    meminfo = open("/proc/meminfo").read()
    total = int(re.search(r"^MemTotal:\s+(\d+) kB", meminfo, re.M).group(1)) * 1024
    assert live.memory_total_bytes == total
    size = int(re.search(r"^Hugepagesize:\s+(\d+) kB", meminfo, re.M).group(1)) * 1024
    assert any(h.page_bytes == size and h.node is None for h in live.hugepages)


def test_py_libnuma_agrees_with_sysfs(live):
    info = live_info([n.id for n in live.numa_nodes])
    assert info.error is None, info.error   # py-libnuma works here: a broken one would be reported in the notes
    assert info.available
    assert set(info.mems_allowed) >= set(live.allowed_nodes)
    for n in live.numa_nodes:
        assert abs(info.total[n.id] - n.memory_bytes) <= 64 << 20


def test_gpus_match_nvml_presence(live):
    res = read_gpus()
    if HAS_GPU:
        assert res.ok and len(live.gpus) == len(res.gpus) and all(g.source == "nvml" for g in live.gpus)
    else:
        assert live.gpus == () or all(g.source == "sysfs" for g in live.gpus)
        assert res.gpus == ()
        assert not any("NVML" in n for n in live.notes)  # no driver at all is not worth a note


@pytest.mark.gpu
def test_live_gpus_through_nvml(live):
    """Device counterpart: on the GPU machine, every GPU comes from NVML with memory, link and NUMA facts."""
    assert live.gpus and live.gpu_driver
    for g in live.gpus:
        assert g.source == "nvml" and g.uuid and g.memory_bytes and g.memory_bytes > (1 << 30)
        assert g.pcie_gen and g.pcie_width and g.compute_capability
        assert os.path.isdir(f"/sys/bus/pci/devices/{g.pci}")
        if g.numa_node >= 0:
            assert live.nearest_cpu_node(g) == g.numa_node
