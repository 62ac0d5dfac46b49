"""resolve.measured: a live machine with GPUs and no cached bandwidth is probed once before planning, so `plan`
and `up` use measured PCIe numbers (and agree, through the cache). The probe itself is tested with real GPUs in
tests/hardware/test_probe.py; here the side-effect seam (run_probe) is faked."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from orchestrator import resolve
from orchestrator.errors import HardwareError
from orchestrator.hardware.dump import load_machine

FIX = Path(__file__).resolve().parent / "fixtures" / "machines"


@pytest.fixture()
def h200():
    return load_machine(FIX / "h200.inspect.json")     # recorded with its probe bandwidths


class FakeResult:
    def __init__(self, bandwidth, failed=False, messages=()):
        self.bandwidth, self.failed, self.messages = bandwidth, failed, list(messages)


def test_probed_when_gpus_and_nothing_cached(h200, monkeypatch):
    calls = []
    import orchestrator.hardware.probe as probe

    monkeypatch.setattr(probe, "run_probe", lambda m: calls.append(m) or FakeResult(h200.bandwidth))
    notes = []
    m = resolve.measured(replace(h200, bandwidth=None), notes)
    assert len(calls) == 1 and m.bandwidth == h200.bandwidth
    assert any("measured now" in n for n in notes)


def test_not_probed_when_cached_or_without_gpus(h200, monkeypatch):
    import orchestrator.hardware.probe as probe

    monkeypatch.setattr(probe, "run_probe", lambda m: pytest.fail("probed"))
    assert resolve.measured(h200, []) is h200                                   # cached bandwidth present
    cpu_only = replace(h200, gpus=(), bandwidth=None)
    assert resolve.measured(cpu_only, []) is cpu_only                           # nothing PCIe to measure


def test_a_probe_that_cannot_run_leaves_assumed_values_with_a_note(h200, monkeypatch):
    import orchestrator.hardware.probe as probe

    def boom(m):
        raise HardwareError("probe: no C compiler (apt-get install gcc)")

    monkeypatch.setattr(probe, "run_probe", boom)
    notes = []
    m = resolve.measured(replace(h200, bandwidth=None), notes)
    assert m.bandwidth is None and notes == ["bandwidth: not measured (probe: no C compiler (apt-get install gcc)); "
                                             "assumed values are used"]
