"""scripts/numa/numactl-bind-socket.sh: dry runs on recorded multi-socket machines (exact argv), errors, and real
numactl runs on this machine (the binding shows in /proc/self/status)."""

from __future__ import annotations

import os
import shlex
import subprocess
import time
from pathlib import Path

import pytest

from orchestrator.launch.numa import format_cpulist, parse_cpulist

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
BIND = REPO / "scripts" / "numa" / "numactl-bind-socket.sh"


def run(args, env=None, timeout=60):
    return subprocess.run([str(BIND), *map(str, args)], env={**os.environ, **(env or {})}, capture_output=True,
                          text=True, timeout=timeout)


def evens(lo, hi):
    return ",".join(str(c) for c in range(lo, hi + 1, 2))


# (dump, socket, mode, interleave, expected numactl options). Derived from the dumps' package_cpus / nodes in
# /work/shared/fixtures/sysfs/expected.json and their thread-sibling files, not from the script.
CASES = [
    # 2 sockets x 2 nodes, package ids 36/8442, no SMT: physical == all
    ("128arm-2pa2n8cluster4co", 36, "physical", "off", ["--physcpubind=0-63", "--membind=0-1"]),
    ("128arm-2pa2n8cluster4co", 8442, "all", "off", ["--physcpubind=64-127", "--membind=2-3"]),
    ("128arm-2pa2n8cluster4co", 8442, "all", "on", ["--physcpubind=64-127", "--interleave=2-3"]),
    # 2 sockets (ids 0 and 8), SMT4; GPU-memory nodes 250-255 have no CPUs and are never chosen
    ("nvidiagpunumanodes", 0, "physical", "off", ["--physcpubind=0,4,8,12", "--membind=0"]),
    ("nvidiagpunumanodes", 8, "all", "off", ["--physcpubind=88-103", "--membind=8"]),
    ("nvidiagpunumanodes", 8, "physical", "on", ["--physcpubind=88,92,96,100", "--interleave=8"]),
    # 4 nodes per socket, SMT2 with siblings (2k, 2k+1)
    ("fakecpuid1f-64intel64-2p4d2n2c2t", 1, "physical", "off", [f"--physcpubind={evens(16, 30)}", "--membind=4-7"]),
    ("fakecpuid1f-64intel64-2p4d2n2c2t", 3, "all", "on", ["--physcpubind=48-63", "--interleave=12-15"]),
    # 2 nodes per socket, siblings only in thread_siblings_list, memory list in has_normal_memory
    ("64amd64-4s2n4ca2co", 2, "physical", "off", [f"--physcpubind={evens(32, 46)}", "--membind=4-5"]),
    ("64amd64-4s2n4ca2co", 0, "all", "off", ["--physcpubind=0-15", "--membind=0-1"]),
    # 2 sockets per node, siblings k and k+4 given only as hex masks
    ("64fake-4n2s2ca2c2t", 0, "physical", "off", ["--physcpubind=0-3", "--membind=0"]),
    ("64fake-4n2s2ca2c2t", 1, "all", "off", ["--physcpubind=8-15", "--membind=0"]),
    ("64fake-4n2s2ca2c2t", 7, "physical", "on", ["--physcpubind=56-59", "--interleave=3"]),
    # offline CPUs 0-3 and 21-23: node 1's cpulist names offline CPUs that must not appear
    ("offline-cpu0-node0", 1, "all", "off", [f"--physcpubind={','.join(str(c) for c in range(5, 20, 2))}",
                                             "--membind=1"]),
]


@pytest.mark.parametrize("dump,socket,mode,interleave,expected", CASES,
                         ids=[f"{c[0]}-s{c[1]}-{c[2]}-il{c[3]}" for c in CASES])
def test_dry_run_argv_on_recorded_machines(sysfs_dump, dump, socket, mode, interleave, expected):
    r = run(["--socket", socket, "--mode", mode, "--interleave", interleave, "--dry-run", "--",
             "llama-server", "-m", "model file.gguf", "--threads", "8"], env={"SYSFS_ROOT": sysfs_dump(dump)})
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""
    assert shlex.split(r.stdout) == ["numactl", *expected, "--", "llama-server", "-m", "model file.gguf",
                                     "--threads", "8"]


