"""NVIDIA GPUs through NVML (nvidia-ml-py), on the live machine only.

NVML gives what sysfs cannot: name, UUID, memory total/free, current and maximum PCIe generation and width,
compute capability and the peer-to-peer matrix (NVLink, PCIe P2P). The NUMA node and local CPUs still come
from sysfs (``/sys/bus/pci/devices/<pci>/numa_node``, ``local_cpus``), read through the same RootFS so
``inspect --save`` records them. Any NVML failure becomes a note and the caller falls back to sysfs.

pynvml quirk (13.x): ``NVML_P2P_CAPS_INDEX_READ`` is defined as the tuple ``(0,)`` (a stray comma), so the
capability indexes are spelled as integers here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from orchestrator.hardware.pci import PCI_DIR, norm_pci, pci_locality
from orchestrator.hardware.rootfs import RootFS
from orchestrator.hardware.topology import Gpu

P2P_READ = 0
P2P_NVLINK = 2


@dataclass
class NvmlResult:
    ok: bool = False                       # NVML answered (possibly with zero GPUs)
    gpus: tuple[Gpu, ...] = ()
    driver: str | None = None
    note: str | None = None                # what failed and what was assumed
    extra: dict = field(default_factory=dict)


def _s(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def read_gpus(fs: RootFS | None = None) -> NvmlResult:
    fs = fs or RootFS("/")
    try:
        import pynvml
    except ImportError:
        nvidia = fs.listdir("proc/driver/nvidia/gpus")
        if nvidia:
            return NvmlResult(note="nvidia-ml-py is not installed: NVIDIA GPUs read from sysfs "
                                   "(no memory size, UUID or links; `pip install nvidia-ml-py`)")
        return NvmlResult()
    try:
        pynvml.nvmlInit()
    except Exception as err:
        name = type(err).__name__
        if "LibraryNotFound" in name and not fs.listdir("proc/driver/nvidia/gpus"):
            return NvmlResult()  # no NVIDIA driver: a CPU-only machine, nothing to say
        return NvmlResult(note=f"NVML failed to start ({name}: {err}): GPUs read from sysfs")
    try:
        return _read(pynvml, fs)
    except Exception as err:  # NVML present but failing (GPU lost, driver/library mismatch ...)
        return NvmlResult(note=f"NVML failed ({type(err).__name__}: {err}): GPUs read from sysfs")
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def _opt(fn, *args):
    """An optional NVML query: None when the device or driver does not support it."""
    try:
        return fn(*args)
    except Exception:
        return None


def _read(pynvml, fs: RootFS) -> NvmlResult:

    driver = _s(pynvml.nvmlSystemGetDriverVersion())
    n = pynvml.nvmlDeviceGetCount()
    handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(n)]
    gpus = []
    for i, h in enumerate(handles):
        pci_info = pynvml.nvmlDeviceGetPciInfo(h)
        pci = norm_pci(_s(pci_info.busId))
        mem = pynvml.nvmlDeviceGetMemoryInfo(h)
        cc = _opt(pynvml.nvmlDeviceGetCudaComputeCapability, h)
        node, local = pci_locality(fs, f"{PCI_DIR}/{pci}")
        peers = []
        for j, other in enumerate(handles):
            if j == i:
                continue
            if _opt(pynvml.nvmlDeviceGetP2PStatus, h, other, P2P_NVLINK) == 0:
                peers.append((j, "nvlink"))
            elif _opt(pynvml.nvmlDeviceGetP2PStatus, h, other, P2P_READ) == 0:
                peers.append((j, "pcie-p2p"))
        dev_id = getattr(pci_info, "pciDeviceId", None)
        gpus.append(Gpu(
            index=i, name=_s(pynvml.nvmlDeviceGetName(h)), uuid=_opt(lambda: _s(pynvml.nvmlDeviceGetUUID(h))),
            pci=pci, vendor="nvidia", numa_node=node, memory_bytes=int(mem.total), memory_free_bytes=int(mem.free),
            pcie_gen=_opt(pynvml.nvmlDeviceGetCurrPcieLinkGeneration, h),
            pcie_width=_opt(pynvml.nvmlDeviceGetCurrPcieLinkWidth, h),
            pcie_gen_max=_opt(pynvml.nvmlDeviceGetMaxPcieLinkGeneration, h),
            pcie_width_max=_opt(pynvml.nvmlDeviceGetMaxPcieLinkWidth, h),
            local_cpus=local, compute_capability=f"{cc[0]}.{cc[1]}" if cc else None, source="nvml",
            peers=tuple(peers), vendor_id="0x10de",
            device_id=f"0x{(dev_id >> 16) & 0xffff:04x}" if isinstance(dev_id, int) else None))
    return NvmlResult(ok=True, gpus=tuple(gpus), driver=driver)


def gpu_to_record(g: Gpu) -> dict:
    """One GPU as stored in a dump's orchestrator/nvml.json (the same fields as ``inspect --json``)."""
    from orchestrator.units import format_cpulist

    return {"index": g.index, "name": g.name, "uuid": g.uuid, "pci": g.pci, "vendor": g.vendor,
            "vendor_id": g.vendor_id, "device_id": g.device_id, "numa_node": g.numa_node,
            "memory_bytes": g.memory_bytes, "memory_free_bytes": g.memory_free_bytes, "pcie_gen": g.pcie_gen,
            "pcie_width": g.pcie_width, "pcie_gen_max": g.pcie_gen_max, "pcie_width_max": g.pcie_width_max,
            "local_cpus": format_cpulist(g.local_cpus), "compute_capability": g.compute_capability,
            "memory_node": g.memory_node, "peers": [{"gpu": j, "link": link} for j, link in g.peers]}
