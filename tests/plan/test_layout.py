"""How workers divide a machine (plan/layout.py) on recorded machines: replicas over NUMA nodes without overlap,
one replica per node or per socket by predicted bandwidth, and what the reason lines say."""

from __future__ import annotations

import dataclasses
import functools
from itertools import combinations

import pytest
from planfixtures import FIX, backend, machine

from orchestrator.hardware.dump import load_machine
from orchestrator.hardware.topology import Bandwidth
from orchestrator.launch.llama_args import numactl_argv
from orchestrator.plan import NodeRequest, PlanRequest, make_plan
from orchestrator.plan.layout import spread

GiB = 1 << 30


@functools.lru_cache(maxsize=None)
def recorded(name: str):
    return load_machine(FIX / "sysfs" / f"{name}.tar.bz2")


def plan_cpu(m, model, *, ram_reserve=None, **kw):
    req = PlanRequest(nodes=(NodeRequest(name="n", gpus=(), ram_reserve=ram_reserve),), **kw)
    return make_plan(machines={"n": m}, model=model, request=req, backend=backend())


def layout_of(p):
    return next(d for d in p.decisions if d.what.startswith("layout"))


def decision(w, what):
    return next(d for d in w.decisions if d.what == what)


@pytest.fixture(scope="module")
def small(model_dir):
    from planfixtures import shape_model
    return shape_model(model_dir, "qwen3-30b-a3b", "q4_0", layers=4)


MACHINES = ["32em64t-2n8c+dax+nvme+mic+dimms", "64amd64-4s2n4ca2co", "16amd64-8n2c-cpusets",
            "fakecpuid1f-64intel64-2p4d2n2c2t", "128arm-2pa2n8cluster4co"]


@pytest.mark.parametrize("name", MACHINES)
@pytest.mark.parametrize("n", [2, 3, 5, 8, 9])
def test_replicas_never_overlap_and_keep_a_core_whole(name, n):
    m = recorded(name)
    shares = spread(m, n)
    assert len(shares) == n and [s.index for s in shares] == list(range(n))
    allowed = set(m.allowed_cpus or m.pus)
    core_of = {p: c.index for c in m.cores for p in c.pus}
    for s in shares:
        assert s.cpus and set(s.cpus) <= allowed
        assert {m.node_of_cpu(c) for c in s.cpus} <= set(s.nodes)          # its CPUs are its nodes' CPUs
    if not any(s.shared for s in shares):
        for a, b in combinations(shares, 2):
            assert not set(a.cpus) & set(b.cpus), (a, b)
            assert not {core_of[c] for c in a.cpus} & {core_of[c] for c in b.cpus}   # no core split in two
    n_nodes = len({i for s in shares for i in s.nodes})
    if n <= n_nodes:                                                        # whole nodes each, none shared
        for a, b in combinations(shares, 2):
            assert not set(a.nodes) & set(b.nodes)


def test_two_replicas_on_two_sockets_get_one_node_each(small):
    m = recorded("32em64t-2n8c+dax+nvme+mic+dimms")                       # 2 sockets x 1 node x 8 cores
    p = plan_cpu(m, small, layout="machine", replicas=2)
    got = [(w.numa.mode, w.numa.cpus, w.numa.mem_nodes) for w in p.workers]
    assert got == [("bind", tuple(range(0, 8)), (0,)), ("bind", tuple(range(8, 16)), (1,))]
    assert "--numa" not in p.workers[0].args


def test_three_replicas_on_two_nodes_split_a_node_and_say_so(small):
    m = recorded("32em64t-2n8c+dax+nvme+mic+dimms")
    p = plan_cpu(m, small, layout="machine", replicas=3)
    cpus = [w.numa.cpus for w in p.workers]
    assert cpus == [(0, 1, 2, 3), (4, 5, 6, 7), tuple(range(8, 16))]
    assert [w.numa.mem_nodes for w in p.workers] == [(0,), (0,), (1,)]
    why = decision(p.workers[0], "cpus").why
    assert "own cores (no oversubscription)" in why and "share its memory" in why


def test_more_replicas_than_cores_share_cores_and_the_reason_says_so(small):
    m = machine("dev-vm.tar.gz")                                            # 1 node, 2 cores
    p = plan_cpu(m, small, layout="machine", replicas=3)
    assert [w.numa.cpus for w in p.workers] == [(0,), (1,), (0,)]
    for w in p.workers:
        why = decision(w, "cpus").why
        assert "share cores" in why and "no oversubscription" not in why
    two = plan_cpu(m, small, layout="machine", replicas=2)
    assert [w.numa.cpus for w in two.workers] == [(0,), (1,)]
    assert "no oversubscription" in decision(two.workers[0], "cpus").why


def test_numa_none_emits_no_numactl_even_for_replicas(small):
    for m in (machine("dev-vm.tar.gz"), recorded("32em64t-2n8c+dax+nvme+mic+dimms")):
        p = plan_cpu(m, small, layout="machine", replicas=2, numa="none")
        for w in p.workers:
            assert w.numa.mode == "none" and numactl_argv(w.numa) == []
            assert decision(w, "numa").value == "none"
        # the threads are still counted on each replica's own cores
        assert [int(a) for w in p.workers for a in [w.args[list(w.args).index("-t") + 1]]] == [
            len(m.physical_cpus(w.numa.cpus)) for w in p.workers]


