"""Live NUMA queries through py-libnuma (the ``numa`` package), used only on the live machine.

What it adds over sysfs: the nodes this process may allocate from as the kernel enforces them
(``numa_get_mems_allowed``) and per-node free memory at this instant (``numa_node_size64``). sysfs stays the
reference; when py-libnuma or libnuma.so is missing or broken we say so and carry on without it.

Known py-libnuma 1.2 defects (checked in its source): ``numa.info.numa_hardware_info()`` and
``node_to_cpus`` loops index nodes ``0..count-1`` (wrong on sparse node ids such as 0,8,250-255), and
``import numa`` raises AttributeError when libnuma.so is absent (``CDLL(find_library("numa"))`` becomes
``CDLL(None)``). We only call the per-node functions with real node ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LiveNuma:
    available: bool = False
    error: str | None = None
    mems_allowed: tuple[int, ...] | None = None
    total: dict[int, int] = field(default_factory=dict)
    free: dict[int, int] = field(default_factory=dict)


def live_info(node_ids: list[int]) -> LiveNuma:
    try:
        import numa  # py-libnuma
        from numa import info as ninfo
        from numa import memory as nmem
    except ImportError:
        return LiveNuma(error="py-libnuma is not installed")
    except Exception as err:  # libnuma.so missing: AttributeError/OSError at import
        return LiveNuma(error=f"{type(err).__name__}: {err}")
    try:
        if not ninfo.numa_available():
            return LiveNuma(available=False)
        out = LiveNuma(available=True)
        out.mems_allowed = tuple(nmem.get_allocation_allowed_nodes())
        for nid in node_ids:
            total, free = nmem.node_memory_info(nid)
            if total is not None and total >= 0:
                out.total[nid] = int(total)
                out.free[nid] = int(free)
        del numa
        return out
    except Exception as err:  # a broken binding must not break discovery
        return LiveNuma(error=f"{type(err).__name__}: {err}")
