"""Hardware discovery: what the machine is (sockets, NUMA nodes, cores, GPUs, links), live or recorded.

Pure model in ``topology``; readers with side effects in ``sysfs`` (any root path), ``nvml``, ``libnuma``,
``dump`` (save/load recorded machines); the bandwidth probe in ``probe`` (native sources in ``native/``).
Importing this package needs only the standard library (no numpy, pydantic, gguf or ray), and loads only the
pure model: the readers load when first used, so the planner (which reads ``Machine`` values) stays free of
tarfile, subprocess and ctypes.
"""

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

_READERS = {"load_dump": "dump", "load_machine": "dump", "save_dump": "dump", "read_machine": "sysfs"}


def __getattr__(name: str):
    if name in _READERS:
        import importlib

        return getattr(importlib.import_module(f"orchestrator.hardware.{_READERS[name]}"), name)
    raise AttributeError(f"module 'orchestrator.hardware' has no attribute {name!r}")
