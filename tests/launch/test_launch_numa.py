"""NumaPolicy and numactl_argv: pure."""

from __future__ import annotations

import pytest

from orchestrator.launch.llama_args import numactl_argv
from orchestrator.launch.numa import NumaPolicy, format_cpulist, parse_cpulist


@pytest.mark.parametrize("text,values", [
    ("0-3,8,10-11", (0, 1, 2, 3, 8, 10, 11)),
    ("5", (5,)),
    ("", ()),
    ("0-1\n", (0, 1)),
    ("3,1,2,2", (1, 2, 3)),
])
def test_parse_cpulist(text, values):
    assert parse_cpulist(text) == values


@pytest.mark.parametrize("bad", ["a", "1-", "3-1", "1-2-3", "-1"])
def test_parse_cpulist_rejects(bad):
    with pytest.raises(ValueError, match="CPU/node list"):
        parse_cpulist(bad)


@pytest.mark.parametrize("values,text", [
    ([0, 1, 2, 3, 8, 10, 11], "0-3,8,10-11"),
    ([7], "7"),
    ([], ""),
    ([3, 1, 2, 2, 9], "1-3,9"),
    (range(0, 16, 2), "0,2,4,6,8,10,12,14"),
])
def test_format_cpulist(values, text):
    assert format_cpulist(values) == text
    assert parse_cpulist(text) == tuple(sorted(set(values)))


def test_policy_is_normalised_and_frozen():
    a = NumaPolicy("bind", cpus=(3, 1, 2, 1), cpu_nodes=(), mem_nodes=[1, 0])
    assert a.cpus == (1, 2, 3) and a.mem_nodes == (0, 1)
    assert a == NumaPolicy.bind([0, 1], cpus=[1, 2, 3])
    assert hash(a) == hash(NumaPolicy.bind([0, 1], cpus=[1, 2, 3]))
    with pytest.raises(AttributeError):
        a.mode = "none"  # type: ignore[misc]


@pytest.mark.parametrize("kwargs,message", [
    (dict(mode="spread"), "mode must be one of bind, interleave, none"),
    (dict(mode="none", mem_nodes=(0,)), "takes no cpu_nodes or mem_nodes"),
    (dict(mode="bind", cpus=(0,)), "needs mem_nodes"),
    (dict(mode="bind", mem_nodes=(0,)), "needs cpus or cpu_nodes"),
    (dict(mode="interleave"), "needs mem_nodes"),
    (dict(mode="bind", cpus=(-1,), mem_nodes=(0,)), ">= 0"),
])
def test_policy_rejects_inconsistent_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        NumaPolicy(**kwargs)


def test_policy_rejects_strings_and_bools():
    with pytest.raises(TypeError, match="parse_cpulist"):
        NumaPolicy("bind", cpus="0-3", mem_nodes=(0,))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="expected ints"):
        NumaPolicy("bind", cpus=(True,), mem_nodes=(0,))


@pytest.mark.parametrize("policy,argv", [
    (NumaPolicy.none(), []),
    (NumaPolicy.bind([0, 1], cpus=range(0, 32, 2)),
     ["numactl", "--physcpubind=" + ",".join(str(c) for c in range(0, 32, 2)), "--membind=0-1"]),
    (NumaPolicy.bind([2, 3], cpu_nodes=[2, 3]), ["numactl", "--cpunodebind=2-3", "--membind=2-3"]),
    # both given: physcpubind only (numactl would apply both in turn, the last one winning)
    (NumaPolicy.bind([1], cpus=[8, 9], cpu_nodes=[1]), ["numactl", "--physcpubind=8-9", "--membind=1"]),
    (NumaPolicy.interleave([0, 1, 2, 3]), ["numactl", "--interleave=0-3"]),
    (NumaPolicy.interleave([0, 1], cpus=[0, 1, 2, 3]), ["numactl", "--physcpubind=0-3", "--interleave=0-1"]),
    (NumaPolicy.interleave([4, 6], cpu_nodes=[4, 6]), ["numactl", "--cpunodebind=4,6", "--interleave=4,6"]),
])
def test_numactl_argv(policy, argv):
    assert numactl_argv(policy) == argv


def test_numactl_argv_custom_binary():
    assert numactl_argv(NumaPolicy.interleave([0]), "/usr/bin/numactl") == ["/usr/bin/numactl", "--interleave=0"]


def test_describe_and_round_trip():
    p = NumaPolicy.bind([0, 1], cpus=[0, 1, 2, 3, 8])
    assert p.describe() == "bind cpus 0-3,8 mem 0-1"
    assert NumaPolicy.interleave([0, 1]).describe() == "interleave mem 0-1"
    assert NumaPolicy.bind([1], cpu_nodes=[1]).describe() == "bind cpu nodes 1 mem 1"
    assert NumaPolicy.none().describe() == "none"
    assert NumaPolicy.from_dict(p.to_dict()) == p
    assert p.n_cpus == 5 and NumaPolicy.interleave([0]).n_cpus is None


def test_planner_can_import_the_policy_without_side_effect_modules():
    """plan/ imports NumaPolicy: that import must not pull in subprocess, socket, time or ray."""
    import subprocess
    import sys

    code = ("import sys; before = set(sys.modules); import orchestrator.launch.numa; "
            "print(sorted(m for m in set(sys.modules) - before if m.split('.')[0] in "
            "('subprocess', 'socket', 'time', 'ray', 'http') or m == 'orchestrator.launch.process'))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"
