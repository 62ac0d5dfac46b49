"""Every recorded machine of this project (tests/fixtures/machines) loads, and its files agree with each other."""

from __future__ import annotations

import json

import pytest

from orchestrator.hardware import Bandwidth, Machine, load_dump, load_machine

from .conftest import MACHINES

NAMES = sorted({p.name.split(".")[0] for p in MACHINES.glob("*.inspect.json")})


def test_there_are_recorded_machines():
    assert "dev-vm" in NAMES


@pytest.mark.parametrize("name", NAMES)
def test_recorded_machine_is_consistent(name):
    doc = json.loads((MACHINES / f"{name}.inspect.json").read_text())
    m = Machine.from_json(doc)
    assert m.to_json() == doc
    assert load_machine(MACHINES / f"{name}.inspect.json") == m
    dump = MACHINES / f"{name}.tar.gz"
    if dump.exists():
        d = load_dump(dump)
        assert d.summary() == m.summary()
        assert [(n.id, n.cpus) for n in d.numa_nodes] == [(n.id, n.cpus) for n in m.numa_nodes]
        assert [(g.pci, g.name, g.memory_bytes) for g in d.gpus] == [(g.pci, g.name, g.memory_bytes) for g in m.gpus]
    probe = MACHINES / f"{name}.probe.json"
    if probe.exists():
        p = json.loads(probe.read_text())
        bw = Bandwidth.from_json(p["bandwidth"])
        assert bw.host, "the host memory part is measured on every machine"
        cpu_nodes = {n.id for n in m.numa_nodes if n.cpus}
        assert {c for c, _ in bw.host} <= cpu_nodes
        for g in m.gpus:  # a GPU machine's probe covers every GPU
            assert any(gi == g.index for gi, _ in bw.gpu_h2d), g