def test_several_nodes_per_socket_one_replica_per_node_when_each_holds_the_model(small):
    m = recorded("64amd64-4s2n4ca2co")                                      # 4 sockets x 2 nodes
    p = plan_cpu(m, small, ram_reserve=2 * GiB)
    assert layout_of(p).value == "node x8"
    assert [w.numa.mem_nodes for w in p.workers] == [(i,) for i in range(8)]
    assert all(w.numa.mode == "bind" and set(w.numa.cpus) == set(m.node(w.numa.mem_nodes[0]).cpus)
               for w in p.workers)
    assert "vs" in layout_of(p).why and "one replica per socket over its nodes" in layout_of(p).why


def test_a_node_too_small_for_the_model_gives_one_replica_per_socket_over_both_nodes(small):
    m = recorded("64amd64-4s2n4ca2co")                    # node 5 has 7.7 GiB free; the default reserve is 8 GiB
    p = plan_cpu(m, small)
    assert layout_of(p).value == "socket x4"
    assert "one per node does not fit (node 5 has" in layout_of(p).why
    for w, pkg in zip(p.workers, sorted(m.packages, key=lambda p: p.id)):
        assert w.numa.mode == "interleave" and set(w.numa.mem_nodes) == set(pkg.nodes)
        assert set(w.numa.cpus) == set(pkg.cpus)


def test_measured_bandwidth_decides_between_per_node_and_per_socket(small):
    m = machine("2socket-2gpu")                                             # 2 sockets x 2 nodes
    # no measurement: remote reads estimated from the SLIT distances, slower than local -> one per node
    assert layout_of(plan_cpu(m, small)).value == "node x4"
    # measured: reads from the socket's other node as fast as local -> interleaving loses nothing, and one
    # replica per socket runs each request twice as fast: the tie goes to fewer workers
    flat = Bandwidth(host={(i, j): 50e9 for i in range(4) for j in range(4)})
    p = plan_cpu(dataclasses.replace(m, bandwidth=flat), small)
    assert layout_of(p).value == "socket x2" and "measured by the probe" in layout_of(p).why
    assert [set(w.numa.mem_nodes) for w in p.workers] == [{0, 1}, {2, 3}]


def test_explicit_socket_layout_covers_every_node_of_each_socket(small):
    m = recorded("64amd64-4s2n4ca2co")
    p = plan_cpu(m, small, layout="socket")
    assert layout_of(p).value == "socket x4"
    for w, pkg in zip(p.workers, sorted(m.packages, key=lambda p: p.id)):
        assert set(w.numa.cpus) == set(pkg.cpus) and set(w.numa.mem_nodes) == set(pkg.nodes)


def test_the_two_node_guest_runs_the_demo_replicas_one_per_node(model_dir):
    from planfixtures import shape_model
    m = machine("numa-guest.tar.gz")                                        # 2 nodes of 1.9 GiB
    p = plan_cpu(m, shape_model(model_dir, "qwen3-30b-a3b", "q4_0", layers=1), layout="machine", replicas=2)
    assert [(w.numa.cpus, w.numa.mem_nodes) for w in p.workers] == [((0,), (0,)), ((1,), (1,))]


def test_cpuset_restricted_machine_spreads_over_what_it_may_use(small):
    m = recorded("16amd64-8n2c-cpusets")                                    # CPUs 0-6,12-15, mems 1-4
    shares = spread(m, 4)
    assert {i for s in shares for i in s.nodes} <= set(m.allowed_nodes)
    assert {c for s in shares for c in s.cpus} <= set(m.allowed_cpus)


def test_gpu_workers_on_one_node_split_its_cores(model_dir):
    from planfixtures import shape_model
    m = machine("2socket-8gpu")                                             # two GPUs per NUMA node
    req = PlanRequest(nodes=(NodeRequest(name="n"),), layout="gpu-group", gpu_group_size=1)
    p = make_plan(machines={"n": m}, model=shape_model(model_dir, "qwen3-235b-a22b", "q4_0"), request=req,
                  backend=backend())
    assert len(p.workers) == 8
    for a, b in combinations(p.workers, 2):
        assert not set(a.numa.cpus) & set(b.numa.cpus), (a.name, b.name)
    for w in p.workers:
        node = m.nearest_cpu_node(m.gpu(w.gpus[0]))
        assert set(w.numa.cpus) <= set(m.node(node).cpus) and w.numa.mem_nodes == (node,)
        assert "cores split between them" in decision(w, "cpus").why


def test_socket_layout_on_one_node_gives_each_socket_its_own_cores(small):
    m = recorded("8em64t-2s2ca2c")                                          # 2 sockets, one NUMA node (UMA)
    p = plan_cpu(m, small, layout="socket")
    a, b = p.workers
    assert set(a.numa.cpus) == set(m.package(0).cpus) and set(b.numa.cpus) == set(m.package(1).cpus)
    assert not set(a.numa.cpus) & set(b.numa.cpus)


def test_one_socket_of_several_nodes_weighs_per_node_against_the_whole_socket(small):
    m = recorded("fakeheteromemtiers")      # 1 socket; CPU nodes 0-2 (2.7 GiB, 0.9, 0.5 free); 4 memory-only
    p = plan_cpu(m, small, ram_reserve=256 << 20)                           # 2 GiB with its KV cache
    lay = layout_of(p)
    assert lay.value == "socket x1" and "one per node does not fit (node 2 has" in lay.why
    (w,) = p.workers
    assert w.numa.mode == "interleave" and w.numa.mem_nodes == (0, 1, 2)    # never the HBM/NVM-only nodes
    assert set(w.numa.cpus) == set(m.pus)
