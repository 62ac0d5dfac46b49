"""On a real kernel with two NUMA nodes (the QEMU guest of numa_guest.py): what orchestrator reads, what its NUMA
wrappers do to the kernel's setting and to real processes, and where the plan's workers really run.

Each test boots the guest once (about 20 s to the first command under TCG on a 2-core host) and runs one check
of guest_checks.py inside; the durations measured are in tests/vm/README.md."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from orchestrator.units import parse_cpulist

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PY = sys.executable
REPO = Path(__file__).resolve().parents[2]


def last_json(out: str) -> dict:
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    assert lines, f"no JSON report in the guest's output:\n{out[-3000:]}"
    return json.loads(lines[-1])


def test_guest_returns_the_command_status_and_is_bounded_in_time(guest):
    rc, out, _ = guest(["bash", "-c", "cat /sys/devices/system/node/online; exit 7"], timeout=180)
    assert rc == 7 and "0-1" in out.splitlines()
    rc, out, took = guest(["sleep", "1000"], timeout=40)
    assert rc == 124 and took < 60


def test_a_boot_that_does_not_reach_its_command_is_booted_again_once(guest):
    # no boot reaches the command within 1 s under TCG: two boots, each cut at its limit, and the command never ran
    rc, out, took = guest(["bash", "-c", "echo the command ran"], timeout=60, boot_timeout=1)
    assert rc == 124 and "the command ran" not in out, out[-3000:]
    stalls = [ln for ln in out.splitlines() if "did not start its command" in ln]
    assert len(stalls) == 2 and stalls[0].endswith("booting again") and stalls[1].endswith("guest killed"), out
    assert took < 30


def test_inspect_sees_two_packages_and_two_nodes_with_their_cpus_and_memory(guest):
    rc, out, _ = guest([".venv/bin/orchestrator", "inspect", "--json"], timeout=240)
    assert rc == 0, out[-3000:]
    doc = json.loads(out[out.index("{"):])             # the JSON document is the whole output
    assert doc["summary"]["packages"] == 2 and doc["summary"]["numa_nodes"] == 2
    nodes = {n["id"]: n for n in doc["numa_nodes"]}
    assert parse_cpulist(nodes[0]["cpus"]) == (0,) and parse_cpulist(nodes[1]["cpus"]) == (1,)
    assert all(n["memory_bytes"] > 1 << 30 for n in nodes.values())
    assert doc["numa_balancing"] == 1


def test_the_guest_finds_the_users_files_whatever_the_home_folder(guest, tmp_path, monkeypatch):
    """A home folder other than /root: the guest's command has the host's HOME and finds the same cache, state
    and llama-server as orchestrator on the host (the llama.cpp builds under ~/.cache/orchestrator)."""
    from orchestrator.backend.detect import BackendError, find_llama_server
    from orchestrator.paths import cache_dir, state_dir

    builds = cache_dir()
    home = tmp_path / "someone"
    (home / ".cache").mkdir(parents=True)
    (home / ".cache" / "orchestrator").symlink_to(builds)       # this host's builds, seen from the other home
    for var in ("XDG_CACHE_HOME", "XDG_STATE_HOME", "ORCHESTRATOR_CACHE", "ORCHESTRATOR_STATE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(home))
    try:
        want_server = list(find_llama_server())
    except BackendError as e:
        want_server = ["", str(e)]
    rc, out, _ = guest([PY, "tests/vm/guest_checks.py", "locations"], timeout=240, env={"PYTHONPATH": str(REPO)})
    assert rc == 0, out[-3000:]
    r = last_json(out)
    assert r["home"] == str(home)
    assert r["cache"] == str(home / ".cache" / "orchestrator") == str(cache_dir())
    assert r["state"] == str(home / ".local" / "state" / "orchestrator") == str(state_dir())
    assert r["server"] == want_server
    if want_server[1].startswith("orchestrator cache"):
        assert want_server[0].startswith(str(home))        # found through the other home, not /root


# Eight runs of the wrapper, each some 25 processes, and a process start costs 0.2-1 s under TCG: 80 s on the
# development VM, and more than 480 s once on CI's host. The limit allows for a host some 15 times slower.
@pytest.mark.timeout(1800)
def test_balancing_wrapper_turns_the_real_setting_off_and_back(guest):
    rc, out, _ = guest([PY, "tests/vm/guest_checks.py", "balancing"], timeout=1200)
    assert rc == 0, out[-3000:]
    r = last_json(out)
    assert r["start"] == "1" and r["dev_fd"] is False          # no /dev/fd in the guest, as on a minimal root
    for case, rc_expected in (("exit", 0), ("failure", 3), ("sigint", 8), ("sigterm", 7)):
        assert (r[case]["during"], r[case]["after"], r[case]["rc"]) == ("0", "1", rc_expected), (case, r[case])
    assert (r["killed"]["during"], r["killed"]["after"]) == ("0", "1")        # SIGKILL, then --cleanup
    # 0 (off) and 2 (memory tiering) are left as they were
    assert (r["start0"]["during"], r["start0"]["after"]) == ("0", "0")
    assert (r["start2"]["during"], r["start2"]["after"]) == ("0", "2")
    assert r["two_holders"] == {"during": ["0", "0"], "after_first": "0", "after_both": "1"}


def test_bind_socket_binds_every_thread_and_the_memory_it_touches(guest):
    rc, out, _ = guest([PY, "tests/vm/guest_checks.py", "bind-socket"], timeout=480)
    assert rc == 0, out[-3000:]
    report = last_json(out)
    for interleave, mem, policy in (("off", "--membind=1", "bind:1"), ("on", "--interleave=1", "interleave:1")):
        r = report[interleave]
        assert r["dry_run"].startswith(f"numactl --physcpubind=1 {mem} -- "), r["dry_run"]
        assert set(r["threads"].values()) == {"1"} and len(r["threads"]) >= 2, r["threads"]  # every thread
        assert r["policy"] == policy and r["touched"]["policy"] == policy
        assert set(r["touched"]["pages"]) == {"1"}, r["touched"]                            # node 1 only
        assert r["touched"]["pages"]["1"] >= 64 * 256, r["maps"]                 # the 64 MiB it wrote


@pytest.mark.timeout(1500)              # the guest's own limit (900 s) and one boot again (numa_guest.py)
def test_demo_workers_run_where_the_plan_says(guest, tmp_path):
    """The demo's plan made inside the guest, each worker started as `up` starts it (its LaunchSpec: wrappers
    and argv from the plan): every thread of each llama-server on the planned CPUs, before and after it
    computes, its memory policy and its anonymous pages on the planned node, and a completion answers."""
    from orchestrator.model.synth import write_model

    model = tmp_path / "demo-moe.gguf"         # the demo's model (scripts/demo.sh writes the same)
    write_model(model, "qwen3-30b-a3b", scale=0.125, quant="q8_0", fsync=False)
    rc, out, _ = guest([PY, "tests/vm/guest_checks.py", "workers", "topologies/demo.yaml", model], timeout=900)
    assert rc == 0, out[-4000:]
    r = last_json(out)
    assert len(r["workers"]) == 2
    for k, w in enumerate(r["workers"]):
        # one replica per node: worker k on CPU k and node k
        assert (w["plan"]["mode"], w["plan"]["cpus"], w["plan"]["mem_nodes"]) == ("bind", [k], [k]), w["plan"]
        a = w["argv"]
        assert a[a.index("numactl") + 1:a.index("numactl") + 3] == [f"--physcpubind={k}", f"--membind={k}"]
        assert "--numa" not in a
        for when in ("threads", "threads_after"):
            assert set(w[when].values()) == {str(k)}, (w["name"], when, w[when])
        assert w["policy"] == f"bind:{k}"
        anon = [m for m in w["maps"] if m["kind"].startswith("anon")]
        assert anon and all(set(m["pages"]) == {str(k)} for m in anon), anon
        assert sum(m["pages"][str(k)] for m in anon) * 4096 >= 64 << 20       # the weights, read under bind
        assert w["completion"]["tokens_predicted"] and w["completion"]["tokens_predicted"] > 0
    assert (r["balancing_during"], r["balancing_after"]) == ("0", "1")


LONG = "ORCHESTRATOR_VM_LONG"


def check_whole_up(r: dict) -> None:
    """What the whole `up` of the demo in the guest must show (guest_checks.py up's report)."""
    assert "error" not in r, r.get("error")
    assert r["completion"]["usage"]["completion_tokens"] > 0, r["completion"]
    assert len(r["servers"]) == 2, r["servers"]
    for s in r["servers"]:
        # one replica per node: the replica on port 8081 + k on CPU k and node k (the demo's plan)
        k = int(s["port"]) - 8081
        wrapper = s["parent_argv"]
        assert wrapper[wrapper.index("numactl") + 1:wrapper.index("numactl") + 3] == [
            f"--physcpubind={k}", f"--membind={k}"], wrapper
        assert "--numa" not in s["argv"]
        assert set(s["threads"].values()) == {str(k)}, (s["port"], s["threads"])   # every thread
        assert s["policy"] == f"bind:{k}"
        assert set(s["pages"]["anon"]) == {str(k)}, s["pages"]                     # its memory on node k only
        assert s["pages"]["anon"][str(k)] * 4096 >= 64 << 20                        # the weights, under bind
    assert (r["balancing_before"], r["balancing_during"], r["balancing_after"]) == ("1", "0", "1")
    assert r["up_rc"] == 0 and r["left"] == [], (r["up_rc"], r["left"])   # a stop asked for, nothing left


@pytest.mark.timeout(3600)
@pytest.mark.skipif(not os.environ.get(LONG), reason=f"the whole up under emulation takes up to an hour (and Ray's "
                    f"head did not start under TCG: docs/numa-vm.md); {LONG}=1 runs it")
def test_whole_up_of_the_demo_serves_and_ctrl_c_leaves_nothing(guest, tmp_path):
    """`orchestrator up topologies/demo.yaml` inside the guest, as a user runs it: a completion through the
    gateway with each replica on its own node, then Ctrl-C. Not in CI (docs/numa-vm.md has its runs); up's
    log, `status` and the report stay in tmp_path."""
    from orchestrator.model.synth import write_model

    model = tmp_path / "demo-moe.gguf"
    write_model(model, "qwen3-30b-a3b", scale=0.125, quant="q8_0", fsync=False)
    out = tmp_path / "out"
    rc, text, took = guest([PY, "tests/vm/guest_checks.py", "up", "--out", out, "topologies/demo.yaml", model,
                            "ray.start_timeout=45m"], timeout=3420, out=str(out), dev_fd=True,
                           env={"PYTHONPATH": str(REPO)})     # this checkout's package, installed or not
    print(f"guest: {took:.0f} s, status {rc}; logs in {out}")
    assert rc == 0, text[-4000:]
    check_whole_up(last_json(text))
