"""Recording and reloading machines; every kind of bad input gives one clear HardwareError or a note."""

from __future__ import annotations

import io
import json
import os
import shutil
import tarfile
import tempfile

import pytest

from orchestrator.errors import HardwareError
from orchestrator.hardware import Machine, load_dump, load_machine, read_machine, save_dump
from orchestrator.hardware.dump import MANIFEST
from orchestrator.hardware.rootfs import RootFS

from .conftest import EXPECTED, SYSFS


def _strip(m: Machine) -> dict:
    doc = m.to_json()
    for n in doc["numa_nodes"]:
        n["free_bytes"] = None  # changes between two reads of the live machine
    for key in ("source", "memory_available_bytes", "hugepages"):
        doc[key] = None
    return doc


def test_live_save_records_exactly_the_files_read(tmp_path, isolated_cache):
    out = tmp_path / "here.tar.gz"
    saved = save_dump(out, "/")
    with tarfile.open(out) as tf:
        names = tf.getnames()
        tops = {n.split("/")[0] for n in names}
        assert len(tops) == 1
        rel = {n.split("/", 1)[1] for n in names if "/" in n and tf.getmember(n).isfile()}
        manifest = json.loads(tf.extractfile(f"{tops.pop()}/{MANIFEST}").read())
    assert {"sys/devices/system/cpu/online", "proc/self/status", "proc/cpuinfo", "proc/mounts"} <= rel
    assert all(r.startswith(("sys/", "proc/", "orchestrator/", "etc/")) for r in rel)
    assert manifest["schema"] == "orchestrator.dump/1" and manifest["files"] == len(rel - {MANIFEST})
    # reading it back gives the machine as it was read live (minus what moves between two reads)
    again = load_dump(out)
    assert _strip(again) == _strip(saved)
    assert again.allowed_cpus == saved.allowed_cpus and again.source == f"dump {out}"
    # the recording only holds what was read: far fewer files than the live /sys
    assert len(rel) < 2000


def test_live_save_keeps_the_probe_results(tmp_path, isolated_cache):
    from orchestrator.hardware.probe import run_probe

    res = run_probe(read_machine("/"), gpu=False, host_bytes=32 << 20, host_reps=1)
    assert not res.failed
    out = tmp_path / "probed.tar.gz"
    save_dump(out, "/")
    assert load_dump(out).bandwidth == res.bandwidth


def test_load_machine_takes_a_dump_a_directory_or_json(tmp_path, extracted):
    name = "nvidiagpunumanodes.tar.bz2"
    from_tar = load_machine(SYSFS / name)
    from_dir = load_machine(extracted(name).parent)  # the directory above the root: root found inside
    js = tmp_path / "m.json"
    js.write_text(json.dumps(from_tar.to_json()))
    from_json = load_machine(js)
    assert from_json == from_tar
    assert _strip(from_dir) == _strip(from_tar)
    assert [g.memory_node for g in from_json.gpus] == [255, 254, 253, 252, 251, 250]


def _tar(path, members: dict[str, bytes | None], links: dict[str, str] | None = None):
    with tarfile.open(path, "w:gz") as tf:
        for name, data in members.items():
            ti = tarfile.TarInfo(name)
            if data is None:
                ti.type = tarfile.DIRTYPE
                tf.addfile(ti)
            else:
                ti.size = len(data)
                tf.addfile(ti, io.BytesIO(data))
        for name, target in (links or {}).items():
            ti = tarfile.TarInfo(name)
            ti.type, ti.linkname = tarfile.SYMTYPE, target
            tf.addfile(ti)


@pytest.mark.parametrize("make, message", [
    (lambda p: None, "no such file"),
    (lambda p: p.write_bytes(os.urandom(2048)), "not a readable tar archive"),
    (lambda p: _tar(p, {"x/readme.txt": b"hello"}), "not a machine dump: no sys/devices/system/cpu"),
    (lambda p: _tar(p, {"../evil/sys/devices/system/cpu/online": b"0"}), "unsafe member"),
    (lambda p: _tar(p, {"m/sys/devices/system/cpu/cpu0/topology/core_id": b"0"},
                    {"m/sys/devices/system/cpu/online": "/etc/passwd"}), "points to an absolute path"),
    (lambda p: _tar(p, {"m/sys/devices/system/cpu/": None}), "holds no cpuN directories"),
    (lambda p: p.write_bytes(open(SYSFS / "4fake-4gr1nu1pu.tar.bz2", "rb").read()[:300]), "archive"),
])
def test_bad_dumps_give_one_clear_error(tmp_path, make, message):
    p = tmp_path / "bad.tar.gz"
    make(p)
    with pytest.raises(HardwareError) as ei:
        load_dump(p)
    text = str(ei.value)
    assert message in text and "\n" not in text
    assert not list(tmp_path.glob(".bad*")), "nothing half-done left behind"


def test_bad_json_machine(tmp_path):
    p = tmp_path / "m.json"
    p.write_text("{ nope")
    with pytest.raises(HardwareError, match="not valid JSON"):
        load_machine(p)
    p.write_text(json.dumps({"schema": "orchestrator.machine/1"}))
    with pytest.raises(HardwareError, match="missing field"):
        load_machine(p)


def _copy_root(extracted, tmp_path, name) -> "os.PathLike":
    dst = tmp_path / "root"
    shutil.copytree(extracted(name), dst, symlinks=True)
    return dst


