"""Fixtures for the scripts/numa tests: the scripts' paths and the recorded sysfs dumps."""

from __future__ import annotations

import tarfile
from pathlib import Path

import pytest

DUMPS = Path(__file__).resolve().parent / "fixtures" / "sysfs"

# tarball -> the directory inside it that holds sys/ (from /work/shared/fixtures/sysfs/expected.json)
DUMP_ROOTS = {
    "128arm-2pa2n8cluster4co": "128arm-2pa2n8cluster4co",
    "nvidiagpunumanodes": "nvidiagpunumanodes",
    "fakecpuid1f-64intel64-2p4d2n2c2t": "fakecpuid1f-64intel64-2p4d2n2c2t",
    "64amd64-4s2n4ca2co": "64amd64-4s2n4ca2co",
    "64fake-4n2s2ca2c2t": "64fake-4n2s2ca2c2t",
    "offline-cpu0-node0": "offline-cpu0-node0",
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

