"""resolve.measured: a live machine with no cached bandwidth is probed once before planning, so `plan` and `up`
use measured host memory and PCIe numbers (and agree, through the cache); a machine whose host bandwidth stays
unknown gets a note saying what the CPU speed was predicted from. The probe itself is tested with real GPUs in
tests/hardware/test_probe.py and for real on this machine's memory below; elsewhere the side-effect seam
(run_probe) is faked."""

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
        self.cached, self.cache_file = False, Path("/nonexistent/probe.json")


def test_probed_when_gpus_and_nothing_cached(h200, monkeypatch):
    calls = []
    import orchestrator.hardware.probe as probe

    monkeypatch.setattr(probe, "run_probe", lambda m, **kw: calls.append((m, kw)) or FakeResult(h200.bandwidth))
    notes = []
    m = resolve.measured(replace(h200, bandwidth=None), notes)
    assert len(calls) == 1 and m.bandwidth == h200.bandwidth
    assert calls[0][1] == {"cpu_prompt": resolve.cpu_prompt_probe}        # the CPU's prompt speed measured too
    assert any("measured now" in n for n in notes)


def test_not_probed_when_cached(h200, monkeypatch):
    import orchestrator.hardware.probe as probe

    monkeypatch.setattr(probe, "run_probe", lambda m, **kw: pytest.fail("probed"))
    assert resolve.measured(h200, []) is h200                                   # cached bandwidth present


def test_probed_without_gpus_too(h200, monkeypatch):
    """Generation on the CPU follows host memory bandwidth: a CPU-only machine is measured as well."""
    calls = []
    import orchestrator.hardware.probe as probe

    monkeypatch.setattr(probe, "run_probe", lambda m, **kw: calls.append(m) or FakeResult(h200.bandwidth))
    notes = []
    m = resolve.measured(replace(h200, gpus=(), bandwidth=None), notes)
    assert len(calls) == 1 and m.bandwidth == h200.bandwidth
    assert notes == ["bandwidth: host memory measured now by `orchestrator probe` (cached in /nonexistent/probe.json; "
                     "`orchestrator probe --refresh` measures again)"]


def test_a_probe_that_cannot_run_leaves_assumed_values_with_a_note(h200, monkeypatch):
    import orchestrator.hardware.probe as probe

    def boom(m, **kw):
        raise HardwareError("probe: no C compiler (apt-get install gcc)")

    monkeypatch.setattr(probe, "run_probe", boom)
    notes = []
    m = resolve.measured(replace(h200, bandwidth=None), notes)
    assert m.bandwidth is None and notes == ["bandwidth: not measured (probe: no C compiler (apt-get install gcc)); "
                                             "assumed values are used"]


def test_an_unmeasured_host_is_said_with_the_figure_assumed(h200):
    assert resolve.assumed_host_bandwidth({"server": h200}) == []              # recorded with its probe
    (note,) = resolve.assumed_host_bandwidth({"server": replace(h200, bandwidth=None)})
    assert note.startswith("node server: host memory bandwidth not measured: CPU speed predicted from an assumed "
                           "60 GB/s per NUMA node")


def test_two_socket_machine_with_one_node_measured_names_the_other():
    from orchestrator.hardware.topology import Bandwidth, FrozenMap

    two = load_machine(FIX / "described" / "2socket-2gpu.json")
    ids = [n.id for n in two.numa_nodes]
    assert len(ids) >= 2
    bw = Bandwidth(gpu_h2d=FrozenMap({}), gpu_d2h=FrozenMap({}), host=FrozenMap({(ids[0], ids[0]): 50e9}),
                   measured_at="2026-12-02T00:00:00+0000", key="x")
    (note,) = resolve.assumed_host_bandwidth({"s": replace(two, bandwidth=bw)})
    assert f"not measured on node{'s' if len(ids) > 2 else ''} {', '.join(map(str, ids[1:]))}:" in note


@pytest.mark.integration
def test_plan_on_this_machine_measures_host_memory_once_then_reads_the_cache(tmp_path, monkeypatch,
                                                                            llama_server_path):
    """The real probe (native/membw.c built with this machine's compiler) runs at the first resolve of a live
    topology and not at the second; the notes say so, the prediction uses the measured figure, and nothing is
    said to be assumed."""
    import sys

    from orchestrator.backend.detect import detect_backend

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from tiny_llama import write_tiny_llama

    monkeypatch.setenv("ORCHESTRATOR_CACHE", str(tmp_path / "cache"))
    model = write_tiny_llama(tmp_path / "tiny.gguf")
    topo = tmp_path / "t.yaml"
    topo.write_text(f"model: {{path: {model}, context: 512}}\nnodes: [{{name: here, gpus: none}}]\n")
    backend = detect_backend(llama_server_path)
    first = resolve.resolve(topo, backend=backend)
    probe_notes = [n for n in first.notes if n.startswith("bandwidth:")]
    assert len(probe_notes) == 1 and " measured now by `orchestrator probe`" in probe_notes[0], first.notes
    assert not any("not measured" in n for n in first.notes), first.notes
    host = dict(first.machines["here"].bandwidth.host)
    assert host and all(v > 1e8 for v in host.values())
    assert list((tmp_path / "cache" / "probe").glob("*.json"))
    second = resolve.resolve(topo, backend=backend)
    assert dict(second.machines["here"].bandwidth.host) == host                # from the cache, not measured again
    assert not any("measured now" in n for n in second.notes)