def test_option_forms_and_numactl_override(sysfs_dump):
    r = run(["--socket=8", "--mode=physical", "--interleave=on", "--dry-run", "echo", "hi"],
            env={"SYSFS_ROOT": sysfs_dump("nvidiagpunumanodes"), "NUMACTL": "/opt/x/numactl"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["/opt/x/numactl", "--physcpubind=88,92,96,100", "--interleave=8", "--",
                                "echo", "hi"]


@pytest.mark.parametrize("args,env,message", [
    (["--socket", "0", "--mode", "physical", "--dry-run", "true"], "128arm-2pa2n8cluster4co",
     "socket 0 not found in {sys} (sockets: 36 8442)"),
    (["--socket", "0", "--mode", "all", "--dry-run", "true"], "offline-cpu0-node0",
     "socket 0: none of its CPUs (4,6,8,10,12,14,16,18,20) is in an online NUMA node with memory in "
     "{sys}/devices/system/node"),
    (["--socket", "0", "--mode", "cores", "true"], None, "--mode must be 'physical' or 'all', got 'cores'"),
    (["--socket", "0", "true"], None, "--mode must be 'physical' or 'all', got ''"),
    (["--mode", "all", "true"], None, "--socket ID is required (try --help)"),
    (["--socket", "zero", "--mode", "all", "true"], None, "--socket must be a socket id (an integer), got 'zero'"),
    (["--socket", "0", "--mode", "all", "--interleave", "yes", "true"], None,
     "--interleave must be 'on' or 'off', got 'yes'"),
    (["--socket", "0", "--mode", "all"], None, "no command given"),
    (["--socket", "0", "--mode", "all", "--bogus", "true"], None, "unknown option '--bogus' (try --help)"),
    (["--socket"], None, "--socket needs a value"),
])
def test_errors_are_one_line_and_exit_2(sysfs_dump, args, env, message):
    e = {"SYSFS_ROOT": str(sysfs_dump(env))} if env else {}
    r = run(args, env=e)
    assert r.returncode == 2
    assert r.stdout == ""
    assert r.stderr.count("\n") == 1
    expected = message.format(sys=e.get("SYSFS_ROOT", "/sys"))
    assert r.stderr.startswith("numactl-bind-socket.sh: ")
    assert expected in r.stderr


def test_missing_numactl_is_an_error(tmp_path):
    r = run(["--socket", _live_socket(), "--mode", "all", "--", "true"], env={"NUMACTL": str(tmp_path / "nope")})
    assert r.returncode == 2
    assert r.stderr.strip() == (f"numactl-bind-socket.sh: numactl not found ('{tmp_path / 'nope'}'): "
                                "install the numactl package or set NUMACTL")


def test_help():
    r = run(["--help"])
    assert r.returncode == 0
    assert "--socket ID" in r.stdout and "SYSFS_ROOT" in r.stdout and "--dry-run" in r.stdout


# --- real numactl on this machine ---------------------------------------------------------------------------

def _live_socket() -> str:
    return Path(f"/sys/devices/system/cpu/cpu{min(os.sched_getaffinity(0))}/topology/physical_package_id") \
        .read_text().strip()


def _status_lists(text: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    fields = dict(line.split(":\t", 1) for line in text.splitlines() if ":\t" in line)
    return parse_cpulist(fields["Cpus_allowed_list"]), parse_cpulist(fields["Mems_allowed_list"])


def _live_expectation(socket: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """One thread per core of ``socket`` and its nodes, read from /sys by Python (independently of the script)."""
    cpu_root = Path("/sys/devices/system/cpu")
    online = parse_cpulist((cpu_root / "online").read_text())
    mine = [c for c in online
            if (cpu_root / f"cpu{c}/topology/physical_package_id").read_text().strip() == socket]
    seen, physical = set(), []
    for c in mine:
        topo = cpu_root / f"cpu{c}/topology"
        sib_file = topo / "core_cpus_list" if (topo / "core_cpus_list").exists() else topo / "thread_siblings_list"
        key = parse_cpulist(sib_file.read_text())
        if key not in seen:
            seen.add(key)
            physical.append(c)
    node_root = Path("/sys/devices/system/node")
    nodes = tuple(n for n in parse_cpulist((node_root / "has_memory").read_text())
                  if set(parse_cpulist((node_root / f"node{n}/cpulist").read_text())) & set(mine))
    return tuple(physical), nodes


def test_real_bind_physical_on_this_machine(numactl_path):
    socket = _live_socket()
    r = run(["--socket", socket, "--mode", "physical", "--", "cat", "/proc/self/status"])
    assert r.returncode == 0, r.stderr
    cpus, mems = _status_lists(r.stdout)
    exp_cpus, exp_nodes = _live_expectation(socket)
    assert cpus == exp_cpus
    assert set(exp_nodes) <= set(mems)           # the cpuset's nodes; the binding itself shows in numa_maps:
    r = run(["--socket", socket, "--mode", "physical", "--", "cat", "/proc/self/numa_maps"])
    assert {line.split()[1] for line in r.stdout.splitlines()} == {f"bind:{format_cpulist(exp_nodes)}"}


def test_real_interleave_on_this_machine(numactl_path):
    socket = _live_socket()
    r = run(["--socket", socket, "--mode", "all", "--interleave", "on", "--", "cat", "/proc/self/numa_maps"])
    assert r.returncode == 0, r.stderr
    _cpus, nodes = _live_expectation(socket)
    # every mapping of the process follows the interleave policy
    policies = {line.split()[1] for line in r.stdout.splitlines()}
    assert policies == {f"interleave:{format_cpulist(nodes)}"}


def _fake_sysfs(root: Path, cpus: list[int], package: dict[int, int], siblings: dict[int, str], node_cpus: str):
    cpu_root = root / "devices/system/cpu"
    cpu_root.mkdir(parents=True)
    (cpu_root / "online").write_text(format_cpulist(cpus) + "\n")
    for c in cpus:
        t = cpu_root / f"cpu{c}/topology"
        t.mkdir(parents=True)
        (t / "physical_package_id").write_text(f"{package[c]}\n")
        (t / "thread_siblings_list").write_text(siblings[c] + "\n")
    node = root / "devices/system/node"
    (node / "node0").mkdir(parents=True)
    (node / "online").write_text("0\n")
    (node / "has_memory").write_text("0\n")
    (node / "node0/cpulist").write_text(node_cpus + "\n")
    return root


def _two_allowed_cpus() -> list[int]:
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two usable CPUs to see a binding narrow the CPU set")
    return cpus[:2]


def test_real_bind_second_socket_of_a_described_machine(tmp_path, numactl_path):
    """The same real numactl, with sysfs describing this machine's first two CPUs as two sockets."""
    a, b = _two_allowed_cpus()
    sysfs = _fake_sysfs(tmp_path / "sys", [a, b], {a: 0, b: 1}, {a: str(a), b: str(b)}, format_cpulist([a, b]))
    r = run(["--socket", "1", "--mode", "all", "--", "cat", "/proc/self/status"], env={"SYSFS_ROOT": sysfs})
    assert r.returncode == 0, r.stderr
    assert _status_lists(r.stdout) == ((b,), (0,))


def test_real_physical_keeps_one_thread_per_core(tmp_path, numactl_path):
    """Two CPUs described as the two threads of one core: physical keeps the first, all keeps both."""
    a, b = _two_allowed_cpus()
    both = format_cpulist([a, b])
    sysfs = _fake_sysfs(tmp_path / "sys", [a, b], {a: 0, b: 0}, {a: both, b: both}, both)
    r = run(["--socket", "0", "--mode", "physical", "--", "cat", "/proc/self/status"], env={"SYSFS_ROOT": sysfs})
    assert r.returncode == 0, r.stderr
    assert _status_lists(r.stdout)[0] == (a,)
    r = run(["--socket", "0", "--mode", "all", "--", "cat", "/proc/self/status"], env={"SYSFS_ROOT": sysfs})
    assert _status_lists(r.stdout)[0] == (a, b)


def test_live_binding_stays_inside_the_callers_affinity(numactl_path):
    """Under taskset (as inside a container's cpuset) only the allowed CPUs of the socket are used; numactl
    would otherwise refuse the others."""
    socket = _live_socket()
    last = max(os.sched_getaffinity(0))
    r = subprocess.run(["taskset", "-c", str(last), str(BIND), "--socket", socket, "--mode", "all", "--", "cat",
                        "/proc/self/status"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert _status_lists(r.stdout)[0] == (last,)


def test_exec_leaves_only_the_command_so_signals_reach_it(numactl_path):
    """The script execs numactl, which execs the command: the pid we started *is* the command."""
    p = subprocess.Popen([str(BIND), "--socket", _live_socket(), "--mode", "all", "--", "sleep", "30"],
                         start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while Path(f"/proc/{p.pid}/comm").read_text().strip() != "sleep":
            assert time.monotonic() < deadline, "the command never replaced the script"
            time.sleep(0.02)
        os.kill(p.pid, 15)
        assert p.wait(timeout=10) == -15
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()

