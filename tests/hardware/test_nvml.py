"""NVML reading. No GPU here: a fake ``pynvml`` stands in at the side-effect seam (the NVML library), while
NUMA node and local CPUs come from a real sysfs tree. The device counterpart is the `gpu`-marked test in
test_live.py, run by the lead on the H200 machine."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from orchestrator.hardware.nvml import read_gpus
from orchestrator.hardware.rootfs import RootFS


class NVMLError(Exception):
    pass


class NVMLError_LibraryNotFound(NVMLError):
    pass


class NVMLError_NotSupported(NVMLError):
    pass


class NVMLError_GpuIsLost(NVMLError):
    pass


def fake_pynvml(n=2, nvlink=True, init_error=None, lost_on=None):
    m = types.ModuleType("pynvml")
    m.calls = []

    def init():
        if init_error:
            raise init_error
    m.nvmlInit = init
    m.nvmlShutdown = lambda: m.calls.append("shutdown")
    m.nvmlSystemGetDriverVersion = lambda: b"580.95.05"
    m.nvmlDeviceGetCount = lambda: n

    def handle(i):
        if lost_on == i:
            raise NVMLError_GpuIsLost("GPU is lost")
        return i
    m.nvmlDeviceGetHandleByIndex = handle
    m.nvmlDeviceGetPciInfo = lambda h: types.SimpleNamespace(busId=f"00000000:{0x18 + h * 0x20:02X}:00.0".encode(),
                                                            pciDeviceId=(0x2335 << 16) | 0x10DE)
    m.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(total=150_000_000_000, free=149_000_000_000)
    m.nvmlDeviceGetName = lambda h: "NVIDIA H200"
    m.nvmlDeviceGetUUID = lambda h: f"GPU-0000-{h}"
    m.nvmlDeviceGetCudaComputeCapability = lambda h: (9, 0)
    m.nvmlDeviceGetCurrPcieLinkGeneration = lambda h: 5
    m.nvmlDeviceGetCurrPcieLinkWidth = lambda h: 16

    def unsupported(h):
        raise NVMLError_NotSupported("Not Supported")
    m.nvmlDeviceGetMaxPcieLinkGeneration = unsupported
    m.nvmlDeviceGetMaxPcieLinkWidth = lambda h: 16

    def p2p(a, b, idx):
        return 0 if (idx == 2 and nvlink) or idx == 0 else 1
    m.nvmlDeviceGetP2PStatus = p2p
    return m


@pytest.fixture()
def sysfs_root(tmp_path) -> Path:
    for pci, node, mask in (("0000:18:00.0", "0", "00000000,0000ffff"), ("0000:38:00.0", "-1", "ffffffff,ffff0000")):
        d = tmp_path / "sys/bus/pci/devices" / pci
        d.mkdir(parents=True)
        (d / "numa_node").write_text(node + "\n")
        (d / "local_cpus").write_text(mask + "\n")
    return tmp_path


def test_nvml_gpus_with_sysfs_locality(monkeypatch, sysfs_root):
    fake = fake_pynvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    fs = RootFS(sysfs_root)
    res = read_gpus(fs)
    assert res.ok and res.note is None and res.driver == "580.95.05"
    g0, g1 = res.gpus
    assert (g0.index, g0.pci, g0.name, g0.uuid) == (0, "0000:18:00.0", "NVIDIA H200", "GPU-0000-0")
    assert g1.pci == "0000:38:00.0"
    assert g0.numa_node == 0 and g0.local_cpus == tuple(range(16))
    assert g1.numa_node == -1 and g1.local_cpus == tuple(range(16, 64))   # -1 stays -1
    assert g0.memory_bytes == 150_000_000_000 and g0.compute_capability == "9.0"
    assert (g0.pcie_gen, g0.pcie_width, g0.pcie_gen_max, g0.pcie_width_max) == (5, 16, None, 16)  # unsupported: None
    assert g0.peers == ((1, "nvlink"),) and g1.peers == ((0, "nvlink"),)
    assert g0.device_id == "0x2335" and g0.source == "nvml"
    assert "sys/bus/pci/devices/0000:18:00.0/numa_node" in fs.files  # recorded for --save
    assert fake.calls == ["shutdown"]


def test_pcie_p2p_without_nvlink(monkeypatch, sysfs_root):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(nvlink=False))
    res = read_gpus(RootFS(sysfs_root))
    assert res.gpus[0].peers == ((1, "pcie-p2p"),)


def test_no_driver_is_silent(monkeypatch, sysfs_root):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(init_error=NVMLError_LibraryNotFound("not found")))
    res = read_gpus(RootFS(sysfs_root))
    assert not res.ok and res.note is None and res.gpus == ()


def test_driver_present_but_nvml_failing_is_a_note(monkeypatch, sysfs_root):
    (sysfs_root / "proc/driver/nvidia/gpus/0000:18:00.0").mkdir(parents=True)
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(init_error=NVMLError_LibraryNotFound("not found")))
    res = read_gpus(RootFS(sysfs_root))
    assert not res.ok and "NVML failed to start (NVMLError_LibraryNotFound" in res.note
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(lost_on=1))
    res = read_gpus(RootFS(sysfs_root))
    assert not res.ok and res.note == "NVML failed (NVMLError_GpuIsLost: GPU is lost): GPUs read from sysfs"


def test_nvml_not_installed(monkeypatch, sysfs_root):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import raises ImportError
    assert read_gpus(RootFS(sysfs_root)).note is None
    (sysfs_root / "proc/driver/nvidia/gpus/0000:18:00.0").mkdir(parents=True)
    assert "nvidia-ml-py is not installed" in read_gpus(RootFS(sysfs_root)).note


def test_recorded_nvml_is_used_for_dumps(monkeypatch, tmp_path, extracted):
    """A dump saved on a GPU machine keeps what NVML said (orchestrator/nvml.json); loading never asks NVML."""
    import json
    import shutil

    from orchestrator.hardware import load_dump, save_dump
    from orchestrator.hardware.nvml import gpu_to_record

    root = tmp_path / "root"
    shutil.copytree(extracted("32em64t-2n8c+dax+nvme+mic+dimms.tar.bz2"), root, symlinks=True)
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml())
    gpus = read_gpus(RootFS(root)).gpus
    (root / "orchestrator").mkdir()
    (root / "orchestrator/nvml.json").write_text(json.dumps({"driver": "580", "gpus": [gpu_to_record(g) for g in gpus]}))
    monkeypatch.setitem(sys.modules, "pynvml", None)
    out = tmp_path / "gpu-box.tar.gz"
    save_dump(out, root)
    m = load_dump(out)
    assert [g.name for g in m.gpus] == ["NVIDIA H200", "NVIDIA H200"] and m.gpu_driver == "580"
    assert m.gpus[0].numa_node == -1 or m.gpus[0].numa_node >= 0
    assert [d.pci for d in m.pci_devices] == ["0000:05:00.0", "0000:83:00.0"]  # BMC VGA and Xeon Phi: not GPUs


def test_one_wrapper_reads_by_index_and_closes_once(monkeypatch):
    """The wrapper the bench sampler, the worker metrics and `doctor` share: memory as (total, used, free),
    per-process memory without NVML's not-available marker, optional readings as None, one shutdown."""
    from orchestrator.hardware.nvml import Nvml

    fake = fake_pynvml(n=2)
    fake.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(total=100, used=30 + h, free=70 - h)
    fake.nvmlDeviceGetComputeRunningProcesses = lambda h: [types.SimpleNamespace(pid=7, usedGpuMemory=5),
                                                           types.SimpleNamespace(pid=8, usedGpuMemory=(1 << 64) - 1),
                                                           types.SimpleNamespace(pid=9, usedGpuMemory=None)]
    nv = Nvml.open(fake)
    assert nv is not None and nv.count() == 2 and nv.uuids == ["GPU-0000-0", "GPU-0000-1"]
    assert nv.memory(1) == (100, 31, 69) and nv.process_memory(0) == {7: 5}
    assert nv.power_w(0) is None and nv.temperature_c(0) is None          # not in this fake: unsupported
    assert nv.pci_bus_id(1) == "00000000:38:00.0" and nv.driver_version() == "580.95.05"
    nv.close()
    nv.close()
    assert fake.calls == ["shutdown"]


def test_one_wrapper_without_gpus_or_driver():
    from orchestrator.hardware.nvml import Nvml

    none = fake_pynvml(n=0)
    assert Nvml.open(none) is None and none.calls == ["shutdown"]      # started, no GPU: closed again
    broken = Nvml(fake_pynvml(init_error=NVMLError_LibraryNotFound("not found")))
    assert not broken.started and not broken.available and isinstance(broken.error, NVMLError_LibraryNotFound)
    lost = Nvml(fake_pynvml(lost_on=1))
    assert lost.started and not lost.available and isinstance(lost.error, NVMLError_GpuIsLost)
    lost.close()
