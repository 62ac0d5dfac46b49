"""PCI devices in sysfs: address spelling and NUMA locality. Shared by the sysfs reader, NVML and the probe."""

from __future__ import annotations

import re

from orchestrator.hardware.rootfs import RootFS
from orchestrator.units import parse_cpulist, parse_cpumask

PCI_DIR = "sys/bus/pci/devices"


def norm_pci(addr: str) -> str:
    """``00000000:18:00.0`` / ``0000:18:00.0`` → ``0000:18:00.0``; wider domains kept (``10000:00:04.0``)."""
    addr = addr.strip().lower()
    m = re.fullmatch(r"([0-9a-f]+):([0-9a-f]{2}):([0-9a-f]{2})\.([0-7])", addr)
    if not m:
        return addr
    dom = m.group(1).lstrip("0").rjust(4, "0")
    return f"{dom}:{m.group(2)}:{m.group(3)}.{m.group(4)}"


def pci_locality(fs: RootFS, d: str) -> tuple[int, tuple[int, ...]]:
    """(numa_node or -1, local CPUs) of a PCI device directory."""
    text = fs.read_line(f"{d}/numa_node")
    try:
        node = int(text) if text is not None else None
    except ValueError:
        node = None
    text = fs.read_line(f"{d}/local_cpus")
    local: tuple[int, ...] = ()
    if text is not None:
        try:
            local = parse_cpumask(text)
        except ValueError:
            local = ()
    else:
        text = fs.read_line(f"{d}/local_cpulist")
        if text is not None and re.fullmatch(r"[0-9,\-:\s]*", text):
            local = parse_cpulist(text)
    return (node if node is not None and node >= 0 else -1), local
