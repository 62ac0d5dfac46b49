"""NVIDIA GPUs through NVML (nvidia-ml-py), on the live machine only: the one wrapper over NVML.

:class:`Nvml` opens the library once and reads GPUs by NVML index (PCI order); the bench's resource sampler,
the workers' metrics and :func:`read_gpus` all go through it. ``Nvml(module)`` takes a stand-in for ``pynvml``
at the library seam.

:func:`read_gpus` describes the machine's GPUs: NVML gives what sysfs cannot (name, UUID, memory total/free,
current and maximum PCIe generation and width, compute capability and the peer-to-peer matrix: NVLink, PCIe
P2P). The NUMA node and local CPUs still come from sysfs (``/sys/bus/pci/devices/<pci>/numa_node``,
``local_cpus``), read through the same RootFS so ``inspect --save`` records them. Any NVML failure becomes a
note and the caller falls back to sysfs.

pynvml quirk (13.x): ``NVML_P2P_CAPS_INDEX_READ`` is defined as the tuple ``(0,)`` (a stray comma), so the
capability indexes are spelled as integers here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from orchestrator.hardware.pci import PCI_DIR, norm_pci, pci_locality
from orchestrator.hardware.rootfs import RootFS
from orchestrator.hardware.topology import Gpu

P2P_READ = 0
P2P_NVLINK = 2
TEMPERATURE_GPU = 0                 # NVML_TEMPERATURE_GPU
_NOT_AVAILABLE = 1 << 62            # NVML_VALUE_NOT_AVAILABLE and its kin are huge numbers


def _s(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


class Nvml:
    """NVML, opened once; GPUs by NVML index. Never raises when made: ``available`` says whether NVML started and
    found a GPU, ``error`` what failed (None when NVML started and listed its GPUs). Close it when done."""

    def __init__(self, module: Any = None) -> None:
        self.available = False
        self.error: Exception | None = None
        self.started = False
        self.module = module
        self.handles: list[Any] = []
        self._uuids: list[str] | None = None
        try:
            if self.module is None:
                import pynvml

                self.module = pynvml
            self.module.nvmlInit()
        except Exception as err:            # no library, no driver, driver/library mismatch ...
            self.error = err
            return
        self.started = True
        try:
            n = int(self.module.nvmlDeviceGetCount())
            self.handles = [self.module.nvmlDeviceGetHandleByIndex(i) for i in range(n)]
        except Exception as err:            # a GPU lost, ...
            self.error = err
            self.handles = []
        self.available = bool(self.handles)

    @classmethod
    def open(cls, module: Any = None) -> "Nvml | None":
        """NVML when a driver and at least one GPU answer, else None."""
        nv = cls(module)
        if not nv.available:
            nv.close()
            return None
        return nv

    def close(self) -> None:
        if self.started:
            self.started = self.available = False
            try:
                self.module.nvmlShutdown()
            except Exception:
                pass

    def __enter__(self) -> "Nvml":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def count(self) -> int:
        return len(self.handles)

    def driver_version(self) -> str:
        return _s(self.module.nvmlSystemGetDriverVersion())

    def name(self, i: int) -> str:
        return _s(self.module.nvmlDeviceGetName(self.handles[i]))

    def uuid(self, i: int) -> str:
        return self.uuids[i]

    @property
    def uuids(self) -> list[str]:
        if self._uuids is None:
            self._uuids = [_s(self.module.nvmlDeviceGetUUID(h)) for h in self.handles]
        return self._uuids

    def pci_bus_id(self, i: int) -> str:
        return _s(self.module.nvmlDeviceGetPciInfo(self.handles[i]).busId)

    def memory(self, i: int) -> tuple[int, int, int]:
        """(total, used, free) bytes."""
        m = self.module.nvmlDeviceGetMemoryInfo(self.handles[i])
        return int(m.total), int(m.used), int(m.free)

    def utilization(self, i: int) -> float:
        """Percent of the last sample period a kernel ran."""
        return float(self.module.nvmlDeviceGetUtilizationRates(self.handles[i]).gpu)

    def power_w(self, i: int) -> float | None:
        try:
            return self.module.nvmlDeviceGetPowerUsage(self.handles[i]) / 1000.0     # mW
        except Exception:
            return None

    def temperature_c(self, i: int) -> float | None:
        try:
            return float(self.module.nvmlDeviceGetTemperature(self.handles[i], TEMPERATURE_GPU))
        except Exception:
            return None

    def process_memory(self, i: int) -> dict[int, int]:
        """pid -> GPU bytes for compute processes on GPU ``i`` (empty when the driver does not say)."""
        try:
            procs = self.module.nvmlDeviceGetComputeRunningProcesses(self.handles[i])
        except Exception:
            return {}
        out = {}
        for p in procs:
            used = getattr(p, "usedGpuMemory", None)
            if used is not None and used < _NOT_AVAILABLE:
                out[int(p.pid)] = int(used)
        return out


@dataclass
class NvmlResult:
    ok: bool = False                       # NVML answered (possibly with zero GPUs)
    gpus: tuple[Gpu, ...] = ()
    driver: str | None = None
    note: str | None = None                # what failed and what was assumed
    extra: dict = field(default_factory=dict)


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
    nv = Nvml(pynvml)
    if not nv.started:
        name = type(nv.error).__name__
        if "LibraryNotFound" in name and not fs.listdir("proc/driver/nvidia/gpus"):
            return NvmlResult()  # no NVIDIA driver: a CPU-only machine, nothing to say
        return NvmlResult(note=f"NVML failed to start ({name}: {nv.error}): GPUs read from sysfs")
    try:
        if nv.error is not None:
            raise nv.error
        return _read(nv, fs)
    except Exception as err:  # NVML present but failing (GPU lost, driver/library mismatch ...)
        return NvmlResult(note=f"NVML failed ({type(err).__name__}: {err}): GPUs read from sysfs")
    finally:
        nv.close()


def _opt(fn, *args):
    """An optional NVML query: None when the device or driver does not support it."""
    try:
        return fn(*args)
    except Exception:
        return None


def _read(nv: Nvml, fs: RootFS) -> NvmlResult:

    pynvml, handles = nv.module, nv.handles
    driver = nv.driver_version()
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
