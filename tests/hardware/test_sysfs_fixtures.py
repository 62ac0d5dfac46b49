"""Every recorded machine (hwloc's real Linux dumps) read exactly as `/` is read, compared with expected.json."""

from __future__ import annotations

import subprocess

import pytest

from orchestrator.hardware import Machine, load_dump, read_machine, save_dump
from orchestrator.hardware.render import render_tree
from orchestrator.units import format_cpulist, parse_cpulist

from .conftest import DUMPS, EXPECTED, SYSFS

KIND = {"cpu+memory": "cpu+memory", "memory-only (no CPUs)": "memory-only", "memory-less (CPUs only)": "memory-less",
        "empty (no CPUs, no memory)": "empty"}


def _kind(expected_kind: str) -> str:
    return "gpu-memory" if expected_kind.startswith("GPU memory of") else KIND[expected_kind]


def test_fixture_files_are_the_recorded_ones():
    for name in DUMPS:
        blob = subprocess.run(["git", "hash-object", str(SYSFS / name)], capture_output=True, text=True).stdout.strip()
        assert blob == EXPECTED[name]["git_blob"], name
    assert (SYSFS / "LICENSE.hwloc").is_file()


@pytest.fixture(params=DUMPS)
def dump(request, extracted):
    name = request.param
    return name, extracted(name), EXPECTED[name]


def test_sysfs_view(dump):
    name, root, exp = dump
    m = read_machine(root, nvml=False)
    # the counts, in the sysfs view (what the kernel exports, cgroups aside)
    assert len(m.packages) == exp["packages"]
    assert len(m.numa_nodes) == exp["numa_nodes"]
    assert len(m.cores) == exp["cores"]
    assert len(m.pus) == exp["pus"]
    assert m.smt == exp["smt"]
    assert m.threads_per_core == exp["threads_per_core"]
    assert format_cpulist(m.pus) == exp["online_cpus"] or set(m.pus) < set(parse_cpulist(exp["online_cpus"]))
    assert format_cpulist(m.offline_cpus) == exp["offline_cpus"]
    assert format_cpulist(m.offline_nodes) == exp["offline_nodes"]
    assert m.arch == exp["arch"]
    assert m.cpu_model == exp["cpu_model"]
    # packages by id with their CPUs (kernel ids such as 36 and 8442 kept, 0..N-1 when inconsistent)
    assert {str(p.id): format_cpulist(p.cpus) for p in m.packages} == exp["package_cpus"]
    # every core belongs to one package and the cores partition the PUs
    assert sorted(p for c in m.cores for p in c.pus) == list(m.pus)
    assert [c.index for c in m.cores] == list(range(len(m.cores)))
    for p in m.packages:
        assert sorted(q for ci in p.cores for q in m.core(ci).pus) == list(p.cpus)


def test_numa_nodes(dump):
    name, root, exp = dump
    m = read_machine(root, nvml=False)
    assert [n.id for n in m.numa_nodes] == [n["os_index"] for n in exp["nodes"]]
    for en in exp["nodes"]:
        n = m.node(en["os_index"])
        assert format_cpulist(n.cpus) == en["cpus"], n.id
        assert n.memory_bytes == en["memory_bytes"], n.id
        assert list(n.packages) == en["packages"], n.id
        assert n.kind == _kind(en["kind"]), n.id
        assert n.gpu_memory_of == en.get("gpu_memory_of"), n.id
        for c in m.cores_of_node(n.id):
            assert set(c.pus) <= set(n.cpus)
    if exp["distances"] is None:
        assert all(n.distances == () for n in m.numa_nodes)
        assert all(n.distance_to(n.id) is None for n in m.numa_nodes)
    else:
        ids = exp["distances"]["nodes"]
        assert [[m.node(a).distance_to(b) for b in ids] for a in ids] == exp["distances"]["matrix"]


def test_pci_display_and_accelerators(dump):
    """Display-class and accelerator PCI devices, with their NUMA affinity; unknown stays -1."""
    name, root, exp = dump
    m = read_machine(root, nvml=False)
    seen = {g.pci: g for g in m.gpus}
    seen.update({d.pci: d for d in m.pci_devices})
    expected = exp["gpus"] + exp["accelerators"]
    assert sorted(seen) == sorted(e["pci"] for e in expected)
    for e in expected:
        d = seen[e["pci"]]
        assert d.numa_node == e["numa_node"]
        assert format_cpulist(d.local_cpus) == e["local_cpus"]
        assert d.vendor_id == e["vendor"]
        assert d.device_id == e["device"]
    for g in m.gpus:  # the planner's GPU affinity: the node the GPU's local CPUs fall in
        exp_nodes = next(e["numa_nodes_from_local_cpus"] for e in expected if e["pci"] == g.pci)
        assert m.nearest_cpu_node(g) == (exp_nodes[0] if len(exp_nodes) == 1 else None)


def test_allowed_view(dump):
    """The CPUs and nodes this process may use (cgroup v1/v2 and legacy cpusets found through /proc/mounts)."""
    name, root, exp = dump
    m = read_machine(root, nvml=False)
    al = exp["allowed"]
    if al is None:
        assert not m.restricted
        assert m.allowed_view() == m
        return
    assert m.restricted
    assert m.cgroup == exp["cgroup"]
    assert set(m.allowed_cpus) == set(parse_cpulist(al["allowed_cpus"])) & set(m.pus)
    assert format_cpulist(m.allowed_nodes) == al["allowed_nodes"]
    v = m.allowed_view()
    assert len(v.packages) == al["packages"]
    assert len(v.numa_nodes) == al["numa_nodes"]
    assert len(v.cores) == al["cores"]
    assert len(v.pus) == al["pus"]
    assert v.smt == al["smt"] and v.threads_per_core == al["threads_per_core"]
    assert {str(n.id): format_cpulist(n.cpus) for n in v.numa_nodes} == al["nodes"]
    pk_mem = {p.id for p in v.packages} | {p for n in al["nodes"] for p in m.node(int(n)).packages}
    assert len(pk_mem) == al["packages_incl_memory_only"]


def test_json_round_trip_and_tree(dump):
    name, root, exp = dump
    m = read_machine(root, nvml=False)
    doc = m.to_json()
    assert Machine.from_json(doc) == m
    assert doc["summary"]["numa_nodes"] == exp["numa_nodes"]
    assert [n["cpus"] for n in doc["numa_nodes"]] == [n["cpus"] for n in exp["nodes"]]
    tree = render_tree(m)
    assert tree.count("NUMANode ") == exp["numa_nodes"]
    for p in m.packages:
        assert f"Package {p.id}" in tree


def test_save_then_load_gives_the_same_machine(dump, tmp_path):
    """`inspect --save` on a recorded root records exactly the files read: reading the new dump is identical."""
    name, root, exp = dump
    before = read_machine(root, nvml=False)
    out = tmp_path / "again.tar.gz"
    save_dump(out, root)
    after = load_dump(out)
    strip = lambda m: m.to_json() | {"source": "", "hostname": ""}  # noqa: E731
    assert strip(after) == strip(before)


def test_original_tarball_loads(dump):
    """load_dump extracts only what discovery reads: the machine is the same as from the full extraction."""
    name, root, exp = dump
    m = load_dump(SYSFS / name)
    assert m.source == f"dump {SYSFS / name}"
    full = read_machine(root, nvml=False)
    strip = lambda x: x.to_json() | {"source": "", "hostname": "", "notes": [n.split(": ", 1)[-1] for n in x.notes]}  # noqa: E731
    assert strip(m) == strip(full)
