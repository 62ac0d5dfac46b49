"""Fixtures for the scripts/numa tests: the scripts' paths and the recorded sysfs dumps."""

from __future__ import annotations

import tarfile
from pathlib import Path

import pytest

# hwloc's recorded Linux machines, shared with the hardware tests (tests/fixtures/sysfs/README.md says where they
# come from; its expected.json what each one is)
DUMPS = Path(__file__).resolve().parents[1] / "fixtures" / "sysfs"

# tarball -> the directory inside it that holds sys/, and why the numactl-bind-socket.sh tests use it
DUMP_ROOTS = {
    "128arm-2pa2n8cluster4co": "128arm-2pa2n8cluster4co",       # 2 sockets x 2 nodes, package ids 36 and 8442
    "nvidiagpunumanodes": "nvidiagpunumanodes",                 # sockets 0 and 8, SMT4, CPU-less GPU-memory nodes
    "fakecpuid1f-64intel64-2p4d2n2c2t": "fakecpuid1f-64intel64-2p4d2n2c2t",   # 4 sockets x 4 nodes, core_cpus_list
    "64amd64-4s2n4ca2co": "64amd64-4s2n4ca2co",                 # siblings without core_cpus_list, has_normal_memory
    "64fake-4n2s2ca2c2t": "64fake-4n2s2ca2c2t",                 # only hex masks: no *_list files, no cpu/online
    "offline-cpu0-node0": "offline-cpu0-node0",                 # socket 0's CPUs are in no online node
}


@pytest.fixture(scope="session")
def sysfs_dump(tmp_path_factory):
    """sysfs_dump(name) -> the dump's ``sys`` directory, extracted once per session."""
    cache: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in cache:
            dest = tmp_path_factory.mktemp(f"dump-{name}")
            with tarfile.open(DUMPS / f"{name}.tar.bz2") as tf:
                tf.extractall(dest, filter="data")
            cache[name] = dest / DUMP_ROOTS[name] / "sys"
            assert cache[name].is_dir(), cache[name]
        return cache[name]

    return get

