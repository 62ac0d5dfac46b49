"""Hardware discovery: what the machine is (sockets, NUMA nodes, cores, GPUs, links), live or recorded.

Pure model in ``topology``; readers with side effects in ``sysfs`` (any root path), ``nvml``, ``libnuma``,
``dump`` (save/load recorded machines); the bandwidth probe in ``probe`` (native sources in ``native/``).
Importing this package needs only the standard library (no numpy, pydantic, gguf or ray).
"""

from orchestrator.hardware.dump import load_dump, load_machine, save_dump
from orchestrator.hardware.sysfs import read_machine
from orchestrator.hardware.topology import (
    Bandwidth,
    Core,
    FrozenMap,
    Gpu,
    HugePages,
    Machine,
    NumaNode,
    Package,
    PciDevice,
)

__all__ = [
    "Bandwidth", "Core", "FrozenMap", "Gpu", "HugePages", "Machine", "NumaNode", "Package", "PciDevice",
    "load_dump", "load_machine", "read_machine", "save_dump",
]