def test_partial_sysfs_is_read_with_notes(extracted, tmp_path):
    root = _copy_root(extracted, tmp_path, "16amd64-8n2c.tar.bz2")
    os.unlink(root / "sys/devices/system/node/node3/meminfo")
    os.unlink(root / "sys/devices/system/cpu/online")
    os.unlink(root / "proc/cpuinfo")
    os.unlink(root / "sys/devices/system/node/node5/distance")
    os.mkfifo(root / "sys/devices/system/node/node2/meminfo.fifo")
    os.unlink(root / "sys/devices/system/node/node2/meminfo")
    os.rename(root / "sys/devices/system/node/node2/meminfo.fifo", root / "sys/devices/system/node/node2/meminfo")
    m = read_machine(root, nvml=False)  # a FIFO must not hang it
    assert len(m.pus) == 16 and len(m.numa_nodes) == 8  # the topology itself is intact
    assert m.node(3).memory_bytes is None and m.node(2).memory_bytes is None
    assert m.cpu_model is None and m.arch == "unknown"
    assert all(n.distances == () for n in m.numa_nodes)
    notes = " | ".join(m.notes)
    assert "node3/meminfo is missing: memory of node 3 unknown" in notes
    assert "no sys/devices/system/cpu/online" in notes
    assert "distances left unknown" in notes


def test_missing_numa_directory_means_one_node(extracted, tmp_path):
    root = _copy_root(extracted, tmp_path, "8em64t-2s2ca2c.tar.bz2")
    shutil.rmtree(root / "sys/devices/system/node")
    m = read_machine(root, nvml=False)
    assert [n.id for n in m.numa_nodes] == [0] and m.node(0).cpus == m.pus
    assert m.node(0).memory_bytes == m.memory_total_bytes  # from /proc/meminfo
    assert any("one NUMA node 0 assumed" in n for n in m.notes)


@pytest.mark.parametrize("remove, message", [
    ("sys/devices/system/cpu", "sys/devices/system/cpu is missing"),
    ("sys/devices/system/cpu/cpu*/topology", "no online CPU with a topology directory"),
])
def test_sysfs_without_cpus_is_an_error(extracted, tmp_path, remove, message):
    root = _copy_root(extracted, tmp_path, "16amd64-8n2c.tar.bz2")
    for p in root.glob(remove):
        shutil.rmtree(p)
    with pytest.raises(HardwareError, match=message):
        read_machine(root, nvml=False)


def test_unreadable_file_is_a_note_not_a_crash(extracted):
    """As an unprivileged user (forked child, setuid nobody): a permission-denied file becomes a note."""
    if os.geteuid() != 0:
        pytest.skip("needs root to drop to another user")
    base = tempfile.mkdtemp(prefix="orch-perm-", dir="/tmp")
    try:
        os.chmod(base, 0o755)
        root = os.path.join(base, "root")
        shutil.copytree(extracted("16amd64-8n2c.tar.bz2"), root, symlinks=True)
        for d, _, _ in os.walk(root):
            os.chmod(d, 0o755)
        secret = os.path.join(root, "sys/devices/system/node/node1/meminfo")
        os.chmod(secret, 0o000)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # child
            try:
                os.close(r)
                os.setgid(65534)
                os.setuid(65534)
                m = read_machine(root, nvml=False)
                os.write(w, json.dumps({"notes": m.notes, "mem1": m.node(1).memory_bytes,
                                        "pus": len(m.pus)}).encode())
            except BaseException as err:  # report, never run the parent's test code in the child
                os.write(w, json.dumps({"error": repr(err)}).encode())
            finally:
                os._exit(0)
        os.close(w)
        data = b""
        while chunk := os.read(r, 65536):
            data += chunk
        os.waitpid(pid, 0)
        res = json.loads(data)
        assert "error" not in res, res
        assert res["pus"] == 16 and res["mem1"] is None
        assert any("node1/meminfo (permission denied)" in n for n in res["notes"]), res["notes"]
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_rootfs_records_only_what_was_used(extracted):
    fs = RootFS(extracted("4fake-4gr1nu1pu.tar.bz2"))
    assert fs.read("sys/devices/system/node/node0/meminfo").startswith("Node 0 MemTotal")
    assert fs.read("does/not/exist") is None
    assert set(fs.files) == {"sys/devices/system/node/node0/meminfo"}
    assert {"sys", "sys/devices/system/node/node0"} <= fs.dirs and fs.notes == []


def test_expected_json_covers_every_fixture():
    assert sorted(p.name for p in SYSFS.glob("*.tar.bz2")) == sorted(EXPECTED)


@pytest.mark.parametrize("name, needed", [
    ("vm/proc/sys/kernel/numa_balancing", True),
    ("vm/proc/cpuinfo", True),
    ("x/fsroot/sys/devices/system/cpu/online", True),
    ("x/sys/devices/system/cpu/cpu7/topology/core_cpus_list", True),
    ("x/sys/devices/system/cpu/cpu7/online", True),
    ("x/sys/devices/system/cpu/cpu7/cache/index3/size", False),
    ("x/sys/devices/system/cpu/cpufreq/policy0/scaling_governor", False),
    ("x/sys/devices/system/node/node250/meminfo", True),
    ("x/sys/bus/pci/devices/0000:18:00.0", True),
    ("x/sys/devices/pci0000:00/0000:00:02.0/class", True),
    ("x/sys/devices/pci0000:00/0000:00:02.0/config", False),
    ("x/sys/devices/pci0000:00/0000:00:02.0", True),
    ("x/sys/kernel/mm/transparent_hugepage/enabled", True),
    ("x/sys/fs/cgroup/cpuset/dummy/cpuset.cpus", True),
    ("x/sys/fs/cgroup/unified/user.slice/cgroup.procs", False),
    ("x/sys/class/dmi/id/board_name", False),
    ("x/dev/cpuset/prout/cpus", True),
    ("x/orchestrator/nvml.json", True),
])
def test_dump_extraction_keeps_what_discovery_reads(name, needed):
    from orchestrator.hardware.dump import _needed

    assert _needed(name) is needed
