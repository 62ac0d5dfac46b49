"""The pure model: lookups, one PU per core, GPU affinity, the allowed view, JSON, errors naming the field."""

from __future__ import annotations

import ast
from dataclasses import replace
from pathlib import Path

import pytest

from orchestrator.errors import HardwareError
from orchestrator.hardware.topology import (
    SCHEMA,
    Bandwidth,
    Core,
    FrozenMap,
    Gpu,
    Machine,
    NumaNode,
    Package,
)


def gpu(index=0, numa_node=-1, local_cpus=(), peers=()):
    return Gpu(index=index, name="Test GPU", uuid=f"GPU-{index}", pci=f"0000:{index + 1:02x}:00.0", vendor="nvidia",
               numa_node=numa_node, memory_bytes=80 << 30, memory_free_bytes=79 << 30, pcie_gen=5, pcie_width=16,
               pcie_gen_max=5, pcie_width_max=16, local_cpus=tuple(local_cpus), compute_capability="9.0",
               source="nvml", peers=tuple(peers))


def two_socket(gpus=(), allowed_cpus=None, allowed_nodes=None) -> Machine:
    """2 packages x 1 node x 2 cores x 2 PUs; PUs 0-3 on socket 0 (siblings 0/2, 1/3), 4-7 on socket 1."""
    cores = (Core(0, 0, (0, 2), 0), Core(1, 0, (1, 3), 0), Core(2, 1, (4, 6), 1), Core(3, 1, (5, 7), 1))
    nodes = (NumaNode(0, (0, 1, 2, 3), 64 << 30, 60 << 30, ((0, 10), (1, 21)), (0,), "cpu+memory"),
             NumaNode(1, (4, 5, 6, 7), 64 << 30, 61 << 30, ((0, 21), (1, 10)), (1,), "cpu+memory"))
    return Machine(
        hostname="t", arch="x86_64", cpu_model="Test CPU",
        packages=(Package(0, (0, 1, 2, 3), (0, 1), (0,)), Package(1, (4, 5, 6, 7), (2, 3), (1,))),
        cores=cores, pus=tuple(range(8)), offline_cpus=(), numa_nodes=nodes, gpus=tuple(gpus),
        allowed_cpus=tuple(allowed_cpus if allowed_cpus is not None else range(8)),
        allowed_nodes=tuple(allowed_nodes if allowed_nodes is not None else (0, 1)), smt=True, threads_per_core=2,
        numa_balancing=1, thp="madvise", hugepages=(), memory_total_bytes=128 << 30,
        memory_available_bytes=120 << 30)


def test_lookups_and_distances():
    m = two_socket()
    assert m.node(1).distance_to(0) == 21 and m.node(0).distance_to(0) == 10
    assert m.node(0).distance_to(7) is None
    assert m.package(1).cores == (2, 3)
    assert [c.index for c in m.cores_of_node(1)] == [2, 3]
    assert m.node_of_cpu(6) == 1 and m.node_of_cpu(99) is None
    with pytest.raises(KeyError, match="no NUMA node 5"):
        m.node(5)
    with pytest.raises(KeyError, match="no package 9"):
        m.package(9)


def test_physical_cpus_gives_one_pu_per_core_in_core_order():
    m = two_socket()
    assert m.physical_cpus(range(8)) == (0, 1, 4, 5)
    assert m.physical_cpus([2, 3, 6]) == (2, 3, 6)      # the sibling stands in when the first PU is not given
    assert m.physical_cpus([]) == ()


def test_nearest_cpu_node():
    m = two_socket(gpus=[gpu(0, numa_node=1), gpu(1, local_cpus=range(4)), gpu(2, local_cpus=range(8)), gpu(3)])
    assert m.nearest_cpu_node(m.gpu(0)) == 1          # the GPU's own numa_node
    assert m.nearest_cpu_node(m.gpu(1)) == 0          # numa_node -1: from local_cpus
    assert m.nearest_cpu_node(m.gpu(2)) is None       # local to every CPU: unknown, never invented
    assert m.nearest_cpu_node(m.gpu(3)) is None
    one_node = replace(m, numa_nodes=(replace(m.node(0), cpus=tuple(range(8))),))
    assert one_node.nearest_cpu_node(one_node.gpu(3)) == 0


def test_allowed_view_keeps_ids_and_drops_what_is_not_allowed():
    m = two_socket(allowed_cpus=[2, 4, 5], allowed_nodes=[1])
    assert m.restricted
    v = m.allowed_view()
    assert v.pus == (2, 4, 5) and v.allowed_cpus == (2, 4, 5)
    assert [(c.index, c.pus) for c in v.cores] == [(0, (2,)), (2, (4,)), (3, (5,))]
    assert [p.id for p in v.packages] == [0, 1]
    assert [n.id for n in v.numa_nodes] == [1] and v.node(1).cpus == (4, 5)
    assert v.cores[0].node is None                     # its node is not allowed
    assert not v.smt and v.threads_per_core == 1
    assert not two_socket().restricted


def test_machine_is_hashable_and_json_round_trips():
    bw = Bandwidth(gpu_h2d={(0, 0): 50e9, (0, 1): 40e9}, gpu_d2h={(0, 0): 49e9, (0, 1): 39e9},
                   host={(0, 0): 120e9, (0, 1): 60e9, (1, 0): 61e9, (1, 1): 119e9}, measured_at="now", key="k")
    m = two_socket(gpus=[gpu(0, numa_node=0, peers=[(1, "nvlink")]), gpu(1, numa_node=1, peers=[(0, "nvlink")])])
    m = m.with_bandwidth(bw)
    assert hash(m) == hash(Machine.from_json(m.to_json()))
    assert Machine.from_json(m.to_json()) == m
    assert m.bandwidth.gpu_h2d[(0, 1)] == 40e9
    assert m.bandwidth.best_node_for_gpu(0) == 0 and m.bandwidth.best_node_for_gpu(7) is None
    doc = m.to_json()
    assert doc["schema"] == SCHEMA
    assert doc["numa_nodes"][0]["cpus"] == "0-3" and doc["numa_nodes"][1]["distances"] == {"0": 21, "1": 10}
    assert doc["gpus"][0]["nearest_cpu_node"] == 0 and doc["gpus"][1]["peers"] == [{"gpu": 0, "link": "nvlink"}]
    assert m.gpu(0).link_to(1) == "nvlink" and m.gpu(0).link_to(5) is None


def test_frozenmap():
    a = FrozenMap({(0, 1): 2.0})
    assert a == {(0, 1): 2.0} and hash(a) == hash(FrozenMap([((0, 1), 2.0)]))
    with pytest.raises(TypeError):
        a[(0, 1)] = 3.0  # type: ignore[index]


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.update(schema="other/1"), "field 'schema' is 'other/1'"),
    (lambda d: d.pop("pus"), "missing field 'pus'"),
    (lambda d: d.update(smt="yes"), "field 'smt' must be true or false"),
    (lambda d: d["numa_nodes"][1].update(cpus="4-x"), "numa_nodes[1]: field 'cpus' must be a list string"),
    (lambda d: d["numa_nodes"][0].update(kind="weird"), "field 'kind' must be one of"),
    (lambda d: d["numa_nodes"][0].update(distances={"a": 1}), "field 'distances' must be an object like"),
    (lambda d: d["gpus"][0].update(memory_bytes="80GB"), "gpus[0]: field 'memory_bytes' must be an integer or null"),
    (lambda d: d.update(bandwidth={"host": [{"cpu_node": 0}]}), "bandwidth: host[0]: missing field 'mem_node'"),
])
def test_from_json_errors_name_the_field(mutate, message):
    doc = two_socket(gpus=[gpu(0)]).to_json()
    mutate(doc)
    with pytest.raises(HardwareError) as ei:
        Machine.from_json(doc, where="m.json")
    assert message in str(ei.value) and str(ei.value).startswith("m.json")


def test_topology_module_is_pure():
    """No I/O in the model: it imports nothing that touches files, processes or the clock."""
    src = Path(__file__).resolve().parents[2] / "orchestrator" / "hardware" / "topology.py"
    tree = ast.parse(src.read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not imported & {"os", "subprocess", "pathlib", "time", "shutil", "socket", "io", "tarfile"}
    assert "open(" not in src.read_text()


def test_tree_puts_gpus_under_their_node_with_link_and_bandwidth():
    from orchestrator.hardware.render import render_tree

    bw = Bandwidth(gpu_h2d={(0, 0): 52.3e9, (0, 1): 40.0e9, (1, 1): 51.0e9}, gpu_d2h={(0, 0): 50e9, (0, 1): 39e9,
                   (1, 1): 49.5e9}, host={(0, 0): 120e9, (0, 1): 60e9}, measured_at="2026-11-29T12:00:00", key="k")
    m = two_socket(gpus=[gpu(0, numa_node=0, peers=[(1, "nvlink")]), gpu(1, numa_node=1, peers=[(0, "nvlink")]),
                         gpu(2, local_cpus=range(8))]).with_bandwidth(bw)
    lines = render_tree(m).splitlines()
    # (depth in the tree, label): the tree's guides are 4 characters per level
    tree = [((len(l) - len(l.lstrip("│├└─ "))) // 4, l.lstrip("│├└─ ")) for l in lines]
    node0 = tree.index((2, "NUMANode 0: 64.0 GiB (60.0 GiB free), CPUs 0-3"))
    node1 = tree.index((2, "NUMANode 1: 64.0 GiB (61.0 GiB free), CPUs 4-7"))
    g0 = next(i for i, (_, t) in enumerate(tree) if t.startswith("GPU 0:"))
    g1 = next(i for i, (_, t) in enumerate(tree) if t.startswith("GPU 1:"))
    assert node0 < g0 < node1 < g1 and tree[g0][0] == tree[g1][0] == 3           # under their node
    assert tree[node0 - 1] == (1, "Package 0: 2 cores, PUs 0-3")
    assert "PCIe 5 x16, sm 9.0, H2D 52.3 GB/s, D2H 50.0 GB/s from node 0" in lines[g0]
    assert "H2D 51.0 GB/s, D2H 49.5 GB/s from node 1" in lines[g1]
    assert any(d == 1 and t.startswith("GPU 2:") and t.endswith("NUMA node unknown") for d, t in tree)
    assert "GPU links: 0-1 nvlink" in lines
    assert (3, "cores 0-1: 2 x 2 PUs (PUs 0-3)") in tree
    assert any("NUMA balancing ON (1)" in l for l in lines)
    bw_rows = lines[lines.index("Host memory read bandwidth, GB/s (row: CPUs of node, column: memory of node):"):]
    assert any(l.split() == ["0", "120.0", "60.0"] for l in bw_rows)
